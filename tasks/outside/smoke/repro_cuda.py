"""Smoke test of the repro_cuda fixture (GPU): vadd runs on the device.

vadd(x, y) of 4099 elements (several thread blocks and a partial one) must
equal Python's x[i] + y[i]. The inputs are multiples of 0.5 below 2**20, so
every sum is exact in float32 and float64: compared with ==. Without a GPU
the check is skipped, never passed.
"""

from __future__ import annotations

import importlib

from _harness import Result, run_gpu  # first: see _harness.py

N = 4099


def device_count() -> Result:
    vadd = importlib.import_module("repro_cuda._vadd")
    count = vadd.device_count()
    if count is None or count < 1:
        return "FAIL", f"torch sees a GPU but repro_cuda._vadd.device_count() == {count!r}"
    return "PASS", f"device_count() == {count}"


def vadd_matches() -> Result:
    vadd = importlib.import_module("repro_cuda._vadd")
    x = [0.5 * i for i in range(N)]
    y = [0.5 * (N - i) + 3.0 for i in range(N)]
    got = list(vadd.vadd(x, y))
    want = [a + b for a, b in zip(x, y, strict=True)]
    if len(got) != N:
        return "FAIL", f"vadd returned {len(got)} values for {N} inputs"
    bad = [i for i in range(N) if got[i] != want[i]]
    if bad:
        i = bad[0]
        return "FAIL", f"{len(bad)}/{N} sums differ; first at {i}: {got[i]!r} != {want[i]!r}"
    return "PASS", f"vadd of {N} elements equals Python addition exactly"


if __name__ == "__main__":
    run_gpu("device_count", device_count)
    run_gpu("vadd", vadd_matches)
