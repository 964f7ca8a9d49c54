"""Smoke test of apex (GPU): FusedLayerNorm and FusedAdam against torch.

- FusedLayerNorm(1024) vs torch.nn.LayerNorm(1024) with the same random
  affine parameters, float32 input (8, 128, 1024), forward and backward.
  Tolerances: output max |err| < 1e-4; input, weight and bias gradients
  norm-wise relative error < 1e-4 (both compute in float32).
- FusedAdam(adam_w_mode=False, weight_decay=0) vs torch.optim.Adam, same
  float32 parameters and gradients, three steps (lr 1e-3). Tolerance:
  |p - p_ref| <= 1e-6 + 1e-5 * |p_ref| elementwise (a few float32 ulps for
  parameters of magnitude up to ~5, while each step moves them by ~1e-3).
"""

from __future__ import annotations

import importlib

from _harness import Result, max_abs_err, rel_err, run_gpu, verdict  # first: see _harness.py

HIDDEN = 1024
LN_FWD_MAX_ABS = 1e-4
LN_GRAD_REL = 1e-4
ADAM_ATOL = 1e-6
ADAM_RTOL = 1e-5
ADAM_STEPS = 3


def layer_norm() -> Result:
    torch = importlib.import_module("torch")
    normalization = importlib.import_module("apex.normalization")
    gen = torch.Generator(device="cuda").manual_seed(0)
    fused = normalization.FusedLayerNorm(HIDDEN).cuda()
    ref = torch.nn.LayerNorm(HIDDEN).cuda()
    with torch.no_grad():
        weight = 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")
        bias = 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")
        for module in (fused, ref):
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    x = torch.randn(8, 128, HIDDEN, generator=gen, device="cuda")
    dout = torch.randn(8, 128, HIDDEN, generator=gen, device="cuda")
    x_fused = x.clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    out = fused(x_fused)
    out.backward(dout)
    want = ref(x_ref)
    want.backward(dout)
    fwd = max_abs_err(out, want)
    grads = {
        "dx": rel_err(x_fused.grad, x_ref.grad),
        "dweight": rel_err(fused.weight.grad, ref.weight.grad),
        "dbias": rel_err(fused.bias.grad, ref.bias.grad),
    }
    ok = fwd < LN_FWD_MAX_ABS and all(e < LN_GRAD_REL for e in grads.values())
    detail = (
        f"fp32 (8, 128, {HIDDEN}): fwd max|err|={fwd:.1e} (tol {LN_FWD_MAX_ABS:g}); "
        + ", ".join(f"{n} rel={e:.1e}" for n, e in grads.items())
        + f" (tol {LN_GRAD_REL:g}) vs torch.nn.LayerNorm"
    )
    return verdict(ok, detail)


def adam() -> Result:
    torch = importlib.import_module("torch")
    optimizers = importlib.import_module("apex.optimizers")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1000, 100), (100,), (3, 5, 7)]
    fused_params = [torch.randn(s, generator=gen, device="cuda").requires_grad_(True) for s in shapes]
    ref_params = [p.detach().clone().requires_grad_(True) for p in fused_params]
    initial = [p.detach().clone() for p in fused_params]
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    fused = optimizers.FusedAdam(fused_params, adam_w_mode=False, **hyper)
    ref = torch.optim.Adam(ref_params, foreach=False, **hyper)
    for _ in range(ADAM_STEPS):
        for p, r in zip(fused_params, ref_params, strict=True):
            grad = torch.randn(p.shape, generator=gen, device="cuda")
            p.grad = grad.clone()
            r.grad = grad.clone()
        fused.step()
        ref.step()
    diff = max(max_abs_err(p, r) for p, r in zip(fused_params, ref_params, strict=True))
    close = all(
        bool(torch.allclose(p, r, rtol=ADAM_RTOL, atol=ADAM_ATOL))
        for p, r in zip(fused_params, ref_params, strict=True)
    )
    moved = min(max_abs_err(p, p0) for p, p0 in zip(fused_params, initial, strict=True))
    detail = (
        f"{ADAM_STEPS} steps, lr 1e-3, {len(shapes)} fp32 tensors: max|param diff|={diff:.1e} "
        f"(tol {ADAM_ATOL:g} + {ADAM_RTOL:g}*|p|) vs torch.optim.Adam; every tensor moved by >= {moved:.1e}"
    )
    return verdict(close and moved > 1e-4, detail)


if __name__ == "__main__":
    run_gpu("fused-layer-norm", layer_norm)
    run_gpu("fused-adam", adam)
