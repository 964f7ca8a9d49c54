"""Helpers shared by the smoke scripts: result lines, GPU gating, error measures.

`doit verify` copies this module next to the script it runs; a script imports
it first, and on import it takes the scripts' directory off ``sys.path`` so a
script named like its package (flash_attn.py) cannot import itself.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# Run by path, a script's own directory comes first on sys.path, where a
# script named like its package (flash_attn.py) would import itself. This
# module lives in that directory and is imported first: drop the directory now.
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
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        # An environment without torch (a runtime image on a plain base): the
        # device nodes tell whether a GPU was passed in; the checks that need
        # torch then fail on their own import.
        if glob.glob("/dev/nvidia[0-9]*"):
            return None
        if GPU_MODE == "1":
            raise RuntimeError("REPRO_VERIFY_GPU=1 requires a GPU; no /dev/nvidia* device and no torch") from None
        return "no CUDA device: no /dev/nvidia* device node (torch is not installed)"
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


def sdpa_reference(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, list[Any]]:
    """float32 SDPA (math backend, no TF32) on (b, s, h, d) inputs; returns out and leaves."""
    torch.backends.cuda.matmul.allow_tf32 = False
    leaves = [t.detach().float().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    attention = importlib.import_module("torch.nn.attention")
    with attention.sdpa_kernel(attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return out.transpose(1, 2), leaves


# Attention comparisons (FA2, FA3): shape and bf16 tolerances.
BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 512, 8, 128
FWD_MAX_ABS = 2e-2
GRAD_REL = 5e-2
SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def compare_attention(
    torch: Any,
    func: Callable[..., Any],
    causal: bool,
    *,
    dtype: str = "bfloat16",
    shape: tuple[int, int, int, int] = (BATCH, SEQLEN, HEADS, HEAD_DIM),
    device: str = "cuda",
    seed: int = 0,
) -> Result:
    """Attention ``func(q, k, v, causal=...)`` in ``dtype`` (bf16 unless said) fwd+bwd vs fp32 SDPA, with the
    tolerances above; inputs of ``shape`` (batch, seqlen, heads, head dim)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kind = getattr(torch, dtype)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=kind).requires_grad_(True) for _ in range(3))
    dout = torch.randn(shape, generator=gen, device=device, dtype=kind)
    out = first_output(func(q, k, v, causal=causal))
    out.backward(dout)
    ref, leaves = sdpa_reference(torch, q, k, v, causal)
    ref.backward(dout.float())
    grads = [leaf.grad.transpose(1, 2) for leaf in leaves]
    ok, figures = judge_fwd_bwd(out, ref, (q.grad, k.grad, v.grad), grads)
    return verdict(ok, f"{SHORT.get(dtype, dtype)} {shape}, causal={causal}: {figures} vs fp32 SDPA")


def first_output(res: Any) -> Any:
    """An attention call's output: the first of what it returns where that is a tuple (out, softmax_lse)."""
    return res[0] if isinstance(res, tuple) else res


def judge_fwd_bwd(out: Any, ref: Any, grads: Sequence[Any], ref_grads: Sequence[Any]) -> tuple[bool, str]:
    """Forward max |err| and dq, dk, dv norm-wise relative errors against the reference's, by the tolerances
    above: whether all are within, and the figures as the checks print them."""
    fwd = max_abs_err(out, ref)
    rel = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)}
    ok = fwd < FWD_MAX_ABS and all(e < GRAD_REL for e in rel.values())
    figures = (
        f"fwd max|err|={fwd:.1e} (tol {FWD_MAX_ABS:g}); "
        + ", ".join(f"{n} rel={e:.1e}" for n, e in rel.items())
        + f" (tol {GRAD_REL:g})"
    )
    return ok, figures
