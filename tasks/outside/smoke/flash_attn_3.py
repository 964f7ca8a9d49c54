"""Smoke test of FlashAttention 3 (GPU, sm_90): flash_attn_3.flash_attn_interface, every kernel family the
build holds.

flash-attention 27f501d hopper/, against torch.nn.functional.scaled_dot_product_attention in float32 (math
backend) on the same upcast inputs:

- ``fwd-bwd``, ``fwd-bwd-causal``: flash_attn_func, bf16, (batch 2, seqlen 512, heads 8, head dim 128);
- ``fwd-bwd-<dtype>-d<D>``: bf16 and fp16, each head dimension 64, 96, 128, 192, 256, causal;
- ``fwd-d192-dv128``: bf16, q/k head dim 192 and v head dim 128 (the ``hdimdiff`` kernels), forward;
- ``fwd-e4m3-d<D>``: float8_e4m3fn q, k, v (no descale), each head dimension, forward (FA3 has no fp8
  backward); the output is bf16;
- ``varlen-fwd-bwd``: flash_attn_varlen_func on three sequences of 128, 200 and 184 tokens, causal;
- ``paged-kv``: flash_attn_with_kvcache, one query token per sequence against a KV cache in pages of 64
  tokens listed in a page table, two sequences of 300 and 77 cached tokens.

What the build left out (its ``FLASH_ATTENTION_DISABLE_*`` flags: the ``minimal`` profile builds bf16,
head dim 128 only) is SKIP, with FA3's own words: "This flash attention build does not support FP16.",
"... at most 128". A head dimension whose kernel was left out but below a larger one that was built
runs on that one (FA3 rounds it up): it passes or fails as that kernel computes it.

Tolerances: bf16 and fp16, forward max |err| < 2e-2, dq, dk, dv norm-wise relative error
||g - ref|| / ||ref|| < 5e-2; fp8 (3 mantissa bits, P quantized to fp8 inside the kernel), the forward's
norm-wise relative error < 1e-1.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from typing import Any

from _harness import (  # first: see _harness.py
    FWD_MAX_ABS,
    SHORT,
    Result,
    compare_attention,
    first_output,
    judge_fwd_bwd,
    max_abs_err,
    rel_err,
    run_gpu,
    sdpa_reference,
    verdict,
)

HEAD_DIMS = (64, 96, 128, 192, 256)
DEVICE = "cuda"
FP8_REL = 1e-1
#: FA3's words where a build lacks what a call needs: the check is then SKIP.
NOT_BUILT = ("This flash attention build does not support", "only supports head dimension at most")


def _sm90(torch: Any) -> str | None:
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"FlashAttention 3 kernels need sm_90; this GPU is sm_{major}{minor}"
    return None


def _guarded(fn: Callable[[Any, Any], Result]) -> Callable[[], Result]:
    """``fn(torch, iface)`` on sm_90, SKIP where the build says it lacks the kernel family."""

    def check() -> Result:
        torch = importlib.import_module("torch")
        reason = _sm90(torch)
        if reason is not None:
            return "SKIP", reason
        iface = importlib.import_module("flash_attn_3.flash_attn_interface")
        try:
            return fn(torch, iface)
        except RuntimeError as exc:
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if any(words in said for words in NOT_BUILT):
                return "SKIP", f"not in this build: {said}"
            raise

    return check


def fwd_bwd(dtype_name: str, head_dim: int) -> Callable[[], Result]:
    def run(torch: Any, iface: Any) -> Result:
        shape = (2, 256, 4, head_dim)
        return compare_attention(
            torch, iface.flash_attn_func, True, dtype=dtype_name, shape=shape, device=DEVICE, seed=head_dim
        )

    return _guarded(run)


def fwd_hdimdiff(torch: Any, iface: Any) -> Result:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k = (torch.randn((2, 256, 4, 192), generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn((2, 256, 4, 128), generator=gen, device=DEVICE, dtype=torch.bfloat16)
    out = first_output(iface.flash_attn_func(q, k, v, causal=True))
    ref, _ = sdpa_reference(torch, q, k, v, True)
    fwd = max_abs_err(out, ref)
    shape = "q, k (2, 256, 4, 192), v (2, 256, 4, 128)"
    return verdict(
        fwd < FWD_MAX_ABS and tuple(out.shape) == (2, 256, 4, 128),
        f"bf16 {shape}, causal: out {tuple(out.shape)}, fwd max|err|={fwd:.1e} (tol {FWD_MAX_ABS:g}) vs fp32 SDPA",
    )


def fwd_e4m3(head_dim: int) -> Callable[[], Result]:
    def run(torch: Any, iface: Any) -> Result:
        gen = torch.Generator(device=DEVICE).manual_seed(100 + head_dim)
        shape = (2, 256, 4, head_dim)
        q, k, v = (
            torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            for _ in range(3)
        )
        out = first_output(iface.flash_attn_func(q, k, v, causal=True))
        ref, _ = sdpa_reference(torch, q, k, v, True)  # on the fp8 values themselves, upcast
        err = rel_err(out, ref)
        return verdict(
            err < FP8_REL,
            f"float8_e4m3fn {shape}, causal: out {str(out.dtype).replace('torch.', '')}, "
            f"rel={err:.1e} (tol {FP8_REL:g}) vs fp32 SDPA on the same values",
        )

    return _guarded(run)


def varlen(torch: Any, iface: Any) -> Result:
    lens = (128, 200, 184)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    total, heads, dim = sum(lens), 8, 128
    q, k, v = (
        torch.randn((total, heads, dim), generator=gen, device=DEVICE, dtype=torch.bfloat16).requires_grad_(True)
        for _ in range(3)
    )
    dout = torch.randn((total, heads, dim), generator=gen, device=DEVICE, dtype=torch.bfloat16)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, device=DEVICE, dtype=torch.int32)
    out = first_output(iface.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True))
    out.backward(dout)
    refs, leaves = [], []
    for a, b in itertools.pairwise(starts):
        ref, leaf = sdpa_reference(torch, q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), True)
        refs.append(ref.squeeze(0))
        leaves.append(leaf)
    ref = torch.cat(refs)
    ref.backward(dout.float())
    ref_grads = [torch.cat([leaf[i].grad.transpose(1, 2).squeeze(0) for leaf in leaves]) for i in range(3)]
    ok, figures = judge_fwd_bwd(out, ref, (q.grad, k.grad, v.grad), ref_grads)
    return verdict(
        ok,
        f"bf16, sequences of {', '.join(map(str, lens))} tokens, {heads} heads, head dim {dim}, causal: "
        f"{figures} vs fp32 SDPA per sequence",
    )


def paged_kv(torch: Any, iface: Any) -> Result:
    page, heads, dim = 64, 8, 128
    cached = (300, 77)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    per_seq = [-(-n // page) for n in cached]
    pages = sum(per_seq) + 2  # two pages no sequence lists
    k_cache, v_cache = (
        torch.randn((pages, page, heads, dim), generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)
    )
    order = torch.randperm(pages, generator=gen, device=DEVICE).to(torch.int32)  # pages out of order
    table = torch.zeros((len(cached), max(per_seq)), device=DEVICE, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    q = torch.randn((len(cached), 1, heads, dim), generator=gen, device=DEVICE, dtype=torch.bfloat16)
    seqlens = torch.tensor(cached, device=DEVICE, dtype=torch.int32)
    out = first_output(
        iface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=True)
    )
    worst = 0.0
    for b, n in enumerate(cached):
        idx = table[b, : per_seq[b]].long()
        k = k_cache[idx].reshape(-1, heads, dim)[:n].unsqueeze(0)
        v = v_cache[idx].reshape(-1, heads, dim)[:n].unsqueeze(0)
        # One query token after n cached ones, causal aligned bottom right: it sees all n.
        ref, _ = sdpa_reference(torch, q[b : b + 1], k, v, False)
        worst = max(worst, max_abs_err(out[b : b + 1], ref))
    return verdict(
        worst < FWD_MAX_ABS,
        f"bf16 decode, {heads} heads, head dim {dim}, pages of {page} tokens out of order, {cached} cached "
        f"tokens: fwd max|err|={worst:.1e} (tol {FWD_MAX_ABS:g}) vs fp32 SDPA on the gathered cache",
    )


def case(causal: bool) -> Callable[[], Result]:
    return _guarded(lambda torch, iface: compare_attention(torch, iface.flash_attn_func, causal, device=DEVICE))


if __name__ == "__main__":
    run_gpu("fwd-bwd", case(causal=False))
    run_gpu("fwd-bwd-causal", case(causal=True))
    for dtype_name in ("bfloat16", "float16"):
        for d in HEAD_DIMS:
            run_gpu(f"fwd-bwd-{SHORT[dtype_name]}-d{d}", fwd_bwd(dtype_name, d))
    run_gpu("fwd-d192-dv128", _guarded(fwd_hdimdiff))
    for d in HEAD_DIMS:
        run_gpu(f"fwd-e4m3-d{d}", fwd_e4m3(d))
    run_gpu("varlen-fwd-bwd", _guarded(varlen))
    run_gpu("paged-kv", _guarded(paged_kv))
