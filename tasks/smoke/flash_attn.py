"""Smoke test of FlashAttention 2 (flash-attn 2.7.4.post1, GPU sm_80+).

flash_attn.flash_attn_func(q, k, v, dropout_p=0.0, causal=...) on bf16 q, k,
v of shape (batch 2, seqlen 512, heads 8, head dim 128), causal and not,
forward and backward, against torch.nn.functional.scaled_dot_product_attention
in float32 on the same (upcast) inputs. Tolerances for bf16: forward max
|err| < 2e-2; dq, dk, dv norm-wise relative error < 5e-2.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from _harness import Result, max_abs_err, rel_err, run_gpu, sdpa_reference, verdict  # first: see _harness.py

BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 512, 8, 128
FWD_MAX_ABS = 2e-2
GRAD_REL = 5e-2


def compare(torch: Any, func: Callable[..., Any], causal: bool) -> Result:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (BATCH, SEQLEN, HEADS, HEAD_DIM)
    q, k, v = (
        torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3)
    )
    dout = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    res = func(q, k, v, dropout_p=0.0, causal=causal)
    out = res[0] if isinstance(res, tuple) else res
    out.backward(dout)
    ref, leaves = sdpa_reference(torch, q, k, v, causal)
    ref.backward(dout.float())
    fwd = max_abs_err(out, ref)
    grads = {
        name: rel_err(t.grad, leaf.grad.transpose(1, 2))
        for name, t, leaf in zip(("dq", "dk", "dv"), (q, k, v), leaves, strict=True)
    }
    ok = fwd < FWD_MAX_ABS and all(e < GRAD_REL for e in grads.values())
    detail = (
        f"bf16 {shape}, causal={causal}: fwd max|err|={fwd:.1e} (tol {FWD_MAX_ABS:g}); "
        + ", ".join(f"{n} rel={e:.1e}" for n, e in grads.items())
        + f" (tol {GRAD_REL:g}) vs fp32 SDPA"
    )
    return verdict(ok, detail)


def case(causal: bool) -> Callable[[], Result]:
    def check() -> Result:
        torch = importlib.import_module("torch")
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return "SKIP", f"FlashAttention 2 needs sm_80 or newer; this GPU is sm_{major}{minor}"
        flash_attn = importlib.import_module("flash_attn")
        return compare(torch, flash_attn.flash_attn_func, causal)

    return check


if __name__ == "__main__":
    run_gpu("fwd-bwd", case(causal=False))
    run_gpu("fwd-bwd-causal", case(causal=True))
