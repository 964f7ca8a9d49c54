"""FA3's smoke script (tasks/outside/smoke/flash_attn_3.py) on the CPU, against a stand-in for FA3's interface
made of torch's SDPA: its references (per-sequence varlen, the gathered paged cache, fp8 upcast) agree with an
exact implementation, and a build that lacks a kernel family is SKIP in FA3's words, never PASS or FAIL. What
the GPU kernels compute is checked only where `doit verify` runs on a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import types
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.runs_torch

SMOKE = Path(__file__).resolve().parents[2] / "tasks" / "outside" / "smoke"


def _attention(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Exact attention on (b, s, h, d), causal aligned bottom right as FA3's, in the output dtype FA3 gives."""
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    return out.transpose(1, 2).to(out_dtype)


def _stand_in(torch: Any) -> types.SimpleNamespace:
    def varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, causal: bool = False) -> Any:
        bounds = cu_q.tolist()
        parts = [
            _attention(torch, q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), causal).squeeze(0)
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(parts)

    def kvcache(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any, page_table: Any, causal: bool) -> Any:
        page = k_cache.shape[1]
        outs = []
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            idx = page_table[b, : -(-n // page)].long()
            k = k_cache[idx].reshape(-1, *k_cache.shape[2:])[:n].unsqueeze(0)
            v = v_cache[idx].reshape(-1, *v_cache.shape[2:])[:n].unsqueeze(0)
            outs.append(_attention(torch, q[b : b + 1], k, v, causal))
        return torch.cat(outs), None

    return types.SimpleNamespace(
        flash_attn_func=lambda q, k, v, causal=False: (_attention(torch, q, k, v, causal), None),
        flash_attn_varlen_func=varlen,
        flash_attn_with_kvcache=kvcache,
    )


@pytest.fixture
def smoke(monkeypatch: pytest.MonkeyPatch) -> Any:
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(SMOKE))
    spec = importlib.util.spec_from_file_location("smoke_flash_attn_3", SMOKE / "flash_attn_3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delitem(sys.modules, "_harness", raising=False)
    module.DEVICE = "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    return module


def _with(smoke: Any, monkeypatch: pytest.MonkeyPatch, iface: Any) -> None:
    real = importlib.import_module
    monkeypatch.setattr(
        smoke,
        "importlib",
        types.SimpleNamespace(import_module=lambda name: iface if name.startswith("flash_attn_3") else real(name)),
    )


def test_every_family_passes_against_an_exact_stand_in(smoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    _with(smoke, monkeypatch, _stand_in(torch))
    checks = {
        "bf16-d64": smoke.fwd_bwd("bfloat16", 64),
        "fp16-d192": smoke.fwd_bwd("float16", 192),
        "hdimdiff": smoke._guarded(smoke.fwd_hdimdiff),
        "e4m3-d128": smoke.fwd_e4m3(128),
        "varlen": smoke._guarded(smoke.varlen),
        "paged": smoke._guarded(smoke.paged_kv),
    }
    results = {name: check() for name, check in checks.items()}
    assert {status for status, _ in results.values()} == {"PASS"}, results
    assert "out (2, 256, 4, 128)" in results["hdimdiff"][1]
    assert "(300, 77) cached" in results["paged"][1]


def test_a_wrong_kernel_fails(smoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    iface = _stand_in(torch)
    exact = iface.flash_attn_with_kvcache
    iface.flash_attn_with_kvcache = lambda q, kc, vc, **kw: (exact(q, kc, vc, **kw)[0] * 1.1, None)
    iface.flash_attn_func = lambda q, k, v, causal=False: (_attention(torch, q, k, v, not causal), None)
    _with(smoke, monkeypatch, iface)
    assert smoke._guarded(smoke.paged_kv)()[0] == "FAIL"
    assert smoke.fwd_bwd("bfloat16", 128)()[0] == "FAIL"  # causal where it was asked not to be, and back


def test_what_the_build_left_out_is_skipped_in_fa3s_words(smoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def lacking(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("This flash attention build does not support FP16.")

    def too_wide(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 128")

    _with(smoke, monkeypatch, types.SimpleNamespace(flash_attn_func=lacking))
    assert smoke.fwd_bwd("float16", 64)() == (
        "SKIP",
        "not in this build: This flash attention build does not support FP16.",
    )
    _with(smoke, monkeypatch, types.SimpleNamespace(flash_attn_func=too_wide))
    assert smoke.fwd_bwd("bfloat16", 256)()[0] == "SKIP"

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _with(smoke, monkeypatch, types.SimpleNamespace(flash_attn_func=broken))
    with pytest.raises(RuntimeError, match="illegal memory access"):  # the harness's run() makes it a FAIL
        smoke.fwd_bwd("bfloat16", 128)()
