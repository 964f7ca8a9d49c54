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

from _harness import (  # first: see _harness.py
    Result,
    compare_attention,
    run_gpu,
)


def case(causal: bool) -> Callable[[], Result]:
    def check() -> Result:
        torch = importlib.import_module("torch")
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return "SKIP", f"FlashAttention 2 needs sm_80 or newer; this GPU is sm_{major}{minor}"
        flash_attn = importlib.import_module("flash_attn")
        return compare_attention(torch, flash_attn.flash_attn_func, causal)

    return check


if __name__ == "__main__":
    run_gpu("fwd-bwd", case(causal=False))
    run_gpu("fwd-bwd-causal", case(causal=True))
