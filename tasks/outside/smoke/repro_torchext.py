"""Smoke test of the repro_torchext fixture (CPU): a torch C++ extension op.

scaled_add(a, b, alpha) must equal a + alpha * b: torch.allclose with
rtol=1e-6, atol=1e-6 in float32 (one rounding of difference allowed for a
fused multiply-add). The op computes in float32 whatever the input dtype.
"""

from __future__ import annotations

import importlib

from _harness import Result, max_abs_err, run, verdict  # first: see _harness.py

TOLERANCES = {"float32": (1e-6, 1e-6)}


def scaled_add() -> Result:
    torch = importlib.import_module("torch")
    ext = importlib.import_module("repro_torchext")
    gen = torch.Generator().manual_seed(0)
    parts = []
    ok = True
    for name, (rtol, atol) in TOLERANCES.items():
        dtype = getattr(torch, name)
        a = torch.randn(64, 33, generator=gen, dtype=dtype)
        b = torch.randn(64, 33, generator=gen, dtype=dtype)
        got = ext.scaled_add(a, b, 0.5)
        want = a + 0.5 * b
        close = got.shape == want.shape and bool(torch.allclose(got, want, rtol=rtol, atol=atol))
        ok = ok and close
        parts.append(f"{name}: max|err|={max_abs_err(got, want):.1e} (rtol={rtol:g}, atol={atol:g})")
    return verdict(ok, "scaled_add(a, b, 0.5) vs a + 0.5*b: " + "; ".join(parts))


if __name__ == "__main__":
    run("scaled_add", scaled_add)
