"""Smoke test of TransformerEngine 2.4 (PyTorch) with FlashAttention 2 and 3.

- fp8-linear (GPU, FP8-capable: sm_89+): te.Linear(256, 512) in bf16 under
  te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()) on a (128, 256)
  input, forward and backward, after three warm-up steps (delayed scaling
  takes its scales from earlier steps' amax), against
  torch.nn.functional.linear in float32 with the same weights. Tolerance for
  FP8 (E4M3 forward, E5M2 gradients): norm-wise relative error
  ||x - ref|| / ||ref|| < 0.1 for the output and the input, weight and bias
  gradients.
- fa3-available: TE sees flash-attn-3 (FlashAttentionUtils.v3_is_installed).
- dpa-fa3 (GPU, sm_90): te.DotProductAttention (bshd, 8 heads, head dim 128,
  batch 2, seqlen 512), no mask and causal, with only the flash-attention
  backend allowed (NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0,
  set before TE is imported); TE must select FlashAttention 3. bf16 forward
  and backward against float32 SDPA: forward max |err| < 2e-2, dq, dk, dv
  norm-wise relative error < 5e-2.
- fa2-version: TE's flash-attn version check accepts the installed flash-attn
  (FlashAttentionUtils.is_installed; TE 2.4 takes 2.1.1 <= v <= 2.7.4.post1).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from _harness import Result, max_abs_err, rel_err, run, run_gpu, sdpa_reference, verdict  # first: see _harness.py

# Read by TE when it is imported (utils._NVTE_FLASH_ATTN) and when it picks a backend.
os.environ.update(NVTE_FLASH_ATTN="1", NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="0")

IN_FEATURES, OUT_FEATURES, TOKENS = 256, 512, 128
FP8_REL = 0.1
FP8_WARMUP_STEPS = 3
BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 512, 8, 128
FWD_MAX_ABS = 2e-2
GRAD_REL = 5e-2
DPA_PACKAGE = "transformer_engine.pytorch.attention.dot_product_attention"


def fa_utils() -> Any:
    return importlib.import_module(DPA_PACKAGE + ".utils").FlashAttentionUtils


def installed_version(dist: str) -> str | None:
    metadata = importlib.import_module("importlib.metadata")
    try:
        return str(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


def fp8_linear() -> Result:
    torch = importlib.import_module("torch")
    te = importlib.import_module("transformer_engine.pytorch")
    recipe = importlib.import_module("transformer_engine.common.recipe")
    fp8 = importlib.import_module("transformer_engine.pytorch.fp8")
    supported, reason = fp8.check_fp8_support()
    if not supported:
        return "SKIP", f"FP8 is not supported on this GPU: {reason}"
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = te.Linear(IN_FEATURES, OUT_FEATURES, bias=True, params_dtype=torch.bfloat16)
    fp8_recipe = recipe.DelayedScaling()
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(TOKENS, OUT_FEATURES, generator=gen, device="cuda", dtype=torch.bfloat16)

    def step() -> tuple[Any, Any]:
        layer.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = layer(inp)
        out.backward(dout)
        return out, inp

    for _ in range(FP8_WARMUP_STEPS):
        step()
    out, inp = step()

    weight = layer.weight.detach().float().requires_grad_(True)
    bias = layer.bias.detach().float().requires_grad_(True)
    x_ref = x.float().requires_grad_(True)
    ref = torch.nn.functional.linear(x_ref, weight, bias)
    ref.backward(dout.float())
    errs = {
        "out": rel_err(out, ref),
        "dgrad": rel_err(inp.grad, x_ref.grad),
        "wgrad": rel_err(layer.weight.grad, weight.grad),
        "bgrad": rel_err(layer.bias.grad, bias.grad),
    }
    detail = (
        f"te.Linear({IN_FEATURES}, {OUT_FEATURES}) bf16, fp8_autocast(DelayedScaling), "
        f"input ({TOKENS}, {IN_FEATURES}): "
        + ", ".join(f"{n} rel={e:.1e}" for n, e in errs.items())
        + f" (tol {FP8_REL:g}) vs fp32 F.linear"
    )
    return verdict(all(e < FP8_REL for e in errs.values()), detail)


def fa3_available() -> Result:
    importlib.import_module("transformer_engine.pytorch")
    fa = fa_utils()
    dist = installed_version("flash-attn-3")
    if dist is None:
        return "SKIP", "flash-attn-3 is not installed in this environment"
    if not fa.v3_is_installed:
        return "FAIL", (
            f"flash-attn-3 {dist} is installed but TE does not use it "
            f"(FlashAttentionUtils.v3_is_installed is False, fa3_version={fa.fa3_version})"
        )
    return "PASS", f"TE sees flash-attn-3 {fa.fa3_version} (FlashAttentionUtils.v3_is_installed)"


def dpa_fa3() -> Result:
    torch = importlib.import_module("torch")
    te = importlib.import_module("transformer_engine.pytorch")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return "SKIP", f"FlashAttention 3 runs on sm_90 only; this GPU is sm_{major}{minor}"
    if not fa_utils().v3_is_installed:
        return "FAIL", "TE does not see flash-attn-3 (FlashAttentionUtils.v3_is_installed is False)"
    backends = importlib.import_module(DPA_PACKAGE)._attention_backends
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (BATCH, SEQLEN, HEADS, HEAD_DIM)
    parts = []
    ok = True
    for mask in ("no_mask", "causal"):
        dpa = te.DotProductAttention(HEADS, HEAD_DIM, qkv_format="bshd", attn_mask_type=mask, attention_dropout=0.0)
        q, k, v = (
            torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(3)
        )
        dout = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        out = dpa(q, k, v)  # (batch, seqlen, heads * head_dim)
        chosen = backends.get("flash_attention_backend")
        if not backends.get("use_flash_attention") or getattr(chosen, "major", None) != 3:
            return "FAIL", (
                f"TE did not select FlashAttention 3 for {mask}: use_flash_attention="
                f"{backends.get('use_flash_attention')}, flash_attention_backend={chosen}"
            )
        out.backward(dout.reshape(out.shape))
        ref, leaves = sdpa_reference(torch, q, k, v, causal=mask == "causal")
        ref.backward(dout.float())
        fwd = max_abs_err(out, ref.reshape(out.shape))
        grads = {
            name: rel_err(t.grad, leaf.grad.transpose(1, 2))
            for name, t, leaf in zip(("dq", "dk", "dv"), (q, k, v), leaves, strict=True)
        }
        ok = ok and fwd < FWD_MAX_ABS and all(e < GRAD_REL for e in grads.values())
        parts.append(f"{mask}: fwd max|err|={fwd:.1e}, " + ", ".join(f"{n} rel={e:.1e}" for n, e in grads.items()))
    detail = (
        f"DotProductAttention bf16 {shape} on FlashAttention {chosen}: "
        + "; ".join(parts)
        + f" (tol fwd {FWD_MAX_ABS:g}, grads {GRAD_REL:g}) vs fp32 SDPA"
    )
    return verdict(ok, detail)


def fa2_version() -> Result:
    importlib.import_module("transformer_engine.pytorch")
    fa = fa_utils()
    dist = installed_version("flash-attn")
    if dist is None:
        return "SKIP", "flash-attn (FA2) is not installed in this environment"
    bounds = f"{fa.version_required} <= v <= {fa.max_version}"
    if not fa.is_installed:
        return "FAIL", f"TE rejects flash-attn {dist}: it accepts {bounds}"
    return "PASS", f"TE accepts flash-attn {fa.version} ({bounds})"


if __name__ == "__main__":
    run_gpu("fp8-linear", fp8_linear)
    run("fa3-available", fa3_available)
    run_gpu("dpa-fa3", dpa_fa3)
    run("fa2-version", fa2_version)
