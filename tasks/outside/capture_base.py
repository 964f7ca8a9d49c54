"""What a base environment has installed, for ``[runtime] base_python``/``base_image``/``base_capture``.

Runs in the base's own interpreter with the standard library only (Python 3.8 or newer), so it can be
copied to a cluster node that has no checkout of this project and no network::

    python3 capture_base.py > base.json          # the interpreter the wheels will be installed into
    python3 capture_base.py base.json

and the file named in the lock (``base_capture = "bases/node.json"``): `doit lock` reads it there. The
document: ``{"format": "reprostack-base/1", "python": "3.12", "dists": {name: [version, [Requires-Dist]]}}``,
every installed distribution (the first of a name on the interpreter's path, as import sees it), its
exact version with the local label, and its requirements (markers kept: the resolver evaluates them).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

FORMAT = "reprostack-base/1"


def capture() -> dict[str, object]:
    found: dict[str, list[object]] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in found:
            found[name.lower()] = [dist.version, list(dist.requires or [])]
    return {"format": FORMAT, "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "dists": found}


def main(argv: list[str]) -> int:
    text = json.dumps(capture(), indent=1, sort_keys=True) + "\n"
    if len(argv) > 1:
        tmp = argv[1] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, argv[1])
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
