"""Longest unit first: reorder a ninja manifest's build edges by their last compile times.

ninja starts equally ready edges in manifest order, and the manifests our
packages generate list their units alphabetically (setuptools sorts an
extension's sources; CMake sorts too). FA2's 84 kernels then start in name
order, so its slowest units (the split-KV forward kernels, 500 to 760 s each
on the H200 host) start last, 200 to 300 s in, and set the package's wall time.
Starting the longest units first is the classic LPT schedule.

The jobserver's ninja shim (tasks/engine/jobserver.py) runs this file, before the
real ninja, on the manifest ninja is about to read: each run of consecutive
``build`` blocks is stably sorted by the seconds that ``REPRO_UNIT_TIMES``
(a JSON object: output file name -> seconds) gives their first output, the
longest first; edges without a time keep their order after the timed ones.
Nothing else changes: the blocks' text, every other line, the manifest's
mtime. So the same objects are built with the same commands and linked in
the same order, and the wheel's bytes do not change; only the start order
does. The times come from the package's previous build in this cache and
from the lock's ``unit_times`` file (see tasks/stages/build.py).

Standard library only: the shim runs it with the doit process's Python,
outside any package, and a failure here never stops the build (the shim
ignores its exit status).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def _first_output(line: str) -> str:
    """The file name of a ``build`` line's first output (ninja's ``$`` escapes undone)."""
    rest = line[len("build ") :]
    out = []
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch == "$" and i + 1 < len(rest):
            out.append(rest[i + 1])
            i += 2
            continue
        if ch in " :|":
            break
        out.append(ch)
        i += 1
    return os.path.basename("".join(out))


def _blocks(lines: Sequence[str]) -> list[tuple[bool, list[str]]]:
    """Split a manifest into blocks: (is_build, lines); a build block is its line and its indented ones."""
    blocks: list[tuple[bool, list[str]]] = []
    for line in lines:
        indented = line[:1] in (" ", "\t") and line.strip() != ""
        if indented and blocks:
            blocks[-1][1].append(line)
        else:
            blocks.append((line.startswith("build "), [line]))
    return blocks


def reorder_text(text: str, times: Mapping[str, float]) -> str:
    """``text`` with each run of consecutive build blocks sorted longest first by ``times``."""
    lines = text.splitlines(keepends=True)
    blocks = _blocks(lines)
    result: list[str] = []
    run: list[list[str]] = []

    def flush() -> None:
        keyed = [(-float(times.get(_first_output(b[0]), -1.0)), i, b) for i, b in enumerate(run)]
        for _, _, block in sorted(keyed, key=lambda k: (k[0], k[1])):
            result.extend(block)
        run.clear()

    for is_build, block in blocks:
        if is_build:
            run.append(block)
            continue
        if run and block[0].strip() == "":
            # A blank line between build blocks does not end their run; keep it after the block before it.
            run[-1] = run[-1] + block
            continue
        flush()
        result.extend(block)
    flush()
    return "".join(result)


def manifest_path(args: Sequence[str]) -> Path:
    """The manifest a ninja command line reads: ``-C DIR`` and ``-f FILE`` as ninja parses them."""
    directory, name = ".", "build.ninja"
    it = iter(args)
    for arg in it:
        if arg == "-C":
            directory = next(it, directory)
        elif arg.startswith("-C"):
            directory = arg[2:]
        elif arg == "-f":
            name = next(it, name)
        elif arg.startswith("-f"):
            name = arg[2:]
    return Path(directory) / name


def reorder_manifest(manifest: Path, times: Mapping[str, float]) -> bool:
    """Rewrite ``manifest`` in place (same mtime) if the order changes; True if it did."""
    text = manifest.read_text()
    new = reorder_text(text, times)
    if new == text:
        return False
    stat = manifest.stat()
    tmp = manifest.with_name(f".{manifest.name}.reorder-{os.getpid()}")
    tmp.write_text(new)
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(tmp, manifest)
    return True


def read_object(path: Path) -> dict[str, object]:
    """A JSON object from ``path``; a missing, unreadable or other file counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return {str(k): v for k, v in data.items()} if isinstance(data, dict) else {}


#: A unit's seconds past this (about eleven days) are no figure: a record of ``1e999`` or ``1e20`` is none.
MAX_SECONDS = 1e6


def load_times(path: Path) -> dict[str, float]:
    """A times file: a JSON object of output file name -> seconds; anything else counts as empty, and so
    does a value that is not a finite number of seconds between 0 and :data:`MAX_SECONDS` (NaN, ``1e999``)."""
    out = {}
    for k, v in read_object(path).items():
        if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= MAX_SECONDS:
            out[k] = float(v)  # (NaN fails the comparison, infinity and 10**400 the bound)
    return out


HINTS_FILE = "unit-times.json"


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: ninjaorder.py TIMES.json [ninja arguments]", file=sys.stderr)
        return 2
    times = load_times(Path(argv[0]))
    manifest = manifest_path(argv[1:])
    if times and manifest.is_file():
        reorder_manifest(manifest, times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
