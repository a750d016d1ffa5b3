# SPDX-License-Identifier: Apache-2.0
"""indexer_topk against the float64 oracle (spec section 4), selections compared as sets.

Keys live in paged caches with shuffled, interleaved (non-contiguous) pages per request. The oracle
scores use the keys as the cache returns them (exact for fp32 entries, bf16-rounded for bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import compressor_oracle
from tests.oracles import indexer_oracle as oracle
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats.bf16 import BF16Format
from vllm_dsv4_hw.kv_cache.formats.fp32 import FP32Format
from vllm_dsv4_hw.ops.api import COMPRESSOR_STORE, INDEXER_TOPK
from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def build_key_cache(gen, keys_per_req, fmt, spare_pages=3):
    """Insert each request's keys into one paged cache; returns (cache, block_table, keys as read
    back from the cache, i.e. what the indexer must see)."""
    e = fmt.entries_per_page
    nreq = len(keys_per_req)
    nb = max(k.shape[0] for k in keys_per_req) // e + 1
    pool = nreq * nb + spare_pages
    bt = torch.randperm(pool, generator=gen)[: nreq * nb].view(nreq, nb).to(torch.int32)
    cache = fmt.new_cache(pool)
    # every slot first holds a large key: an entry the indexer must not see would win if read
    everything = torch.arange(pool * e)
    paged.insert(cache, everything, 30.0 * torch.randn(pool * e, fmt.dim, generator=gen), fmt)
    stored = []
    for r, k in enumerate(keys_per_req):
        s = torch.arange(k.shape[0])
        slots = paged.logical_to_slot(bt, torch.full_like(s, r), s, e)
        paged.insert(cache, slots, k, fmt)
        stored.append(paged.gather(cache, slots, fmt).double())
    return cache, bt, stored


def token_layout(requests):
    """requests: list of (request id, first position, count) -> token_req, token_pos lists."""
    token_req, token_pos = [], []
    for r, start, n in requests:
        token_req += [r] * n
        token_pos += list(range(start, start + n))
    return token_req, token_pos


def check_all(out, q, weights, keys, token_req, token_pos, topk, ratio=4, rel_tol=1e-4):
    assert out.dtype == torch.int32 and tuple(out.shape) == (q.shape[0], topk)
    expected = oracle.expected_topk(q, weights, keys, token_req, token_pos, topk, ratio)
    failures = []
    for t, (scores, k) in enumerate(expected):
        tol = rel_tol * (1.0 + float(scores.abs().max())) if scores.numel() else 0.0
        why = oracle.check_selection(out[t], scores, k, tol)
        if why is not None:
            failures.append(f"token {t} (req {token_req[t]}, pos {token_pos[t]}): {why}")
    assert not failures, "\n".join(failures[:5])
    return expected


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
@pytest.mark.parametrize("topk", [8, 64])
def test_topk_matches_oracle(gen, backend, topk):
    """Several requests, prefill chunks and decode tokens, lengths across 4/8/128/256: visible
    counts both below and above topk; pages of 4 entries, shuffled between requests."""
    hi, di = 16, 16  # 16 heads: the smallest count a tl.dot-based backend accepts
    fmt = FP32Format(dim=di, entries_per_page=4)
    # (request, first position, token count); keys exist for every entry the tokens may see
    reqs = [(0, 0, 9), (1, 120, 10), (2, 250, 8), (3, 299, 1), (4, 2, 3), (5, 127, 1), (6, 255, 2)]
    n_entries = [(s + n) // 4 + int(torch.randint(0, 3, (1,), generator=gen)) for _, s, n in reqs]
    keys = [torch.randn(max(n, 1), di, generator=gen) for n in n_entries]
    cache, bt, stored = build_key_cache(gen, keys, fmt)
    token_req, token_pos = token_layout(reqs)
    perm = torch.randperm(len(token_req), generator=gen).tolist()  # tokens in any order
    token_req = [token_req[i] for i in perm]
    token_pos = [token_pos[i] for i in perm]
    t = len(token_req)
    q = torch.randn(t, hi, di, generator=gen)
    w = torch.randn(t, hi, generator=gen)
    out = impl(INDEXER_TOPK, backend)(
        q, w, cache, fmt, bt, torch.tensor(token_req), torch.tensor(token_pos), topk, 4
    )
    expected = check_all(out, q, w, stored, token_req, token_pos, topk)
    ks = [k for _, k in expected]
    assert min(ks) == 0 and max(ks) == topk and any(0 < k < topk for k in ks)  # all regimes hit


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
def test_topk_real_dims(gen, backend):
    """64 heads x 128 dims, topk 512, bf16 keys, bf16 queries: a decode request with ~540 visible
    entries (> topk), one with < topk, and a prefill chunk crossing a page boundary."""
    hi, di, topk = 64, 128, 512
    fmt = BF16Format(dim=di, entries_per_page=64)
    reqs = [(0, 2160, 3), (1, 1020, 2), (2, 250, 12)]
    keys = [torch.randn((s + n) // 4, di, generator=gen) for _, s, n in reqs]
    cache, bt, stored = build_key_cache(gen, keys, fmt)
    token_req, token_pos = token_layout(reqs)
    t = len(token_req)
    q = torch.randn(t, hi, di, generator=gen).to(torch.bfloat16)
    w = indexer_head_weights(torch.randn(t, hi, generator=gen), hi, di)
    out = impl(INDEXER_TOPK, backend)(
        q, w, cache, fmt, bt, torch.tensor(token_req), torch.tensor(token_pos), topk
    )
    expected = check_all(out, q, w, stored, token_req, token_pos, topk)
    assert expected[0][1] == topk and expected[0][0].numel() > topk
    assert expected[3][1] == expected[3][0].numel() < topk


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
def test_topk_well_separated_exact_set(gen, backend):
    """Scores constructed distinct and well apart: the exact set is fixed (and, for the reference,
    which returns descending score, the exact order; other backends may return any order)."""
    hi, di, n = 16, 16, 40
    fmt = FP32Format(dim=di, entries_per_page=8)
    vals = torch.randperm(n, generator=gen).double() + 1.0  # distinct scores 1..n
    keys = torch.zeros(n, di)
    keys[:, 0] = vals.float()
    keys[:, 1:] = torch.randn(n, di - 1, generator=gen)
    cache, bt, _ = build_key_cache(gen, [keys], fmt)
    q = torch.zeros(3, hi, di)
    q[:, 0, 0] = 1.0  # head 0 sees the constructed value
    q[:, 1, 0] = -1.0  # head 1: relu kills every score (other heads have q = 0)
    w = torch.randn(3, hi, generator=gen)
    w[:, 0], w[:, 1] = 0.5, 7.0
    pos = torch.tensor([4 * n - 1, 4 * 20 + 2, 2])  # all 40 visible / 20 visible / none
    out = impl(INDEXER_TOPK, backend)(
        q, w, cache, fmt, bt, torch.zeros(3, dtype=torch.long), pos, 10
    )
    for row, visible in zip(out, [n, 20, 0]):
        order = sorted(range(visible), key=lambda s: -float(vals[s]))[:10]
        got = row[: len(order)].tolist()
        assert (
            got if backend == "reference" else sorted(got, key=lambda s: -float(vals[s]))
        ) == order
        assert (row[len(order) :] == -1).all()


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
def test_topk_entry_completed_by_the_token_itself(gen, backend):
    """Decode-time visibility: the token at 4s+3 may select entry s (completed by itself), the
    token at 4s+2 may not, even when entry s's key dominates every other score."""
    hi, di, topk = 16, 16, 4
    fmt = FP32Format(dim=di, entries_per_page=4)
    n = 30
    q = torch.randn(2, hi, di, generator=gen)
    w = torch.rand(2, hi, generator=gen) + 0.1
    keys = 0.01 * torch.randn(n + 1, di, generator=gen)
    s_new = n - 1
    keys[s_new] = 50.0 * (w[0, :, None] * q[0]).sum(0)  # huge positive logit with token 0's q
    keys[n] = 50.0 * (w[1, :, None] * q[1]).sum(0)  # a future entry (not yet visible)
    cache, bt, stored = build_key_cache(gen, [keys], fmt)
    token_req = [0, 0]
    token_pos = [4 * s_new + 3, 4 * s_new + 2]
    out = impl(INDEXER_TOPK, backend)(
        q, w, cache, fmt, bt, torch.tensor(token_req), torch.tensor(token_pos), topk
    )
    check_all(out, q, w, stored, token_req, token_pos, topk)
    assert s_new in out[0].tolist()  # visible to the token that completes it
    assert s_new not in out[1].tolist() and n not in out[1].tolist()


def test_indexer_head_weights(gen):
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    got = indexer_head_weights(x.to(torch.bfloat16), 64, 128)
    assert got.dtype == torch.float32
    want = x.to(torch.bfloat16).double() / (128**0.5 * 64**0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError):
        indexer_head_weights(x, 32, 128)


@pytest.mark.parametrize("backend", cpu_backends(INDEXER_TOPK))
def test_store_then_topk_end_to_end(gen, backend):
    """The indexer compressor (ratio 4, d 128) stores keys through compressor_store during decode;
    indexer_topk of each decode token must match the oracle built from the raw projections."""
    from tests.ops.test_compressor import CompressorSim, chunk_schedule, make_inputs, random_cos_sin

    hi, di, topk, ratio = 16, 128, 16, 4
    lengths = [70, 131]
    kv, score, ape = make_inputs(gen, lengths, ratio, di)
    norm_w = 1.0 + 0.2 * torch.randn(di, generator=gen)
    cos_sin = random_cos_sin(gen, 256, 64)
    fmt = FP32Format(dim=di, entries_per_page=8)
    sim = CompressorSim(gen, lengths, ratio, di, 4, fmt)
    keys = [
        compressor_oracle.stored_entries(kv[r], score[r], ape, ratio, norm_w, 1e-6, cos_sin)
        for r in range(len(lengths))
    ]
    checked = 0
    for adv in chunk_schedule(lengths, [64, 1]):
        sim.step(
            adv,
            kv,
            score,
            ape,
            COMPRESSOR_STORE,
            cpu_backends(COMPRESSOR_STORE)[0],
            norm_weight=norm_w,
            cos_sin=cos_sin,
        )
        reqs = list(adv)
        token_req, token_pos = [], []
        for r in reqs:  # the tokens of this step, after their keys were stored
            token_req += [r] * adv[r]
            token_pos += list(range(sim.next[r] - adv[r], sim.next[r]))
        t = len(token_req)
        q = torch.randn(t, hi, di, generator=gen)
        w = torch.randn(t, hi, generator=gen)
        out = impl(INDEXER_TOPK, backend)(
            q, w, sim.cache, fmt, sim.kbt, torch.tensor(token_req), torch.tensor(token_pos), topk
        )
        check_all(out, q, w, keys, token_req, token_pos, topk, rel_tol=1e-4)
        checked += t
    assert checked == sum(lengths)
