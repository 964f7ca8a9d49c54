"""Smoke test of FlashAttention 3 (GPU, sm_90): flash_attn_3.flash_attn_interface.

flash_attn_func (flash-attention 27f501d hopper/: returns (out, softmax_lse))
on bf16 q, k, v of shape (batch 2, seqlen 512, heads 8, head dim 128),
causal and not, forward and backward, against
torch.nn.functional.scaled_dot_product_attention in float32 on the same
(upcast) inputs. Tolerances for bf16: forward max |err| < 2e-2; dq, dk, dv
norm-wise relative error ||g - ref|| / ||ref|| < 5e-2.
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
        if (major, minor) != (9, 0):
            return "SKIP", f"FlashAttention 3 kernels need sm_90; this GPU is sm_{major}{minor}"
        iface = importlib.import_module("flash_attn_3.flash_attn_interface")
        return compare_attention(torch, iface.flash_attn_func, causal)

    return check


if __name__ == "__main__":
    run_gpu("fwd-bwd", case(causal=False))
    run_gpu("fwd-bwd-causal", case(causal=True))
