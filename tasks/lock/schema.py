"""The lock's schema primitives: a field's check, the value checks, and the collector of problems.

Pure and low in the stack: tasks/lock/lockfile.py (the lock's model and parser) and tasks/lock/kinds.py (the
source kinds, each declaring its own fields) both build their schemas from these. Every check returns
None for a good value, else the end of a sentence saying what the value must be.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.errors import LockError

SHA1_RE = re.compile(r"^[0-9a-f]{40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Field:
    check: Callable[[Any], str | None]
    required: bool = False


def is_str(v: Any) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def is_bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def is_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "must be a non-negative integer"


def is_number(v: Any) -> str | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and v > 0
    return None if ok else "must be a positive number"


def is_str_list(v: Any) -> str | None:
    ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
    return None if ok else "must be a list of strings"


def is_str_table(v: Any) -> str | None:
    ok = isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
    return None if ok else "must be a table of strings"


def is_table(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be a table"


def is_sha1(v: Any) -> str | None:
    if not isinstance(v, str) or not SHA1_RE.match(v):
        return f"must be a full 40-character lowercase hex commit, got {v!r}"
    return None


def is_sha256(v: Any) -> str | None:
    if not isinstance(v, str) or not SHA256_RE.match(v):
        return f"must be a 64-character lowercase hex sha256, got {v!r}"
    return None


@functools.cache
def spdx_ids() -> dict[str, str]:
    """Lower-cased SPDX license and exception id -> its spelling.

    The list cyclonedx-python-lib validates SBOMs against, read directly
    (importing ``cyclonedx.spdx`` loads a large expression index, tens of
    milliseconds on every doit start).
    """
    from cyclonedx.schema._res import SPDX_JSON  # package data of the pinned cyclonedx-python-lib

    with open(SPDX_JSON) as fh:
        return {i.lower(): i for i in json.load(fh)["enum"]}


def _spdx_syntax(tokens: list[str]) -> bool:
    """Whether ``tokens`` form ``term ((AND|OR) term)*``, term = ``id [WITH id]`` or a parenthesised expression."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            if not expression() or pos >= len(tokens) or tokens[pos] != ")":
                return False
            pos += 1
            return True
        if pos >= len(tokens) or tokens[pos] in ("AND", "OR", "WITH", "(", ")"):
            return False
        pos += 1
        if pos < len(tokens) and tokens[pos] == "WITH":
            pos += 1
            if pos >= len(tokens) or tokens[pos] in ("AND", "OR", "WITH", "(", ")"):
                return False
            pos += 1
        return True

    def expression() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(tokens) and tokens[pos] in ("AND", "OR"):
            pos += 1
            if not term():
                return False
        return True

    return expression() and pos == len(tokens)


def is_license(v: Any) -> str | None:
    if not isinstance(v, str) or not v.strip():
        return "must be an SPDX license id or expression such as 'Apache-2.0' or 'BSD-3-Clause AND MIT'"
    tokens = re.findall(r"[()]|[^\s()]+", v)
    known = spdx_ids()
    unknown = [t for t in tokens if t not in ("AND", "OR", "WITH", "(", ")") and known.get(t.lower()) != t]
    if unknown:
        fixed = [known.get(t.lower(), "") for t in unknown]
        hint = f" (perhaps you meant {' '.join(repr(f) for f in fixed if f)}?)" if any(fixed) else ""
        return f"has {', '.join(repr(t) for t in unknown)}, not SPDX license ids{hint} (see https://spdx.org/licenses/)"
    if not _spdx_syntax(tokens):
        return f"is not a valid SPDX license expression: {v!r} (write e.g. 'Apache-2.0 AND MIT')"
    return None


def suggest(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (perhaps you meant {close[0]!r}?)" if close else ""


class Problems:
    """Collects every problem of one file before raising."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[str] = []
        self.pins: list[str] = []
        self.pin_wheres: list[str] = []

    def unpinned(self, where: str, message: str) -> None:
        """A pin `doit lock` can fill in: an error, except while locking."""
        self.pins.append(f"{self.path}: [{where}] {message}")
        self.pin_wheres.append(where)

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{self.path}: [{where}] {message}" if where else f"{self.path}: {message}")

    def check_table(self, where: str, table: Mapping[str, Any], schema: Mapping[str, Field]) -> bool:
        ok = True
        for key, value in table.items():
            if key not in schema:
                self.add(
                    where,
                    f"unknown key {key!r}{suggest(key, schema)}; allowed keys: {', '.join(schema)}",
                )
                ok = False
                continue
            err = schema[key].check(value)
            if err:
                self.add(where, f"{key} {err}")
                ok = False
        for key, spec in schema.items():
            if spec.required and key not in table:
                self.add(where, f"missing required key {key!r}")
                ok = False
        return ok

    def raise_if_any(self, require_pins: bool) -> None:
        items = self.items + (self.pins if require_pins else [])
        if items:
            raise LockError(format_problems(self.path, items))


def format_problems(path: Path, items: list[str]) -> str:
    n = len(items)
    head = f"{path}: {n} problem{'s' if n > 1 else ''} in the lock file:"
    return "\n".join([head, *("  - " + i for i in items)])
