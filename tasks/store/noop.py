"""The no-op's record in the build history (``timings/noop.json``, beside tasks/store/history.py's records):
what a `doit wheels` of a lock and profile took besides its tasks' actions (start-up, the lock, the keys,
doit's checks), which tasks/cli/graph.py's reporter measures at the end of every run and `doit plan`
forecasts a run with nothing to build by. A module of its own, on the standard library and fsutil alone,
because a no-op writes it and must not load the rest of the history."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from tasks.core.fsutil import write_atomic

#: How many lock/profile pairs ``timings/noop.json`` keeps (the newest).
KEPT = 16
#: Seconds past which a no-op record is no record.
LIMIT = 3600.0


def path(cache_root: Path) -> Path:
    return cache_root / "timings" / "noop.json"


def _key(lock_sha256: str, profile: str) -> str:
    return f"{lock_sha256}:{profile}"


def _read(file: Path) -> dict[str, Any]:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _number(value: object, limit: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0 < value <= limit else None


def read(cache_root: Path, lock_sha256: str, profile: str) -> float | None:
    """The seconds a `doit wheels` of this lock and profile took besides its tasks' actions at its last run
    that measured them; None without a (readable) record."""
    found = _read(path(cache_root)).get(_key(lock_sha256, profile))
    return _number(found.get("seconds"), LIMIT) if isinstance(found, dict) else None


def record(cache_root: Path, lock_sha256: str, profile: str, seconds: float) -> None:
    """Keep ``seconds`` for this lock and profile. Nothing is written where the record already says it within
    a quarter (a run of no-ops writes once), nor where the cache cannot be written (no record: the plan
    then forecasts by its own time)."""
    if _number(seconds, LIMIT) is None:
        return
    file = path(cache_root)
    doc = _read(file)
    key = _key(lock_sha256, profile)
    old = doc.pop(key, None)
    before = _number(old.get("seconds"), LIMIT) if isinstance(old, dict) else None
    if before is not None and abs(seconds - before) <= 0.25 * before:
        return
    kept = [(k, v) for k, v in doc.items() if isinstance(v, dict) and _number(v.get("date"), 4102444800.0)]
    kept.sort(key=lambda kv: kv[1]["date"])
    kept = [*kept[-(KEPT - 1) :], (key, {"seconds": round(seconds, 3), "date": round(time.time())})]
    with contextlib.suppress(OSError):
        write_atomic(file, json.dumps(dict(kept), indent=0, sort_keys=True) + "\n")
