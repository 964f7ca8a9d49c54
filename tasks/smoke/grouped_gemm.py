"""Smoke test of grouped_gemm v1.1.4 (GPU): grouped_gemm.ops.gmm.

gmm(a, b, batch_sizes, trans_b) multiplies each row group of a (sizes in
batch_sizes, an int64 CPU tensor) by its own matrix of b. bf16 inputs, four
groups of 64/128/32/288 rows, K=256, N=384, trans_b False and True, forward
and backward, against a loop of float32 torch.matmul on the same (upcast)
inputs. Tolerance: norm-wise relative error ||x - ref|| / ||ref|| < 1e-2
for the output and for the gradients of a and b (bf16 rounding is ~4e-3).
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


SIZES = (64, 128, 32, 288)
K, N = 256, 384
REL_TOL = 1e-2


def case(trans_b: bool) -> Callable[[], Result]:
    def check() -> Result:
        torch = importlib.import_module("torch")
        ops = importlib.import_module("grouped_gemm.ops")
        gen = torch.Generator(device="cuda").manual_seed(0)
        kw = {"generator": gen, "device": "cuda", "dtype": torch.bfloat16}
        a = torch.randn(sum(SIZES), K, **kw).requires_grad_(True)
        b_shape = (len(SIZES), N, K) if trans_b else (len(SIZES), K, N)
        b = (torch.randn(b_shape, **kw) / K**0.5).requires_grad_(True)
        batch_sizes = torch.tensor(SIZES, dtype=torch.int64)
        dout = torch.randn(sum(SIZES), N, **kw)

        out = ops.gmm(a, b, batch_sizes, trans_b=trans_b)
        out.backward(dout)

        a_ref = a.detach().float().requires_grad_(True)
        b_ref = b.detach().float().requires_grad_(True)
        pieces, start = [], 0
        for i, rows in enumerate(SIZES):
            rhs = b_ref[i].t() if trans_b else b_ref[i]
            pieces.append(a_ref[start : start + rows] @ rhs)
            start += rows
        ref = torch.cat(pieces)
        ref.backward(dout.float())

        errs = {"out": rel_err(out, ref), "da": rel_err(a.grad, a_ref.grad), "db": rel_err(b.grad, b_ref.grad)}
        detail = (
            f"bf16 groups {list(SIZES)}, K={K}, N={N}, trans_b={trans_b}: "
            + ", ".join(f"{n} rel={e:.1e}" for n, e in errs.items())
            + f" (tol {REL_TOL:g}) vs fp32 matmul loop"
        )
        return verdict(all(e < REL_TOL for e in errs.values()), detail)

    return check


if __name__ == "__main__":
    run_gpu("gmm", case(trans_b=False))
    run_gpu("gmm-trans-b", case(trans_b=True))
