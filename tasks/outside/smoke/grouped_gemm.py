"""Smoke test of grouped_gemm v1.1.4 (GPU): grouped_gemm.ops.gmm.

gmm(a, b, batch_sizes, trans_b) multiplies each row group of a (sizes in
batch_sizes, an int64 CPU tensor) by its own matrix of b. bf16 inputs, four
groups of 64/128/32/288 rows, K=256, N=384, trans_b False and True, forward
and backward, against a loop of float32 torch.matmul on the same (upcast)
inputs. Tolerance: norm-wise relative error ||x - ref|| / ||ref|| < 1e-2
for the output and for the gradients of a and b (bf16 rounding is ~4e-3).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from _harness import Result, rel_err, run_gpu, verdict  # first: see _harness.py

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
