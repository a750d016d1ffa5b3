# SPDX-License-Identifier: Apache-2.0
"""compressor_pool / compressor_store against the float64 oracle (spec section 3), and chunked
prefill / token-by-token decode against one-shot prefill, through the paged sliding-window state.

The state cache is scrubbed to NaN outside every request's live window (the last coff*ratio - 1
positions) before each step, and its first and last pages are never allocated (NaN), so a pool
that reads a row it does not own, or reads an absent (-1) row instead of masking it, fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import compressor_oracle as oracle
from vllm_dsv4_hw.attention.compressor_plan import compressor_plan
from vllm_dsv4_hw.config import YarnParams
from vllm_dsv4_hw.kv_cache.formats.bf16 import BF16Format
from vllm_dsv4_hw.kv_cache.formats.fp32 import FP32Format
from vllm_dsv4_hw.ops.api import COMPRESSOR_POOL, COMPRESSOR_STORE
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

LENGTHS = [3, 4, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257, 300]
# Backends other than the reference run interpreted on CPU (Triton's interpreter executes one
# program at a time): they get a shorter set that still crosses 4, 8, 128 and 256.
SHORT_LENGTHS = [3, 4, 5, 8, 9, 129, 257]
EPS = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")


def lengths_for(backend, full=LENGTHS, short=SHORT_LENGTHS):
    return full if backend == "reference" else short


def coff_of(ratio):
    return 2 if ratio == 4 else 1


def make_inputs(gen, lengths, ratio, d):
    coff = coff_of(ratio)
    kv = [torch.randn(n, coff * d, generator=gen) for n in lengths]
    # spread the gates so the softmax is far from uniform
    score = [2.0 * torch.randn(n, coff * d, generator=gen) for n in lengths]
    ape = torch.randn(ratio, coff * d, generator=gen)
    return kv, score, ape


def random_cos_sin(gen, positions, rope_dim):
    ang = 6.283 * torch.rand(positions, rope_dim // 2, generator=gen, dtype=torch.float64)
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32)


def chunk_schedule(lengths, pattern, gen=None, idle_prob=0.0):
    """Steps of {req: n_new}: every unfinished request advances by its next chunk size
    (``pattern`` cycled, per request offset), some idling a step when ``idle_prob`` > 0."""
    done = [0] * len(lengths)
    cycles = [
        itertools.cycle(pattern[r % len(pattern) :] + pattern[: r % len(pattern)])
        for r in range(len(lengths))
    ]
    steps = []
    while any(done[r] < lengths[r] for r in range(len(lengths))):
        step = {}
        for r, n in enumerate(lengths):
            if done[r] >= n:
                continue
            if idle_prob and gen is not None and float(torch.rand(1, generator=gen)) < idle_prob:
                continue
            c = min(next(cycles[r]), n - done[r])
            step[r] = c
            done[r] += c
        if step:
            steps.append(step)
    return steps


class CompressorSim:
    """Several requests sharing one paged state cache (and one paged entry cache for store)."""

    def __init__(self, gen, lengths, ratio, d, rows_per_page, fmt=None):
        self.gen, self.lengths, self.ratio, self.d = gen, list(lengths), ratio, d
        self.coff = coff_of(ratio)
        self.rpp = rows_per_page
        nreq = len(lengths)
        nb = max(lengths) // rows_per_page + 1
        pool = nreq * nb + 2  # first and last page never allocated
        self.sbt = (1 + torch.randperm(pool - 2, generator=gen)).view(nreq, nb)
        self.state = torch.full((pool * rows_per_page, 2 * self.coff * d), float("nan"))
        self.next = [0] * nreq
        self.fmt = fmt
        if fmt is not None:
            e = fmt.entries_per_page
            nbk = max(lengths) // ratio // e + 1
            kpool = nreq * nbk + 3
            self.kbt = torch.randperm(kpool, generator=gen)[: nreq * nbk].view(nreq, nbk)
            self.cache = fmt.new_cache(kpool)
        self.pooled = {}

    def _slots(self, r, positions):
        p = torch.as_tensor(positions, dtype=torch.int64)
        return self.sbt[r, p // self.rpp] * self.rpp + p % self.rpp

    def scrub(self):
        """NaN every state row of every request outside its live window."""
        w = self.coff * self.ratio
        if not hasattr(self, "_all_slots"):
            self._all_slots = [self._slots(r, torch.arange(n)) for r, n in enumerate(self.lengths)]
        dead = []
        for r, slots in enumerate(self._all_slots):
            keep_lo = max(0, self.next[r] - w + 1)
            dead += [slots[:keep_lo], slots[self.next[r] :]]
        self.state.index_fill_(0, torch.cat(dead), float("nan"))

    def step(self, advance, kv, score, ape, op, backend, **store_args):
        self.scrub()
        order = list(advance)
        perm = torch.randperm(len(order), generator=self.gen).tolist()
        order = [order[i] for i in perm]  # batch order != request order
        qsl, pos, kvb, scb = [0], [], [], []
        for r in order:
            s, n = self.next[r], advance[r]
            kvb.append(kv[r][s : s + n])
            scb.append(score[r][s : s + n])
            pos.extend(range(s, s + n))
            qsl.append(qsl[-1] + n)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_start = torch.tensor([self.next[r] for r in order])
        kbt = self.kbt[order] if self.fmt is not None else None
        e = self.fmt.entries_per_page if self.fmt is not None else 64
        plan = compressor_plan(qsl_t, seq_start, self.sbt[order], self.rpp, self.ratio, kbt, e)
        positions = torch.tensor(pos, dtype=torch.int64)
        args = (
            torch.cat(kvb),
            torch.cat(scb),
            positions,
            ape,
            self.state,
            plan.state_slots,
            plan.group_rows,
            self.ratio,
        )
        if op == COMPRESSOR_POOL:
            out = impl(COMPRESSOR_POOL, backend)(*args)
            assert out.shape == (plan.num_groups, self.d) and out.dtype == torch.float32
            for g in range(plan.num_groups):
                key = (order[int(plan.group_req[g])], int(plan.group_entry_index[g]))
                assert key not in self.pooled, f"entry {key} produced twice"
                self.pooled[key] = out[g]
        else:
            impl(COMPRESSOR_STORE, backend)(
                *args,
                store_args["norm_weight"],
                EPS,
                store_args["cos_sin"],
                plan.group_entry_index,
                self.cache,
                plan.cache_slots,
                self.fmt,
            )
        for r in order:
            self.next[r] += advance[r]
        return plan, positions

    def pooled_of(self, r):
        n = self.lengths[r] // self.ratio
        assert all((r, i) in self.pooled for i in range(n)), f"request {r} lacks entries"
        assert not any(k[0] == r and k[1] >= n for k in self.pooled)
        if n == 0:
            return torch.zeros(0, self.d)
        return torch.stack([self.pooled[(r, i)] for i in range(n)])

    def stored_of(self, r):
        n = self.lengths[r] // self.ratio
        e = self.fmt.entries_per_page
        i = torch.arange(n)
        pages, off = self.kbt[r, i // e], i % e
        data, scales = self.fmt.page_views(self.cache)
        return self.fmt.dequantize(data[pages, off], scales[pages, off])


def run_pool(gen, lengths, ratio, d, rpp, pattern, backend, kv, score, ape, idle_prob=0.0):
    sim = CompressorSim(gen, lengths, ratio, d, rpp)
    for adv in chunk_schedule(lengths, pattern, gen, idle_prob):
        sim.step(adv, kv, score, ape, COMPRESSOR_POOL, backend)
    return [sim.pooled_of(r) for r in range(len(lengths))]


def run_store(
    gen, lengths, ratio, d, rpp, pattern, backend, kv, score, ape, fmt, norm_weight, cos_sin
):
    sim = CompressorSim(gen, lengths, ratio, d, rpp, fmt)
    for adv in chunk_schedule(lengths, pattern, gen):
        sim.step(
            adv, kv, score, ape, COMPRESSOR_STORE, backend, norm_weight=norm_weight, cos_sin=cos_sin
        )
    return [sim.stored_of(r) for r in range(len(lengths))]


ONE_SHOT = [10**9]


# -- compressor_pool ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_POOL))
@pytest.mark.parametrize("ratio,rpp", [(4, 4), (4, 3), (128, 8), (128, 64)])
def test_pool_one_shot_matches_oracle(gen, backend, ratio, rpp):
    d = 16
    lengths = lengths_for(backend)
    kv, score, ape = make_inputs(gen, lengths, ratio, d)
    got = run_pool(gen, lengths, ratio, d, rpp, ONE_SHOT, backend, kv, score, ape)
    for r, n in enumerate(lengths):
        want = oracle.pooled_entries(kv[r], score[r], ape, ratio)
        assert got[r].shape == want.shape == (n // ratio, d)
        torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_POOL))
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize(
    "pattern",
    [[1], [3], [64], [100], [100, 1, 3], [5, 64, 1, 1, 2]],
    ids=["decode", "c3", "c64", "c100", "mixed", "mixed2"],
)
def test_pool_chunked_equals_one_shot(gen, backend, ratio, pattern):
    d = 16
    rpp = 4 if ratio == 4 else 8
    lengths = lengths_for(backend)
    kv, score, ape = make_inputs(gen, lengths, ratio, d)
    # one-shot of the reference (a backend's own one-shot is checked against the oracle above)
    one = run_pool(gen, lengths, ratio, d, rpp, ONE_SHOT, "reference", kv, score, ape)
    chunked = run_pool(
        gen,
        lengths,
        ratio,
        d,
        rpp,
        pattern,
        backend,
        kv,
        score,
        ape,
        idle_prob=0.2 if len(pattern) > 1 else 0.0,
    )
    # same implementation: equal up to fp32 noise; another backend vs the reference: fp32 rounding
    tol = dict(rtol=1e-6, atol=1e-7) if backend == "reference" else dict(rtol=1e-5, atol=1e-6)
    for r in range(len(lengths)):
        torch.testing.assert_close(chunked[r], one[r], **tol)
        torch.testing.assert_close(
            chunked[r].double(),
            oracle.pooled_entries(kv[r], score[r], ape, ratio),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_POOL))
@pytest.mark.parametrize(
    "ratio,d", [(4, 512), (128, 512), (4, 128)], ids=["c4a", "c128a", "indexer"]
)
def test_pool_real_dims(gen, backend, ratio, d):
    lengths = lengths_for(backend, [5, 129, 257], [5, 257] if ratio == 128 else [5, 129])
    rpp = 4 if ratio == 4 else 8
    kv, score, ape = make_inputs(gen, lengths, ratio, d)
    one = run_pool(gen, lengths, ratio, d, rpp, ONE_SHOT, backend, kv, score, ape)
    dec = run_pool(gen, lengths, ratio, d, rpp, [100, 1, 64], backend, kv, score, ape)
    for r in range(len(lengths)):
        want = oracle.pooled_entries(kv[r], score[r], ape, ratio)
        torch.testing.assert_close(one[r].double(), want, rtol=1e-5, atol=1e-5)
        # equal up to fp32 summation noise (128 terms of O(1) can cancel to a small entry)
        torch.testing.assert_close(dec[r], one[r], rtol=5e-6, atol=5e-6)


@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_POOL))
@pytest.mark.parametrize("ratio", [4, 128])
def test_pool_writes_state_rows(gen, backend, ratio):
    """Every new token's row is [kv | score + ape[pos % ratio]], and nothing else is written."""
    d = 8
    coff = coff_of(ratio)
    n = 2 * ratio + 3
    kv, score, ape = make_inputs(gen, [n], ratio, d)
    state = torch.full((4 * n, 2 * coff * d), float("nan"))
    slots = torch.randperm(4 * n, generator=gen)[:n]
    start = 1000 + int(torch.randint(0, ratio, (1,), generator=gen))
    positions = torch.arange(start, start + n)
    out = impl(COMPRESSOR_POOL, backend)(
        kv[0],
        score[0],
        positions,
        ape,
        state,
        slots,
        torch.zeros(0, coff * ratio, dtype=torch.long),
        ratio,
    )
    assert out.shape == (0, d)
    want = torch.cat([kv[0], score[0] + ape[positions % ratio]], dim=-1)
    torch.testing.assert_close(state[slots], want, rtol=0, atol=0)
    others = torch.ones(4 * n, dtype=torch.bool)
    others[slots] = False
    assert torch.isnan(state[others]).all()


@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_POOL))
def test_pool_c4a_channel_halves(backend):
    """Hand-built c4a groups: previous-group rows use channels [0,d), own rows [d,2d); ape goes to
    the gate only; rows before position 0 are absent."""
    d, ratio = 2, 4
    state = torch.full((16, 4 * d), float("nan"))
    kv = torch.zeros(8, 2 * d)
    for p in range(8):
        kv[p, :d] = 10 + p  # first half tags: 10..17
        kv[p, d:] = 100 + p  # second half tags: 100..107
    score = torch.full((8, 2 * d), -50.0)
    score[2, :d] = 0.0  # wins among previous rows only in channels [0,d)
    score[6, d:] = 0.0  # wins among own rows only in channels [d,2d)
    ape = torch.zeros(ratio, 2 * d)
    ape[1, d:] = 50.0  # pos % 4 == 1 rows gain 50 in the second half of the gate
    rows = torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]])
    out = impl(COMPRESSOR_POOL, backend)(
        kv, score, torch.arange(8), ape, state, torch.arange(8), rows, ratio
    )
    # entry 0: own rows 0..3, second half; gates -50, 0, -50, -50
    g0 = torch.tensor([-50.0, 0.0, -50.0, -50.0])
    e0 = (torch.softmax(g0, 0) * torch.tensor([100.0, 101, 102, 103])).sum()
    # entry 1: rows 0..3 first half (gates -50, -50, 0, -50), rows 4..7 second half (-50, 0, 0, -50)
    g1 = torch.tensor([-50.0, -50, 0, -50, -50, 0, 0, -50])
    e1 = (torch.softmax(g1, 0) * torch.tensor([10.0, 11, 12, 13, 104, 105, 106, 107])).sum()
    torch.testing.assert_close(out, torch.stack([e0.expand(d), e1.expand(d)]), rtol=1e-6, atol=1e-4)
    assert abs(float(e1) - (12 + 105 + 106) / 3) < 1e-3 and abs(float(e0) - 101.0) < 1e-3


# -- compressor_store -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_STORE))
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize(
    "pattern", [ONE_SHOT, [1], [3, 64, 100]], ids=["oneshot", "decode", "mixed"]
)
def test_store_fp32_matches_oracle(gen, backend, ratio, pattern):
    d, rope_dim = 16, 8
    rpp = 4 if ratio == 4 else 8
    lengths = lengths_for(backend)
    kv, score, ape = make_inputs(gen, lengths, ratio, d)
    norm_w = 1.0 + 0.3 * torch.randn(d, generator=gen)
    cos_sin = random_cos_sin(gen, max(lengths) + 1, rope_dim)
    fmt = FP32Format(dim=d, entries_per_page=4)
    got = run_store(
        gen, lengths, ratio, d, rpp, pattern, backend, kv, score, ape, fmt, norm_w, cos_sin
    )
    for r, n in enumerate(lengths):
        want = oracle.stored_entries(kv[r], score[r], ape, ratio, norm_w, EPS, cos_sin)
        assert got[r].shape == want.shape == (n // ratio, d)
        torch.testing.assert_close(got[r].double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", cpu_backends(COMPRESSOR_STORE))
@pytest.mark.parametrize(
    "ratio,d,epp", [(4, 512, 64), (128, 512, 2), (4, 128, 64)], ids=["c4a", "c128a", "indexer"]
)
def test_store_real_dims_yarn(gen, backend, ratio, d, epp):
    """Real dims with the compressed-layer YaRN table (theta 160000): fp32 entries exact to the
    oracle; chunked/decode equal to one-shot; bf16 entries within bf16 rounding."""
    lengths = [9, 256, 300] if ratio == 4 else [127, 128, 300]
    lengths = lengths_for(backend, lengths, [9, 129] if ratio == 4 else [127, 257])
    rpp = 4 if ratio == 4 else 8
    kv, score, ape = make_inputs(gen, lengths, ratio, d)
    norm_w = 1.0 + 0.3 * torch.randn(d, generator=gen)
    cos_sin = rope_cos_sin(160000.0, 64, 512, YarnParams())
    fmt = FP32Format(dim=d, entries_per_page=epp)
    one = run_store(
        gen, lengths, ratio, d, rpp, ONE_SHOT, backend, kv, score, ape, fmt, norm_w, cos_sin
    )
    dec = run_store(
        gen, lengths, ratio, d, rpp, [64, 1, 3], backend, kv, score, ape, fmt, norm_w, cos_sin
    )
    bfmt = BF16Format(dim=d, entries_per_page=epp)
    bf = run_store(
        gen, lengths, ratio, d, rpp, [100], backend, kv, score, ape, bfmt, norm_w, cos_sin
    )
    for r in range(len(lengths)):
        want = oracle.stored_entries(kv[r], score[r], ape, ratio, norm_w, EPS, cos_sin)
        torch.testing.assert_close(one[r].double(), want, rtol=2e-5, atol=2e-5)
        # fp32 rounding noise only: kernels may reduce a group's rows in another order when
        # the step's batch differs (entries are O(1), 5e-6 is a few dozen fp32 ulps)
        torch.testing.assert_close(dec[r], one[r], rtol=5e-6, atol=5e-6)
        torch.testing.assert_close(bf[r].double(), want, rtol=2**-8, atol=1e-6)
