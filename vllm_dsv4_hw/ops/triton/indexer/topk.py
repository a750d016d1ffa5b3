# SPDX-License-Identifier: Apache-2.0
"""Row-wise top-k of fp32 scores by radix select (the indexer's selection step).

``radix_topk(scores [T, n], k, out [T, k] int32)`` writes, per row, the indices of the k largest
scores that are > -inf first and -1 after them (every slot of ``out[:, :k]`` is written: no fill
before the call; the row's first block writes the -1 tail, only where tau is -inf). No host
synchronization, fixed launch count (CUDA-graph safe), exact: the k-th largest key is found digit
by digit, so the selected set is a top-k set; deterministic: the entries above the k-th score come
in ascending index order, then those equal to it, lowest indices first (ties go to the lowest
index), so the same scores give the same bits every run (attention sums its candidates in this
order).

Why: ``torch.topk`` over one long row (262,144 scores per decode token at 1M context) runs its
multi-block radix select in several launches on few SMs, slower than the scoring itself. Here every
pass is spread over the whole row (evidence: docs/tuning.md, Radix top-k).

Keys: fp32 bits mapped to uint32 so that unsigned order is float order (negative: all bits
flipped; positive: sign bit set); -inf maps to 0x007FFFFF (``NEG_INF_KEY``), below every finite
score.

Launches (8-bit digits, most significant first), 6 per call plus the state's zeroing:

1. ``_hist_kernel`` x 4 (grid: rows x blocks of ``BLOCK`` scores): histogram of this pass's digit
   over the keys whose higher digits equal the prefix chosen so far, added to a [T, 4, 256]
   int32 table with atomics (zero bins skipped). The row's last program to finish (an acq_rel
   arrival count, reset by it) then selects: the digit d where the count of keys with digit >= d
   first reaches the number still needed; the prefix grows by d and the need shrinks by the count
   above d. After 4 passes the prefix is the k-th largest key tau and ``need`` the number of keys
   equal to tau to take. Integer counts: the same whichever program arrives last;
2. ``_count_kernel`` (rows x blocks): per block, the keys > tau and the keys == tau (finite tau
   only, so -inf entries stay -1); the row's last program turns the counts into each block's
   first slot of each kind (an exclusive sum over the row's blocks, in block order);
3. ``_gather_kernel`` (rows x blocks): keys > tau go to slots [0, k - need) in index order, keys ==
   tau to slots [k - need, k) in index order while fewer than need precede them.

Row bound (``row_pos`` / ``row_req``, constexpr ``BOUND``): the indexer's score rows span the
whole block table (4,096 pages under a 1M model length) but a token sees only its first
(pos + 1) // ratio entries; each program computes that row_len on the device (static shapes for
CUDA graphs) and masks its loads at it. The row's live blocks, cdiv(row_len, BLOCK), come first;
a program past them ends at once, and the arrival counts and barriers wait for the live programs
only (a target every program of the row computes alike), so no program spins on their account and
no live block reads their counts. The absent keys are added to the selects' histograms as the
-inf keys they stand for, so tau, need and the output are those of the unbounded call on a row
with a -inf tail.

The state is one zeroed int32 buffer of ``STATE_WORDS`` words per row: the four passes'
histograms, tau's prefix, the need left and the arrival count, at the offsets ``topk_digits``
names. Last-arrival selection: each program's atomics (relaxed: ``HIST_RELAXED``), a block
barrier, then one acq_rel count that releases them; the last program reads the table from L2
(``.cg``), where the atomics landed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2, sm_count
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.indexer.topk_digits import (
    NEED_WORD,
    NEG_INF_KEY,
    PREFIX_WORD,
    ROW_WORDS,
    _add_digit_hist,
    _block_keys,
    _digit,
    _fill_tail,
    _last_of_row,
    _row_barrier,
    _row_bound,
)
from vllm_dsv4_hw.platform.device import adaptor_for

INTERP_BLOCK = 1 << 16
ONE_LAUNCH = True
# Histogram atomics relaxed (True) or acq_rel: relaxed is enough, since the arrival that follows
# them (a block barrier, then one acq_rel atomic) releases them, as a grid sync does; and it is
# faster (evidence: docs/tuning.md, Radix top-k).
HIST_RELAXED = True


def auto_block(rows: int, n: int, one_launch_programs: int = 0) -> int:
    """Scores per program on a GPU: the smallest of 512 / 1,024 / 2,048 whose programs all fit
    in one launch (``one_launch_programs``: the most a one-launch call may have, 0 where none
    may), else 2,048 (the multi-launch form): one launch beats several, and smaller blocks win
    within it (evidence: docs/tuning.md, Radix top-k)."""
    for blk in (512, 1024, 2048):
        if rows * cdiv(n, blk) <= one_launch_programs:
            return blk
    return 2048


def one_launch_warps(block: int) -> int:
    """Warps of the one-launch form: 4 up to 1,024 scores per program (8 per thread), 8 above
    (evidence: docs/tuning.md, Radix top-k)."""
    return 4 if block <= 1024 else 8


# per row: 4 histograms, prefix, need, arrival count (and one unused word: ``ROW_WORDS``)
STATE_WORDS = ROW_WORDS.value


@triton.jit
def _hist_add(scores_ptr, st, n, stride, n_blk, PASS: tl.constexpr, BLOCK: tl.constexpr,
              HIST_RELAXED: tl.constexpr):
    """Add this block's histogram of the pass's digit (keys matching the prefix) to the row's."""
    _, key, m = _block_keys(scores_ptr, n, stride, n_blk, BLOCK)
    if PASS > 0:
        prefix = tl.load(st + PREFIX_WORD).to(tl.uint32, bitcast=True)
        m = m & ((key >> (32 - 8 * PASS)) == prefix)
    _add_digit_hist(st + PASS * 256, key, m, PASS, HIST_RELAXED)


@triton.jit
def _hist_kernel(scores_ptr, state_ptr, pos_ptr, req_ptr, k, n, stride, n_blk,
                 PASS: tl.constexpr, BLOCK: tl.constexpr, RATIO: tl.constexpr,
                 BOUND: tl.constexpr, HIST_RELAXED: tl.constexpr = True,
                 PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    st = state_ptr + row * ROW_WORDS
    if BOUND:
        lim, live = _row_bound(pos_ptr, req_ptr, row, n, RATIO, BLOCK)
        if pid % n_blk < live:  # blocks past the bound: nothing to do (not counted either)
            _hist_add(scores_ptr, st, lim, stride, n_blk, PASS, BLOCK, HIST_RELAXED)
            if _last_of_row(st, live):
                _select(st, k, n - lim, PASS, BOUND)
    else:
        _hist_add(scores_ptr, st, n, stride, n_blk, PASS, BLOCK, HIST_RELAXED)
        if _last_of_row(st, n_blk):
            _select(st, k, 0, PASS, BOUND)


@triton.jit
def _select(st, k, absent, PASS: tl.constexpr, BOUND: tl.constexpr):
    h = tl.load(st + PASS * 256 + tl.arange(0, 256), cache_modifier=".cg")
    if PASS == 0:
        need = k
        prefix = tl.zeros([], dtype=tl.uint32)
    else:
        need = tl.load(st + NEED_WORD, cache_modifier=".cg")
        prefix = tl.load(st + PREFIX_WORD, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    need, prefix = _digit(h, need, prefix, absent, PASS, BOUND)
    tl.store(st + PREFIX_WORD, prefix.to(tl.int32, bitcast=True))
    tl.store(st + NEED_WORD, need)


@triton.jit
def _block_picks(scores_ptr, st, n, stride, n_blk, BLOCK: tl.constexpr):
    """This program's keys above tau (taken) and equal to tau (taken while need lasts)."""
    offs, key, m = _block_keys(scores_ptr, n, stride, n_blk, BLOCK)
    tau = tl.load(st + PREFIX_WORD).to(tl.uint32, bitcast=True)
    gt = m & (key > tau)
    eq = m & (key == tau) & (key != NEG_INF_KEY)  # -inf entries are never selected
    return offs, gt, eq


@triton.jit
def _block_starts(counts_ptr, row, n_blk, live, NB: tl.constexpr):
    """Exclusive sums over the row's first ``live`` blocks, in block order: each one's first
    slots (the blocks after them are past the bound: no counts, never read)."""
    b = tl.arange(0, NB)
    ok = b < live
    rc = counts_ptr + row * n_blk * 2 + b * 2
    g = tl.load(rc, mask=ok, other=0, cache_modifier=".cg")
    e = tl.load(rc + 1, mask=ok, other=0, cache_modifier=".cg")
    tl.store(rc, tl.cumsum(g, axis=0) - g, mask=ok)
    tl.store(rc + 1, tl.cumsum(e, axis=0) - e, mask=ok)


@triton.jit
def _count_block(scores_ptr, st, cnt, n, stride, n_blk, BLOCK: tl.constexpr):
    _, gt, eq = _block_picks(scores_ptr, st, n, stride, n_blk, BLOCK)
    tl.store(cnt, tl.sum(gt.to(tl.int32), axis=0))
    tl.store(cnt + 1, tl.sum(eq.to(tl.int32), axis=0))


@triton.jit
def _count_kernel(scores_ptr, state_ptr, counts_ptr, pos_ptr, req_ptr, n, stride, n_blk,
                  BLOCK: tl.constexpr, NB: tl.constexpr, RATIO: tl.constexpr,
                  BOUND: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    st = state_ptr + row * ROW_WORDS
    cnt = counts_ptr + pid.to(tl.int64) * 2
    if BOUND:
        lim, live = _row_bound(pos_ptr, req_ptr, row, n, RATIO, BLOCK)
        if pid % n_blk < live:
            _count_block(scores_ptr, st, cnt, lim, stride, n_blk, BLOCK)
            if _last_of_row(st, live):
                _block_starts(counts_ptr, row, n_blk, live, NB)
    else:
        _count_block(scores_ptr, st, cnt, n, stride, n_blk, BLOCK)
        if _last_of_row(st, n_blk):
            _block_starts(counts_ptr, row, n_blk, n_blk, NB)


@triton.jit
def _gather_block(scores_ptr, st, base_ptr, out_ptr, n, stride, stride_out, n_blk, k,
                  BLOCK: tl.constexpr):
    offs, gt, eq = _block_picks(scores_ptr, st, n, stride, n_blk, BLOCK)
    need = tl.load(st + NEED_WORD)
    pid = tl.program_id(0).to(tl.int64)
    g = gt.to(tl.int32)
    e = eq.to(tl.int32)
    # slot = picks of the same kind in earlier blocks (base) + earlier in this block: ascending
    # index order, no atomics, so the same scores give the same output every run
    pos = tl.load(base_ptr + pid * 2) + tl.cumsum(g, axis=0) - g
    pe = tl.load(base_ptr + pid * 2 + 1) + tl.cumsum(e, axis=0) - e
    orow = out_ptr + (pid // n_blk) * stride_out
    tl.store(orow + pos, offs.to(tl.int32), mask=gt & (pos < k))
    tl.store(orow + (k - need) + pe, offs.to(tl.int32), mask=eq & (pe < need))
    tau_is_inf = tl.load(st + PREFIX_WORD) == NEG_INF_KEY
    if (pid % n_blk == 0) & tau_is_inf:  # tau = -inf: the need left stays -1
        _fill_tail(orow, k, k - need)


@triton.jit
def _gather_kernel(scores_ptr, state_ptr, base_ptr, out_ptr, pos_ptr, req_ptr, n, stride,
                   stride_out, n_blk, k, BLOCK: tl.constexpr, RATIO: tl.constexpr,
                   BOUND: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    st = state_ptr + row * ROW_WORDS
    if BOUND:
        lim, live = _row_bound(pos_ptr, req_ptr, row, n, RATIO, BLOCK)
        if pid % n_blk < live:
            _gather_block(scores_ptr, st, base_ptr, out_ptr, lim, stride, stride_out, n_blk, k,
                          BLOCK)
        elif (lim == 0) & (pid % n_blk == 0):  # nothing visible: every slot -1
            _fill_tail(out_ptr + row * stride_out, k, 0)
    else:
        _gather_block(scores_ptr, st, base_ptr, out_ptr, n, stride, stride_out, n_blk, k, BLOCK)


@triton.jit
def _fused_block(scores_ptr, st, counts_ptr, out_ptr, k, n, absent, stride, stride_out, n_blk,
                 live, BLOCK: tl.constexpr, NB: tl.constexpr, BOUND: tl.constexpr,
                 HIST_RELAXED: tl.constexpr):
    """One program's share of the one-launch selection (keys at columns < n; the barriers wait
    for the row's ``live`` programs)."""
    offs, key, m = _block_keys(scores_ptr, n, stride, n_blk, BLOCK)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    blk = pid % n_blk
    b256 = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    need = k + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(4):
        mp = m
        if p > 0:
            mp = m & ((key >> (32 - 8 * p)) == prefix)
        _add_digit_hist(st + p * 256, key, mp, p, HIST_RELAXED)
        _row_barrier(st, live * (p + 1))
        hh = tl.load(st + p * 256 + b256, cache_modifier=".cg")
        need, prefix = _digit(hh, need, prefix, absent, p, BOUND)
    gt = m & (key > prefix)  # the prefix is tau after 4 passes
    eq = m & (key == prefix) & (key != NEG_INF_KEY)  # -inf entries are never selected
    if (blk == 0) & (prefix == NEG_INF_KEY):  # tau = -inf: the need left stays -1
        _fill_tail(out_ptr + row * stride_out, k, k - need)
    g = gt.to(tl.int32)
    e = eq.to(tl.int32)
    cnt = counts_ptr + pid.to(tl.int64) * 2
    tl.store(cnt, tl.sum(g, axis=0))
    tl.store(cnt + 1, tl.sum(e, axis=0))
    _row_barrier(st, live * 5)
    # the picks of the row's earlier blocks: each block's first slots, in block order
    b = tl.arange(0, NB)
    before = b < blk
    rc = counts_ptr + row * n_blk * 2 + b * 2
    pos = tl.sum(tl.load(rc, mask=before, other=0, cache_modifier=".cg"), axis=0) \
        + tl.cumsum(g, axis=0) - g
    pe = tl.sum(tl.load(rc + 1, mask=before, other=0, cache_modifier=".cg"), axis=0) \
        + tl.cumsum(e, axis=0) - e
    orow = out_ptr + row * stride_out
    tl.store(orow + pos, offs.to(tl.int32), mask=gt & (pos < k))
    tl.store(orow + (k - need) + pe, offs.to(tl.int32), mask=eq & (pe < need))


@triton.jit
def _fused_kernel(scores_ptr, state_ptr, counts_ptr, out_ptr, pos_ptr, req_ptr, k, n, stride,
                  stride_out, n_blk, BLOCK: tl.constexpr, NB: tl.constexpr,
                  RATIO: tl.constexpr, BOUND: tl.constexpr, HIST_RELAXED: tl.constexpr = True,
                  PDL: tl.constexpr = False):
    """The whole selection in one launch: the passes above with a row barrier where a launch
    ended, the select computed by every program of the row from the same histogram (integer
    counts: the same digit everywhere), so the keys are read once and the output is the
    multi-launch form's, bit for bit."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    st = state_ptr + row * ROW_WORDS
    if BOUND:
        lim, live = _row_bound(pos_ptr, req_ptr, row, n, RATIO, BLOCK)
        if pid % n_blk < live:  # blocks past the bound end at once: no barrier waits for them
            _fused_block(scores_ptr, st, counts_ptr, out_ptr, k, lim, n - lim, stride,
                         stride_out, n_blk, live, BLOCK, NB, BOUND, HIST_RELAXED)
        elif (live == 0) & (pid % n_blk == 0):  # nothing visible: every slot -1
            _fill_tail(out_ptr + row * stride_out, k, 0)
    else:
        _fused_block(scores_ptr, st, counts_ptr, out_ptr, k, n, 0, stride, stride_out, n_blk,
                     n_blk, BLOCK, NB, BOUND, HIST_RELAXED)


def _one_launch_cap(device: torch.device) -> int:
    """The most programs a one-launch call may have on ``device``: every one resident at once on
    a ``spin_sync`` device (at most one per multiprocessor); 0 elsewhere."""
    if device.type != "cuda" or not adaptor_for(device.type).capabilities.spin_sync:
        return 0
    return sm_count(device)


def _one_launch(device: torch.device, programs: int, n_blk: int) -> bool:
    """Whether the one-launch form may run: every program of the call resident at once
    (``_one_launch_cap``), or one program per row (nothing to wait for: the interpreter, which
    runs programs one after another)."""
    return n_blk == 1 or programs <= _one_launch_cap(device)


def radix_topk(scores: torch.Tensor, k: int, out: torch.Tensor, block: int | None = None,
               one_launch: bool | None = None, row_pos: torch.Tensor | None = None,
               row_req: torch.Tensor | None = None, ratio: int = 1,
               num_warps: int | None = None) -> torch.Tensor:
    """scores [T, n] fp32 (unit inner stride), 1 <= k <= n; out [T, >= k] int32, any contents:
    columns [0, k) get the selected entries first, -1 after (columns >= k are left as they
    are). ``block``: scores per program (a power of two), ``one_launch``: force the form (where
    it may run), ``num_warps`` (default ``one_launch_warps`` / 8); benchmarks and tests.

    ``row_pos`` / ``row_req`` ([T] int32 or int64, given together): bound each row to its first
    row_len = 0 if req < 0 else min(n, (pos + 1) // ratio) scores (the indexer's visible
    entries), computed on the device; the scores at columns >= row_len are never read, counted or
    selected (they may hold anything), and a program whose block lies wholly past it does
    nothing (the row's counts and barriers wait for the others only). The output is the
    unbounded call's, bit for bit, when those scores are -inf."""
    t, n = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("radix_topk: scores must be fp32 with unit inner stride")
    if not 1 <= k <= n or out.shape[0] != t or out.shape[1] < k or out.dtype != torch.int32:
        raise ValueError(f"radix_topk: need 1 <= k={k} <= n={n} and int32 out [T, >= k]")
    bound = row_pos is not None
    if bound != (row_req is not None) or ratio < 1:
        raise ValueError("radix_topk: row_pos and row_req go together, ratio >= 1")
    if t == 0:
        return out
    dev = scores.device
    want_one = ONE_LAUNCH if one_launch is None else one_launch
    if block:
        blk = block
    elif dev.type == "cpu":
        blk = INTERP_BLOCK
    else:
        blk = auto_block(t, n, _one_launch_cap(dev) if want_one else 0)
    blk = min(blk, next_pow2(n))
    n_blk = cdiv(n, blk)
    state = torch.zeros(t, STATE_WORDS, dtype=torch.int32, device=dev)
    base = torch.empty(t, n_blk, 2, dtype=torch.int32, device=dev)
    if bound:
        pos = row_pos.to(dev).contiguous()
        req = row_req.to(dev).contiguous()
        ok = (torch.int32, torch.int64)
        if pos.shape != (t,) or req.shape != (t,) or pos.dtype not in ok or req.dtype not in ok:
            raise ValueError(f"radix_topk: row_pos / row_req must be int32 or int64 [{t}]")
    else:  # unread without BOUND: any pointers of the bounded launch's types
        pos, req = base.view(torch.int64), base
    bnd = dict(RATIO=ratio if bound else 1, BOUND=bound)
    hist = dict(HIST_RELAXED=HIST_RELAXED)
    if want_one and _one_launch(dev, t * n_blk, n_blk):
        _fused_kernel[(t * n_blk,)](scores, state, base, out, pos, req, k, n, scores.stride(0),
                                    out.stride(0), n_blk, BLOCK=blk,
                                    NB=next_pow2(n_blk), **bnd, **hist,
                                    num_warps=num_warps or one_launch_warps(blk),
                                    **pdl_launch(dev))
        return out
    for p in range(4):
        _hist_kernel[(t * n_blk,)](scores, state, pos, req, k, n, scores.stride(0), n_blk, PASS=p,
                                   BLOCK=blk, **bnd, **hist, num_warps=num_warps or 8,
                                   **pdl_launch(dev))
    # counts, then (in place) each block's first slots
    _count_kernel[(t * n_blk,)](scores, state, base, pos, req, n, scores.stride(0), n_blk,
                                BLOCK=blk, NB=next_pow2(n_blk), **bnd, num_warps=8,
                                **pdl_launch(dev))
    _gather_kernel[(t * n_blk,)](scores, state, base, out, pos, req, n, scores.stride(0),
                                 out.stride(0), n_blk, k, BLOCK=blk, **bnd, num_warps=8,
                                 **pdl_launch(dev))
    return out
