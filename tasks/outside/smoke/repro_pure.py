"""Smoke test of the repro_pure fixture (CPU): greet() formats its greeting.

Tolerance: exact string equality.
"""

from __future__ import annotations

import importlib

from _harness import Result, run, verdict  # first: see _harness.py


def greet() -> Result:
    repro_pure = importlib.import_module("repro_pure")
    got = repro_pure.greet("x")
    return verdict(got == "hello, x", f"greet('x') == {got!r} (expected 'hello, x', exact)")


if __name__ == "__main__":
    run("greet", greet)
