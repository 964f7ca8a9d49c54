"""The action key's document: everything that can change a package's wheel (its digest: tasks/core/digest.py).

Pure. Job counts and log verbosity are deliberately not part of the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.lock.lockfile import Package, Source

#: Bump when the build recipe's semantics change (new env, new normalisation, ...).
#: 2: builds at a canonical path with reproducibility flags (tasks/env/reproducible.py).
RECIPE_FORMAT = 2


def key_document(
    pkg: Package,
    *,
    sources: Mapping[str, Source],
    patches: Sequence[tuple[str, str]],
    toolchain: Mapping[str, Any],
    archs: Sequence[str],
    build_requires: Mapping[str, str],
    reproducible: Mapping[str, Any] | None = None,
    builder: Mapping[str, str] | None = None,
    hermetic: Mapping[str, Any] | None = None,
    requires_added: Sequence[str] = (),
) -> dict[str, Any]:
    """The canonical document hashed into the action key.

    ``patches`` is the ordered list of (file name, sha256); ``build_requires``
    maps each build requirement to its installed version; ``reproducible`` is
    what every build gets for bit-for-bit output (``reproducible.key_section``);
    ``builder`` pins the builder image (digest or ID) a build runs in, absent
    for host builds; ``hermetic`` is the pinned wheel set of the hermetic
    toolchain (``hermetic.key_section``), absent when the host's CUDA builds;
    ``requires_added`` are the Requires-Dist lines the build stage adds to the
    wheel's METADATA (the torch it was compiled against), absent when none.
    """
    jobs = set(pkg.jobs_env)
    doc = {
        "recipe_format": RECIPE_FORMAT,
        "package": pkg.name,
        "sources": {
            ".": sources[pkg.source].tree_sha256,
            **{dest: sources[name].tree_sha256 for dest, name in pkg.overlays},
        },
        "patches": [{"name": n, "sha256": d} for n, d in patches],
        "recipe": {
            "subdir": pkg.subdir,
            "env": {k: v for k, v in pkg.env if k not in jobs},
            "pip_args": list(pkg.pip_args),
            "build_requires": dict(sorted(build_requires.items())),
        },
        "toolchain": dict(toolchain),
        "archs": list(archs),
        "reproducible": dict(reproducible or {}),
    }
    if builder:
        doc["builder"] = dict(builder)
    if hermetic:
        doc["hermetic_toolchain"] = dict(hermetic)
    if requires_added:
        doc["requires_added"] = list(requires_added)
    return doc
