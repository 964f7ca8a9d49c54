"""Smoke test of the repro_pybind fixture (CPU): the pybind11 module computes.

Tolerances: add() exact; dot() of small integers exact in float64; a length
mismatch raises ValueError (pybind11's translation of std::invalid_argument).
"""

from __future__ import annotations

import importlib

from _harness import Result, run, verdict  # first: see _harness.py


def add() -> Result:
    core = importlib.import_module("repro_pybind")
    got = core.add(2, 3)
    return verdict(got == 5, f"add(2, 3) == {got!r} (expected 5, exact)")


def dot() -> Result:
    core = importlib.import_module("repro_pybind")
    got = core.dot([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    if got != 32.0:
        return "FAIL", f"dot([1,2,3],[4,5,6]) == {got!r} (expected 32.0, exact)"
    try:
        core.dot([1.0], [1.0, 2.0])
    except ValueError:
        return "PASS", "dot([1,2,3],[4,5,6]) == 32.0 (exact); length mismatch raises ValueError"
    return "FAIL", "dot() of lists of different lengths did not raise ValueError"


if __name__ == "__main__":
    run("add", add)
    run("dot", dot)
