# SPDX-License-Identifier: Apache-2.0
"""The indexer with an e4m3 query (``indexer_topk(..., q_scales=)``, ``rope_fp8_quant``'s output):
the query is exactly codes * scale, so every backend must score it as float64 scores of those
values; the Triton kernel's FP8-dot program (``DOT_FP8``: MXFP4 keys placed as e4m3 codes of
value * 2^-6, one K = 32 dot per scale block times the block's scale) runs here in the
interpreter with fp32 dots (``DOT_FP8_EMU``). Real dims (64 heads x 128), every indexer key
format, lengths crossing 4 / 8 / 128 / 256, poisoned score buffers, top-k compared as sets."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.backends import cpu_backends, impl  # noqa: E402
from tests.ops.test_indexer_triton import DI, H, _scores64, _setup  # noqa: E402
from tests.oracles import indexer_oracle as oracle  # noqa: E402
from vllm_dsv4_hw import ops  # noqa: E402
from vllm_dsv4_hw.kv_cache.formats import make_format  # noqa: E402
from vllm_dsv4_hw.ops.api import INDEXER_TOPK  # noqa: E402
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin  # noqa: E402
from vllm_dsv4_hw.ops.triton.common.quant import format_code  # noqa: E402
from vllm_dsv4_hw.ops.triton.indexer import score as ti  # noqa: E402


def _query(gen, t, positions):
    """e4m3 codes + scales of a RoPE'd q^I with per-(token, head) magnitudes 2^-6 .. 2^6."""
    x = torch.randn(t, H, DI, generator=gen) * torch.exp2(
        torch.empty(t, H, 1).uniform_(-6, 6, generator=gen)
    )
    table = rope_cos_sin(10000.0, 64, int(positions.max()) + 1)
    codes, scales = ops.rope_fp8_quant(x.to(torch.bfloat16), positions, table)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (t, H, 1)
    return codes, scales.view(t, H)


@pytest.mark.parametrize("name", ["mxfp4", "fp8", "bf16", "fp32"])
def test_scores_of_e4m3_query(gen, name):
    fmt = make_format(name, "indexer", 64)
    reqs = [(0, 2200, 1), (1, 1019, 2), (2, 250, 9), (3, 3, 6)]  # 4 / 8 / 128 / 256 crossed
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    token_req = torch.cat([token_req, torch.tensor([-1])])  # a padding token
    token_pos = torch.cat([token_pos, torch.tensor([77])])
    t = token_req.numel()
    codes, qs = _query(gen, t, token_pos)
    w = torch.randn(t, H, generator=gen)
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(codes.double() * qs.double()[..., None], w, keys, token_req, token_pos, n_max)
    expect = ti.DOT_FP8_EMU if name in ("mxfp4", "fp8") else ti.DOT_F32
    assert ti._dot_mode(codes, format_code(fmt)) == expect
    for block_s, iters in ((None, None), (64, 2)):
        got = ti.indexer_scores(
            codes,
            w,
            cache,
            fmt,
            bt,
            token_req,
            token_pos,
            4,
            q_scales=qs,
            out=torch.full((t, n_max), float("nan")),
            block_s=block_s,
            iters=iters,
        )
        assert not torch.isnan(got).any()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        scale = float(want[fin].abs().max())
        torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("tb,name", [(2, "mxfp4"), (4, "fp8")])
def test_tokens_scored_together_with_e4m3_query(gen, tb, name):
    """Prefill groups of TB tokens on the FP8-dot program: shared-request groups, groups across
    requests and padding tokens, a ragged last group."""
    fmt = make_format(name, "indexer", 64)
    reqs = [(0, 7, 1), (1, 0, 9), (2, 1200, 6), (3, 300, 2)]
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    token_req = torch.cat([token_req, torch.tensor([-1, -1])])
    token_pos = torch.cat([token_pos, torch.tensor([0, 9])])
    t = token_req.numel()
    codes, qs = _query(gen, t, token_pos)
    w = torch.randn(t, H, generator=gen)
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(codes.double() * qs.double()[..., None], w, keys, token_req, token_pos, n_max)
    got = ti.indexer_scores(
        codes,
        w,
        cache,
        fmt,
        bt,
        token_req,
        token_pos,
        4,
        q_scales=qs,
        block_s=64,
        iters=2,
        tokens_per_program=tb,
        out=torch.full((t, n_max), float("nan")),
    )
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(
        got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * float(want[fin].abs().max())
    )


def test_mxfp4_scale_bytes_far_from_one(gen):
    """Keys whose four ue8m0 scale bytes are all 2^-100 next to keys at 2^90 (the 2^6 of the
    placed codes folded into the scale, not into the codes): each population's scores match
    float64 to fp32 precision of its own magnitude."""
    from vllm_dsv4_hw.kv_cache import paged

    fmt = make_format("mxfp4", "indexer", 64)
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, [(0, 300, 2)])
    _, scales = fmt.page_views(cache)
    big = torch.arange(scales.shape[1]) % 3 == 0
    scales[:, big] = 127 + 90
    scales[:, ~big] = 127 - 100
    n = keys[0].shape[0]
    s = torch.arange(n)
    slots = paged.logical_to_slot(bt, torch.zeros_like(s), s, fmt.entries_per_page)
    keys = [paged.gather(cache, slots, fmt).double()]
    t = token_req.numel()
    codes, qs = _query(gen, t, token_pos)
    w = torch.rand(t, H, generator=gen) + 0.5
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(codes.double() * qs.double()[..., None], w, keys, token_req, token_pos, n_max)
    got = ti.indexer_scores(codes, w, cache, fmt, bt, token_req, token_pos, 4, q_scales=qs)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    is_big = (torch.arange(n_max) % fmt.entries_per_page % 3 == 0)[None, :].expand_as(want)
    for sel in (is_big, ~is_big):
        fin = torch.isfinite(want) & sel
        top = float(want[fin].abs().max())
        assert 0 < top < float("inf")
        torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * top)


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
@pytest.mark.parametrize("name", ["mxfp4", "bf16"])
def test_topk_of_e4m3_query_every_backend(gen, backend, name):
    fmt = make_format(name, "indexer", 64)
    reqs = [(0, 2200, 1), (1, 1019, 2), (2, 250, 5)]
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    t = token_req.numel()
    codes, qs = _query(gen, t, token_pos)
    w = torch.randn(t, H, generator=gen)
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(codes.double() * qs.double()[..., None], w, keys, token_req, token_pos, n_max)
    topk = 512
    out = impl(INDEXER_TOPK, backend)(codes, w, cache, fmt, bt, token_req, token_pos, topk, 4, qs)
    assert out.dtype == torch.int32 and out.shape == (t, topk)
    for i in range(t):
        sc = want[i][torch.isfinite(want[i])]
        k = min(topk, sc.numel())
        why = oracle.check_selection(out[i], sc, k, 1e-4 * (1.0 + float(sc.abs().max())))
        assert why is None, f"{backend} token {i}: {why}"
    assert int((out[0] >= 0).sum()) == topk


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
def test_codes_and_scales_come_together(gen, backend):
    fmt = make_format("mxfp4", "indexer", 64)
    cache, bt, _, token_req, token_pos = _setup(gen, fmt, [(0, 40, 2)])
    codes, qs = _query(gen, 2, token_pos)
    w = torch.randn(2, H, generator=gen)
    f = impl(INDEXER_TOPK, backend)
    with pytest.raises(ValueError, match="q_scales"):
        f(codes.float(), w, cache, fmt, bt, token_req, token_pos, 8, 4, qs)
    with pytest.raises(ValueError, match="q_scales"):
        f(codes, w, cache, fmt, bt, token_req, token_pos, 8, 4, qs[:, :3])
    # codes without scales: scale 1, the same selection as their values
    got = f(codes, w, cache, fmt, bt, token_req, token_pos, 8, 4)
    want = f(codes.float(), w, cache, fmt, bt, token_req, token_pos, 8, 4)
    assert [set(r.tolist()) for r in got] == [set(r.tolist()) for r in want]
