"""Smoke test of a torch environment (the improve_muon and Megatron-on-AKS recipes' own checks).

What those recipes check by hand after building their images: the torch
version and that CUDA is available (improve_muon's "Test PyTorch
Installation"), that torch reaches the GPU (the AKS image's health checks),
and that FlexAttention, which improve_muon pins its archived torch for,
imports and computes. Which torch it must be is verify's install check (the
lock's prebuilt torch, or the provided set's version); this reports it.

FlexAttention with no score_mod and no mask is plain softmax attention: its
output on bf16 (1, 4, 256, 64) inputs must match float32 SDPA (math backend)
within 2e-2 max abs error, run eagerly (torch.compile would need a C
compiler in the environment, which a runtime image may not have).
"""

from __future__ import annotations

import importlib

from _harness import Result, max_abs_err, run, run_gpu, verdict  # first: see _harness.py

SHAPE = (1, 4, 256, 64)
FWD_MAX_ABS = 2e-2


def version() -> Result:
    torch = importlib.import_module("torch")
    return "PASS", f"torch {torch.__version__} (CUDA {torch.version.cuda}) from {torch.__file__}"


def cuda_available() -> Result:
    torch = importlib.import_module("torch")
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    return verdict(torch.cuda.is_available() and count > 0, f"{count} GPU(s): {', '.join(names) or 'none'}")


def gpu_matmul() -> Result:
    torch = importlib.import_module("torch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 512, generator=gen, device="cuda")
    b = torch.randn(512, 512, generator=gen, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    err = max_abs_err(a @ b, (a.double() @ b.double()))
    return verdict(
        err < 1e-2, f"float32 512x512 matmul on {torch.cuda.get_device_name()}: max|err|={err:.1e} vs float64"
    )


def flex_import() -> Result:
    flex = importlib.import_module("torch.nn.attention.flex_attention")
    names = ("flex_attention", "create_block_mask", "BlockMask")
    missing = [n for n in names if not hasattr(flex, n)]
    return verdict(not missing, f"torch.nn.attention.flex_attention has {', '.join(names)}"
                   + (f"; lacks {', '.join(missing)}" if missing else ""))  # fmt: skip


def flex_attention() -> Result:
    torch = importlib.import_module("torch")
    flex = importlib.import_module("torch.nn.attention.flex_attention")
    attention = importlib.import_module("torch.nn.attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = flex.flex_attention(q, k, v)
    with attention.sdpa_kernel(attention.SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = max_abs_err(out, ref)
    return verdict(err < FWD_MAX_ABS, f"bf16 {SHAPE} eager: max|err|={err:.1e} (tol {FWD_MAX_ABS:g}) vs fp32 SDPA")


if __name__ == "__main__":
    run("version", version)
    run("flex_import", flex_import)
    run_gpu("cuda_available", cuda_available)
    run_gpu("gpu_matmul", gpu_matmul)
    run_gpu("flex_attention", flex_attention)
