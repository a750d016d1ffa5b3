# SPDX-License-Identifier: Apache-2.0
"""Triton indexer scoring kernel and top-k against float64 scores at real dims (64 heads x 128,
topk 512) with every indexer key format (bf16, fp8, mxfp4, and the fp32 test format).

The conformance suite (test_indexer.py) covers the selection semantics; here:
* the [T, n_max] score buffer of the kernel (``indexer_scores``) equals float64 scores of the keys
  as the cache returns them, -inf exactly where an entry is invisible (causal mask, pages beyond a
  request's allocation (-1), tokens of no request), and every element of a poisoned buffer is
  written;
* the selection (``indexer_topk``) is a valid top-k set (``oracle.check_selection``);
* the GPU launch configuration (64-entry blocks, several blocks per program) runs here too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.backends import impl  # noqa: E402
from tests.oracles import indexer_oracle as oracle  # noqa: E402
from vllm_dsv4_hw.kv_cache import paged  # noqa: E402
from vllm_dsv4_hw.kv_cache.formats import make_format  # noqa: E402
from vllm_dsv4_hw.kv_cache.formats.fp32 import FP32Format  # noqa: E402
from vllm_dsv4_hw.ops import tuning  # noqa: E402
from vllm_dsv4_hw.ops.api import INDEXER_TOPK  # noqa: E402
from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights  # noqa: E402
from vllm_dsv4_hw.ops.registry import REGISTRY  # noqa: E402

if "triton" not in REGISTRY.implementations(INDEXER_TOPK):
    pytest.skip("triton backend not registered", allow_module_level=True)

from vllm_dsv4_hw.ops.triton.indexer import score as ti  # noqa: E402

H, DI = 64, 128


def _setup(gen, fmt, reqs, extra_entries=3):
    """Paged key cache for requests (id, first position, count); pages shuffled and interleaved,
    every slot pre-filled with large keys, unallocated pages (-1) at the end of each table row."""
    e = fmt.entries_per_page
    n_ent = [(s + n) // 4 + extra_entries for _, s, n in reqs]
    nb = max(n_ent) // e + 2
    pool = len(reqs) * nb + 2
    bt = torch.randperm(pool, generator=gen)[: len(reqs) * nb].view(len(reqs), nb).to(torch.int32)
    cache = fmt.new_cache(pool)
    paged.insert(
        cache, torch.arange(pool * e), 30.0 * torch.randn(pool * e, DI, generator=gen), fmt
    )
    keys = []
    for r, n in enumerate(n_ent):
        bt[r, (n + e - 1) // e :] = -1  # beyond the request's allocation
        s = torch.arange(n)
        slots = paged.logical_to_slot(bt, torch.full_like(s, r), s, e)
        paged.insert(cache, slots, torch.randn(n, DI, generator=gen), fmt)
        keys.append(paged.gather(cache, slots, fmt).double())
    token_req, token_pos = [], []
    for r, start, n in reqs:
        token_req += [r] * n
        token_pos += list(range(start, start + n))
    return cache, bt, keys, torch.tensor(token_req), torch.tensor(token_pos)


def _scores64(q, w, keys, token_req, token_pos, n_max):
    """float64 [T, n_max] scores, -inf where invisible."""
    out = torch.full((q.shape[0], n_max), float("-inf"), dtype=torch.float64)
    for t in range(q.shape[0]):
        r = int(token_req[t])
        if r < 0:
            continue
        n = min((int(token_pos[t]) + 1) // 4, keys[r].shape[0], n_max)
        logits = torch.einsum("hd,sd->hs", q[t].double(), keys[r][:n])
        out[t, :n] = (w[t].double()[:, None] * logits.relu()).sum(0)
    return out


@pytest.mark.parametrize(
    "name,select",
    [
        ("bf16", "radix"),
        ("fp8", "radix"),
        ("mxfp4", "radix"),
        ("fp32", "radix"),
        ("mxfp4", "torch"),
    ],
)
def test_scores_and_topk_real_dims(gen, name, select):
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    fmt = make_format(name, "indexer", 64)
    # decode tokens (one with > topk visible entries), a prefill chunk crossing a page boundary
    reqs = [(0, 2200, 1), (1, 1019, 2), (2, 250, 9)]
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    token_req = torch.cat([token_req, torch.tensor([-1])])  # a padding token of no request
    token_pos = torch.cat([token_pos, torch.tensor([400])])
    t = token_req.numel()
    q = torch.randn(t, H, DI, generator=gen).to(torch.bfloat16)
    w = indexer_head_weights(torch.randn(t, H, generator=gen), H, DI)
    n_max = bt.shape[1] * fmt.entries_per_page
    poisoned = torch.full((t, n_max), float("nan"))
    got = ti.indexer_scores(q, w, cache, fmt, bt, token_req, token_pos, 4, out=poisoned)
    want = _scores64(q, w, keys, token_req, token_pos, n_max)
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    scale = float(want[fin].abs().max())
    torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * scale)

    topk = 512
    # both selection paths behind the op
    with tuning.override(indexer=tuning.IndexerTuning(select=select)):
        out = impl(INDEXER_TOPK, "triton")(q, w, cache, fmt, bt, token_req, token_pos, topk)
    assert out.dtype == torch.int32 and out.shape == (t, topk)
    assert (out[-1] == -1).all()
    for i in range(t - 1):
        sc = want[i][torch.isfinite(want[i])]
        k = min(topk, sc.numel())
        why = oracle.check_selection(out[i], sc, k, 1e-4 * (1.0 + float(sc.abs().max())))
        assert why is None, f"token {i}: {why}"
    assert min(int((out[i] >= 0).sum()) for i in range(t - 1)) < topk  # both regimes hit
    assert int((out[0] >= 0).sum()) == topk


def test_gpu_launch_config(gen, monkeypatch):
    """64-entry blocks and 2-4 blocks per program (as on a GPU): same scores."""
    fmt = make_format("mxfp4", "indexer", 64)
    reqs = [(0, 1500, 1), (1, 600, 3)]
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    t = token_req.numel()
    q = torch.randn(t, H, DI, generator=gen)
    w = torch.randn(t, H, generator=gen)
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(q, w, keys, token_req, token_pos, n_max)
    for iters in (2, 4):
        monkeypatch.setattr(ti, "_launch_config", lambda *a, _i=iters: _i)
        got = ti.indexer_scores(
            q,
            w,
            cache,
            fmt,
            bt,
            token_req,
            token_pos,
            4,
            block_s=64,
            out=torch.full((t, n_max), float("nan")),
        )
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        scale = float(want[fin].abs().max())  # fp32 accumulation over 64 heads of mixed sign
        torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize(
    "tb,fmt_name,req_dtype",
    [
        (2, "mxfp4", torch.int64),
        (4, "mxfp4", torch.int32),
        (2, "fp8", torch.int32),
        (4, "fp8", torch.int64),
    ],
)
def test_tokens_scored_together(gen, tb, fmt_name, req_dtype):
    """TB tokens per program (one key tile for all of them): groups inside one request (the
    shared path), groups across requests and with padding tokens (scored one token at a time), a
    partial last group; 64-entry blocks as on a GPU; a poisoned buffer. Requests and the block
    table as int64 (the metadata's) and int32: the kernel reads either, with no cast launch."""
    fmt = make_format(fmt_name, "indexer", 64)
    reqs = [(0, 7, 1), (1, 0, 9), (2, 1200, 6), (3, 300, 2)]  # 1 + 9 + 6 + 2 tokens: ragged groups
    cache, bt, keys, token_req, token_pos = _setup(gen, fmt, reqs)
    token_req = torch.cat([token_req, torch.tensor([-1, -1, -1])]).to(req_dtype)  # padding
    token_pos = torch.cat([token_pos, torch.tensor([0, 5, 9])])
    bt = bt.to(req_dtype)
    t = token_req.numel()
    q = torch.randn(t, H, DI, generator=gen)
    w = torch.randn(t, H, generator=gen)
    n_max = bt.shape[1] * fmt.entries_per_page
    want = _scores64(q, w, keys, token_req, token_pos, n_max)
    got = ti.indexer_scores(
        q,
        w,
        cache,
        fmt,
        bt,
        token_req,
        token_pos,
        4,
        block_s=64,
        iters=2,
        tokens_per_program=tb,
        out=torch.full((t, n_max), float("nan")),
    )
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    scale = float(want[fin].abs().max())
    torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-5, atol=1e-6 * scale)
    with pytest.raises(ValueError, match="power of two"):
        ti.indexer_scores(q, w, cache, fmt, bt, token_req, token_pos, 4, tokens_per_program=3)


def test_select_policy():
    """``IndexerTuning.select``: auto takes the radix select up to ``radix_max_scores`` scores
    per call; torch never; anything else is refused."""
    auto = tuning.IndexerTuning(select="auto")
    assert auto.radix(4, 262144) and not auto.radix(32, 262144)
    assert tuning.IndexerTuning(select="radix").radix(32, 262144)
    assert not tuning.IndexerTuning(select="torch").radix(1, 64)
    with pytest.raises(ValueError, match="use one of"):
        tuning.IndexerTuning(select="bogus")


def _wide_table(gen, width: int):
    """Small dims (16 heads x 16, fp32 keys, 4 entries per page), tokens of visible counts across
    4 / 8 / 128 / 256 (decode and prefill, below and above topk, 0, padding tokens of request -1),
    and a block table ``width`` pages wide, as under a long --max-model-len: past each request's
    pages, allocated pages (large keys: they would win if read) and -1 pages, mixed."""
    from tests.ops.test_indexer import build_key_cache, token_layout

    hi, di = 16, 16
    fmt = FP32Format(dim=di, entries_per_page=4)
    reqs = [
        (0, 0, 9),
        (1, 500, 10),
        (2, 1020, 8),
        (3, 1030, 1),
        (4, 2, 3),
        (5, 511, 1),
        (6, 1027, 2),
        (7, 15, 1),
    ]
    keys = [torch.randn((s + n) // 4 + 1, di, generator=gen) for _, s, n in reqs]
    cache, bt, stored = build_key_cache(gen, keys, fmt, spare_pages=8)
    extra = torch.randint(
        0, cache.shape[0], (bt.shape[0], width - bt.shape[1]), generator=gen, dtype=torch.int32
    )
    extra[torch.rand(extra.shape, generator=gen) < 0.5] = -1
    bt = torch.cat([bt, extra], dim=1)
    token_req, token_pos = token_layout(reqs)
    token_req += [-1, -1]
    token_pos += [1100, 3]
    t = len(token_req)
    q = torch.randn(t, hi, di, generator=gen)
    w = torch.randn(t, hi, generator=gen)
    return q, w, cache, fmt, bt, stored, token_req, token_pos


@pytest.mark.parametrize("interp_block", [None, 256])
def test_topk_bounded_to_visible_entries_on_a_wide_table(gen, monkeypatch, interp_block):
    """indexer_topk with the radix selection bounded to each token's visible entries (and the
    scores past them not stored): the output of before (full -inf stores, then the unbounded
    radix_topk) bit for bit, the float64 oracle's top-k set, the torch.topk selection's set; one
    program per score row, and 8 (the multi-launch form)."""
    from tests.ops.test_indexer import check_all
    from vllm_dsv4_hw.ops.triton.indexer import topk as tk

    if interp_block:
        monkeypatch.setattr(tk, "INTERP_BLOCK", interp_block)
    q, w, cache, fmt, bt, stored, token_req, token_pos = _wide_table(gen, 512)
    req, pos = torch.tensor(token_req), torch.tensor(token_pos)
    t, topk = len(token_req), 64
    with tuning.override(indexer=tuning.IndexerTuning(select="radix", bounded=True)):
        got = impl(INDEXER_TOPK, "triton")(q, w, cache, fmt, bt, req, pos, topk)
    before = torch.full((t, topk), -1, dtype=torch.int32)
    tk.radix_topk(ti.indexer_scores(q, w, cache, fmt, bt, req, pos, 4), topk, before)
    assert torch.equal(got, before)
    assert (got[-2:] == -1).all()  # no request
    real = [i for i in range(t) if token_req[i] >= 0]
    expected = check_all(
        got[real],
        q[real],
        w[real],
        stored,
        [token_req[i] for i in real],
        [token_pos[i] for i in real],
        topk,
    )
    ks = [k for _, k in expected]
    assert min(ks) == 0 and max(ks) == topk and any(0 < k < topk for k in ks)
    with tuning.override(indexer=tuning.IndexerTuning(select="torch")):
        full = impl(INDEXER_TOPK, "triton")(q, w, cache, fmt, bt, req, pos, topk)
    for i in range(t):
        assert set(full[i].tolist()) == set(got[i].tolist()), i


@pytest.mark.parametrize("tb", [1, 4])
def test_skipped_tail_stores_leave_visible_scores_as_full_stores(gen, tb):
    """indexer_scores(skip_tail=True) on a NaN-poisoned buffer: the columns below each token's
    visible count hold exactly the full stores' values; blocks past every token of a program
    keep the poison (nothing stored), which the bounded radix_topk never reads."""
    q, w, cache, fmt, bt, _, token_req, token_pos = _wide_table(gen, 256)
    req, pos = torch.tensor(token_req), torch.tensor(token_pos)
    t, n_max = len(token_req), bt.shape[1] * fmt.entries_per_page
    kw = dict(block_s=64, iters=2, tokens_per_program=tb)
    full = ti.indexer_scores(
        q, w, cache, fmt, bt, req, pos, 4, out=torch.full((t, n_max), float("nan")), **kw
    )
    skipped = ti.indexer_scores(
        q,
        w,
        cache,
        fmt,
        bt,
        req,
        pos,
        4,
        out=torch.full((t, n_max), float("nan")),
        skip_tail=True,
        **kw,
    )
    assert not torch.isnan(full).any()
    for i in range(t):
        vis = 0 if token_req[i] < 0 else min(n_max, (token_pos[i] + 1) // 4)
        assert torch.equal(skipped[i, :vis], full[i, :vis]), i
        if tb == 1:  # one token per program: every block past its visible entries skipped
            past = -(-vis // 64) * 64
            assert torch.isnan(skipped[i, past:]).all(), i
            assert torch.equal(skipped[i, vis:past], full[i, vis:past]), i


def test_register_cap_rule(monkeypatch):
    """The score pass's register cap (``REG_CAP``): the decode tile (one token per program, MXFP4
    keys on bf16 dots) on CUDA, from 32 programs per SM; nothing elsewhere."""
    from vllm_dsv4_hw.ops.triton.indexer import launch as indexer_launch

    monkeypatch.setattr(indexer_launch, "sm_count", lambda dev: 132)
    cuda = torch.device("cuda", 0)
    cap = {"maxnreg": ti.REG_CAP["maxnreg"]}
    mx = ti.quant.FMT_MXFP4
    assert ti._reg_cap(8192, 1, mx, ti.DOT_BF16, cuda) == cap  # 1M B=32
    assert ti._reg_cap(1024, 1, mx, ti.DOT_BF16, cuda) == {}  # 1M B=4
    assert ti._reg_cap(65536, 4, mx, ti.DOT_BF16, cuda) == {}  # prefill tile
    assert ti._reg_cap(8192, 1, ti.quant.FMT_FP8_INDEXER, ti.DOT_BF16, cuda) == {}
    assert ti._reg_cap(8192, 1, mx, ti.DOT_FP8, cuda) == {}
    assert ti._reg_cap(8192, 1, mx, ti.DOT_BF16, torch.device("cpu")) == {}
