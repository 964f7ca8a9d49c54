"""`doit verify_image`'s entry point inside a container of the runtime image.

    python -m tasks.verify.incontainer WHEELS WORK GPU [train]

Runs :func:`tasks.verify.checks.verify_wheelhouse` on the interpreter that runs it
(the image's venv), with ``installed=True``: nothing is installed, the
checks see the image as it is; with ``train``, the training check too
(tasks/verify/train.py: torchrun on every GPU passed to the container). The report lands in WORK (report.json,
report.txt); the exit status is 0 whenever the report was written, failing
checks included, so that the caller tells a failed check from a crash.

Imports only tasks.verify.checks and what it needs (pyelftools, filelock,
pathspec), which `doit verify_image` mounts beside this package; a
``bin/`` beside the package (cuobjdump) goes at the end of PATH, so the
image's own CUDA tools win where it has them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (4, 5) or argv[4:] not in ([], ["train"]):
        sys.stderr.write("usage: python -m tasks.verify.incontainer WHEELS WORK GPU [train]\n")
        return 2
    wheels, work, gpu, train = Path(argv[1]), Path(argv[2]), argv[3], argv[4:] == ["train"]
    kit_bin = Path(__file__).resolve().parents[2] / "bin"
    if kit_bin.is_dir():
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", os.defpath), str(kit_bin)])
    from tasks.core.errors import ReproError
    from tasks.verify.checks import verify_wheelhouse

    try:
        report = verify_wheelhouse(
            wheels, work, python=sys.executable, gpu=gpu, log_dir=work / "logs", installed=True, train=train
        )
    except ReproError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    print(report.render(), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
