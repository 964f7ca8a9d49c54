"""Smoke test of the repro_cuda fixture (GPU): vadd runs on the device.

vadd(x, y) of 4099 elements (several thread blocks and a partial one) must
equal Python's x[i] + y[i]. The inputs are multiples of 0.5 below 2**20, so
every sum is exact in float32 and float64: compared with ==. Without a GPU
the check is skipped, never passed.
"""

from __future__ import annotations

# --- harness (keep identical to tasks/smoke/_harness.py) ---
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

# Run by path, a script's own directory comes first on sys.path, where a
# script named like its package (flash_attn.py) would import itself.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# "0": GPU checks off; "1": a GPU is required; unset: run them where one exists.
GPU_MODE = os.environ.get("REPRO_VERIFY_GPU", "")

Result = tuple[str, str]


def emit(check: str, status: str, detail: str) -> None:
    print(json.dumps({"check": check, "status": status, "detail": detail}), flush=True)


def run(check: str, fn: Callable[[], Result]) -> None:
    """One sub-check: ``fn`` returns (status, detail); an exception is a FAIL."""
    try:
        status, detail = fn()
    except Exception as exc:  # every failure becomes a FAIL line
        traceback.print_exc()
        sys.stderr.flush()
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    emit(check, status, detail)


def gpu_skip_reason() -> str | None:
    """Why GPU checks cannot run here, or None when they can."""
    if GPU_MODE == "0":
        return "GPU checks disabled (REPRO_VERIFY_GPU=0)"
    torch = importlib.import_module("torch")
    if torch.cuda.is_available():
        return None
    if GPU_MODE == "1":
        raise RuntimeError("REPRO_VERIFY_GPU=1 requires a GPU; torch.cuda.is_available() is False")
    return "no CUDA device: torch.cuda.is_available() is False"


def run_gpu(check: str, fn: Callable[[], Result]) -> None:
    """A GPU sub-check: SKIP with the reason (never PASS) when there is no GPU."""
    try:
        reason = gpu_skip_reason()
    except Exception as exc:
        emit(check, "FAIL", f"{type(exc).__name__}: {exc}")
        return
    if reason is not None:
        emit(check, "SKIP", reason)
        return
    run(check, fn)


def rel_err(a: Any, b: Any) -> float:
    """Norm-wise relative error ||a - b|| / ||b||, computed in float64."""
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def max_abs_err(a: Any, b: Any) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def verdict(ok: bool, detail: str) -> Result:
    return ("PASS" if ok else "FAIL"), detail


# --- end harness ---


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
