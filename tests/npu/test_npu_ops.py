# SPDX-License-Identifier: Apache-2.0
"""The npu backend's vendor paths at the real dimensions, on CPU tensors through the torch_npu stub.

tests/ops/ already runs every npu op through the shared conformance tests (cpu_backends includes
'npu'); most of those use fp32 / fp64 inputs, which the attention operators do not take, so the
bf16 paths through npu_fused_infer_attention_score and npu_lightning_indexer are checked here,
against the same float64 oracles, and each test asserts that the vendor operator really ran.
This checks our composition (layouts, masks, the sink from the lse), not the Ascend hardware.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends import impl
from tests.npu.insert_case import assert_npu_insert_matches_paged
from tests.oracles import dense_attention_with_sink, rope_oracle
from tests.oracles import indexer_oracle as oracle
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin, rope_inv_freq


def _fill(gen, fmt, rows, pages, pad=0):
    cache = fmt.new_cache(pages, page_bytes=fmt.min_page_bytes + pad)
    cache.fill_(0xFF)
    slots = torch.randperm(pages * fmt.entries_per_page, generator=gen)[: rows.shape[0]]
    paged.insert_rows(cache, slots, rows, fmt)
    return cache, slots, paged.gather_rows(cache, slots, fmt).double()


def _attention_case(gen, t, h, w, k, fmt_name="bf16", p_invalid=0.1, empty=()):
    d = 512
    wf, cf = make_format(fmt_name, "main", 64), make_format(fmt_name, "main", 2)
    mw, mc = w + 8, k + 4
    wrows = torch.randn(mw, d, generator=gen) * 2
    crows = torch.randn(mc, d, generator=gen) * 2
    wc, wslot, wst = _fill(gen, wf, wrows, mw // 64 + 2)
    cc, cslot, cst = _fill(gen, cf, crows, mc // 2 + 2, pad=24)
    wi = torch.randint(0, mw, (t, w), generator=gen)
    ci = torch.randint(0, mc, (t, k), generator=gen)
    wv = torch.rand(t, w, generator=gen) >= p_invalid
    cv = torch.rand(t, k, generator=gen) >= p_invalid
    for tok in empty:
        wv[tok] = False
        cv[tok] = False
    ws = torch.where(wv, wslot[wi], -1)
    cs = torch.where(cv, cslot[ci], -1)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    keys = torch.cat([wst[wi], cst[ci]], dim=1)
    valid = torch.cat([wv, cv], dim=1)
    return (q, wc, ws, cc, cs, wf, sink, d**-0.5, cf), keys, valid


@pytest.mark.parametrize("t,h,w,k", [(8, 64, 128, 512), (3, 128, 128, 64), (4, 16, 20, 0)])
def test_sparse_attention_bf16_through_fia(stub, gen, t, h, w, k):
    args, keys, valid = _attention_case(gen, t, h, w, k)
    q, sink, scale = args[0], args[6], args[7]
    before = stub._control.calls["npu_fused_infer_attention_score"]
    out = impl(api.SPARSE_ATTENTION, "npu")(*args)
    calls = stub._control.calls["npu_fused_infer_attention_score"] - before
    assert calls == math.ceil(h / 64)  # one launch per group of <= 64 heads
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ref = dense_attention_with_sink(q, keys, valid, sink, scale)
    # bf16 keys and two bf16 roundings of the output
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_sparse_attention_fia_sink_and_empty_tokens(stub, gen):
    args, keys, valid = _attention_case(gen, 5, 8, 12, 6, empty=(0, 3))
    f = impl(api.SPARSE_ATTENTION, "npu")
    for sink in (torch.full((8,), float("-inf")), torch.full((8,), 30.0), torch.randn(8) * 3):
        a = list(args)
        a[6] = sink
        out = f(*a)
        assert torch.equal(out[[0, 3]], torch.zeros(2, 8, 512, dtype=torch.bfloat16))
        ref = dense_attention_with_sink(args[0], keys, valid, sink, args[7])
        torch.testing.assert_close(
            out.double(), ref, rtol=2e-2, atol=2e-2 * max(float(ref.abs().max()), 1e-6)
        )
    assert stub._control.calls["npu_fused_infer_attention_score"] == 3


def test_sparse_attention_fp8_cache_bf16_query(stub, gen):
    args, keys, valid = _attention_case(gen, 4, 16, 128, 32, fmt_name="fp8")
    out = impl(api.SPARSE_ATTENTION, "npu")(*args)
    ref = dense_attention_with_sink(args[0], keys, valid, args[6], args[7])
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert stub._control.calls["npu_fused_infer_attention_score"] == 1


def _key_cache(gen, keys_per_req, fmt, pad):
    e = fmt.entries_per_page
    nb = max(k.shape[0] for k in keys_per_req) // e + 1
    pool = len(keys_per_req) * nb + 2
    bt = torch.randperm(pool, generator=gen)[: len(keys_per_req) * nb].view(-1, nb).to(torch.int32)
    cache = fmt.new_cache(pool, page_bytes=fmt.min_page_bytes + pad)
    paged.insert_rows(
        cache, torch.arange(pool * e), 30 * torch.randn(pool * e, fmt.dim, generator=gen), fmt
    )
    stored = []
    for r, k in enumerate(keys_per_req):
        s = torch.arange(k.shape[0])
        slots = paged.logical_to_slot(bt, torch.full_like(s, r), s, e)
        paged.insert_rows(cache, slots, k, fmt)
        stored.append(paged.gather_rows(cache, slots, fmt).double())
    return cache, bt, stored


@pytest.mark.parametrize("pad", [0, 32])  # 0: a bf16 bucket page (contiguous); 32: padded pages
def test_indexer_topk_bf16_through_lightning_indexer(stub, gen, pad):
    hi, di, topk = 64, 128, 512
    fmt = make_format("bf16", "indexer", 64)
    reqs = [(0, 2400, 3), (1, 1020, 2), (2, 250, 12), (3, 2, 1)]  # (req, first pos, tokens)
    keys = [torch.randn((s + n) // 4 + 1, di, generator=gen) for _, s, n in reqs]
    cache, bt, stored = _key_cache(gen, keys, fmt, pad)
    token_req = [r for r, s, n in reqs for _ in range(n)]
    token_pos = [p for r, s, n in reqs for p in range(s, s + n)]
    t = len(token_req)
    q = torch.randn(t, hi, di, generator=gen).to(torch.bfloat16)
    w = indexer_head_weights(torch.randn(t, hi, generator=gen), hi, di)
    out = impl(api.INDEXER_TOPK, "npu")(
        q, w, cache, fmt, bt, torch.tensor(token_req), torch.tensor(token_pos), topk
    )
    assert stub._control.calls["npu_lightning_indexer"] == 1
    assert out.dtype == torch.int32 and out.shape == (t, topk)
    expected = oracle.expected_topk(q, w, stored, token_req, token_pos, topk, 4)
    for i, (scores, k) in enumerate(expected):
        tol = 1e-4 * (1.0 + float(scores.abs().max())) if scores.numel() else 0.0
        why = oracle.check_selection(out[i], scores, k, tol)
        assert why is None, f"token {i}: {why}"
    ks = [k for _, k in expected]
    assert max(ks) == topk and any(0 < k < topk for k in ks) and min(ks) == 0


def test_indexer_topk_other_formats_use_the_reference(stub, gen):
    fmt = make_format("fp32", "indexer", 64)
    keys = [torch.randn(40, 128, generator=gen)]
    cache, bt, stored = _key_cache(gen, keys, fmt, 0)
    q = torch.randn(2, 16, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 16, generator=gen)
    out = impl(api.INDEXER_TOPK, "npu")(
        q, w, cache, fmt, bt, torch.zeros(2, dtype=torch.long), torch.tensor([100, 159]), 8
    )
    ref = impl(api.INDEXER_TOPK, "reference")(
        q, w, cache, fmt, bt, torch.zeros(2, dtype=torch.long), torch.tensor([100, 159]), 8
    )
    assert stub._control.calls["npu_lightning_indexer"] == 0
    assert [set(r.tolist()) for r in out] == [set(r.tolist()) for r in ref]


def test_indexer_topk_unallocated_visible_page_is_an_error(stub, gen):
    fmt = make_format("bf16", "indexer", 64)
    cache, bt, _ = _key_cache(gen, [torch.randn(100, 128, generator=gen)], fmt, 0)
    bt[0, 1] = -1
    q = torch.randn(1, 8, 128, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unallocated"):
        impl(api.INDEXER_TOPK, "npu")(
            q,
            torch.ones(1, 8),
            cache,
            fmt,
            bt,
            torch.zeros(1, dtype=torch.long),
            torch.tensor([399]),
            16,
        )


def test_rope_uses_interleave_rotary_mul(stub, gen):
    tab = rope_cos_sin(160000.0, 64, 4096)
    x = torch.randn(6, 5, 512, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (6,), generator=gen)
    for inverse in (False, True):
        out = impl(api.ROPE, "npu")(x, pos, tab, inverse)
        ref = rope_oracle(x, pos, rope_inv_freq(160000.0, 64), inverse)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-2)
        assert torch.equal(out[..., :448], x[..., :448])
    assert stub._control.calls["npu_rotary_mul"] == 2


def test_rope_prefers_vllm_ascend_partial_rotary_when_loaded(stub, gen, monkeypatch, caplog):
    """In a vLLM process with vllm-ascend loaded, bf16 RoPE goes through its in-place partial op."""
    import logging

    from vllm_dsv4_hw.platform import npu as npu_platform

    seen = []

    def fake_partial(x, cos, sin, rotary_mode, partial_slice):  # documented semantics, in place
        assert rotary_mode == "interleave" and x.dim() == 4 and cos.shape[-1] == 64
        lo, hi = partial_slice
        part = x[..., lo:hi].float()
        rot = torch.stack((-part[..., 1::2], part[..., ::2]), dim=-1).flatten(-2)
        x[..., lo:hi] = (part * cos + rot * sin).to(x.dtype)
        seen.append(tuple(x.shape))

    monkeypatch.setattr(
        npu_platform, "vllm_ascend_ops", lambda: {"inplace_partial_rotary_mul": fake_partial}
    )
    tab = rope_cos_sin(10000.0, 64, 512)
    x = torch.randn(3, 4, 512, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([0, 17, 511])
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_hw"):
        out = impl(api.ROPE, "npu")(x, pos, tab, True)
    assert seen == [(3, 1, 4, 512)] and stub._control.calls["npu_rotary_mul"] == 0
    ref = rope_oracle(x, pos, rope_inv_freq(10000.0, 64), True)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-2)
    assert any(
        "vllm-ascend ops: inplace_partial_rotary_mul (rope)" in r.getMessage()
        for r in caplog.records
    )


def test_kv_insert_scatters_data_and_scale_parts(stub, gen):
    assert_npu_insert_matches_paged(gen)
    assert stub._control.calls["npu_scatter_nd_update_"] == 2  # data part + scale part


def test_inv_rope_fp8_quant_npu_matches_reference(stub, gen):
    tab = rope_cos_sin(10000.0, 64, 300)
    o = torch.randn(4, 3, 512, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 128, 299])
    qn, sn = impl(api.INV_ROPE_FP8_QUANT, "npu")(o, pos, tab)
    qr, sr = impl(api.INV_ROPE_FP8_QUANT, "reference")(o, pos, tab)
    assert torch.equal(sn, sr)
    assert (qn.view(torch.uint8).int() - qr.view(torch.uint8).int()).abs().max() <= 1
    assert stub._control.calls["npu_rotary_mul"] == 1
