# SPDX-License-Identifier: Apache-2.0
"""The radix top-k's device helpers (``topk``): order-preserving keys, each row's bound, the
digit select from a row's histogram, the per-program histograms and their atomics, the row's
arrival count and barrier, the -1 tail; the layout of a row's state words (the four passes'
256-bin histograms at 0..1023, then the words named here)."""

from __future__ import annotations

import triton
import triton.language as tl

PREFIX_WORD = tl.constexpr(1024)  # tau's prefix as found so far (tau itself after four passes)
NEED_WORD = tl.constexpr(1025)  # keys equal to tau still to take
ARRIVED_WORD = tl.constexpr(1026)  # the row's arrival count (last-arrival select, row barriers)
# one row's state (``topk.STATE_WORDS``): word 1027 is unused (it held the removed early stop's
# shift); 1,028 keeps the rows 16-byte aligned and the kernels as they were timed
ROW_WORDS = tl.constexpr(1028)
NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # the key of -inf, below every finite score's


@triton.jit
def _row_bound(pos_ptr, req_ptr, row, n, RATIO: tl.constexpr, BLOCK: tl.constexpr):
    """The row's bound: its token's visible entries (the indexer's ``visible``; 0 without a
    request), and the blocks that hold any of them (the row's live programs)."""
    pos = tl.load(pos_ptr + row)
    req = tl.load(req_ptr + row)
    lim = tl.where(req >= 0, tl.minimum((pos + 1) // RATIO, n), 0).to(tl.int32)
    return lim, (lim + BLOCK - 1) // BLOCK


@triton.jit
def _block_keys(scores_ptr, n, stride, n_blk, BLOCK: tl.constexpr):
    """This program's score offsets, order-preserving keys and mask (columns < n: the row's
    width, or its bound)."""
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    offs = (pid % n_blk) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(scores_ptr + row * stride + offs, mask=m, other=float("-inf"))
    u = b.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return offs, key, m


@triton.jit
def _fill_tail(orow, k, first):
    """Slots [first, k) of the row's output: -1 (no entry: fewer than k keys above -inf). Only
    the row's first block writes it, so ``out`` needs no fill before the call."""
    TB: tl.constexpr = 1024
    for s in range(0, k, TB):
        j = s + tl.arange(0, TB)
        tl.store(orow + j, tl.full([TB], -1, tl.int32), mask=(j >= first) & (j < k))


@triton.jit
def _last_of_row(st, n_blk):
    """True in the row's last program to arrive (after its own atomics); resets the count."""
    tl.debug_barrier()
    arrived = tl.atomic_add(st + ARRIVED_WORD, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_blk - 1
    if last:
        tl.store(st + ARRIVED_WORD, 0)
    return last


@triton.jit
def _digit(h, need, prefix, absent, P: tl.constexpr, BOUND: tl.constexpr):
    """The pass's select from the row's histogram ``h`` [256]: the digit d where the count of
    keys with digit >= d first reaches ``need``; returns the need left and the grown prefix."""
    b = tl.arange(0, 256)
    if BOUND:
        # the absent keys (columns >= row_len) counted as the -inf keys they stand for: the same
        # digits, tau and need as the unbounded call on a row with a -inf tail (and a row with
        # fewer than k keys still finds its digit: tau = -inf, every present key above it)
        hit = b == ((NEG_INF_KEY >> (24 - 8 * P)) & 0xFF)
        if P > 0:
            hit = hit & (prefix == (NEG_INF_KEY >> (32 - 8 * P)))
        h = h + tl.where(hit, absent, 0)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with digit >= b
    d = tl.max(tl.where(ge >= need, b, -1), axis=0)
    need = need - tl.sum(tl.where(b > d, h, 0), axis=0)
    return need, (prefix << 8) | d.to(tl.uint32)


@triton.jit
def _hist_atomics(hist, h, RELAXED: tl.constexpr):
    """Add a program's histogram ``h`` [512] (bins >= 256: not counted) to the row's [256]."""
    bins = tl.arange(0, 512)
    if RELAXED:
        tl.atomic_add(hist + bins, h, mask=(bins < 256) & (h > 0), sem="relaxed", scope="gpu")
    else:
        tl.atomic_add(hist + bins, h, mask=(bins < 256) & (h > 0), sem="acq_rel", scope="gpu")


@triton.jit
def _add_digit_hist(hist, key, mp, P: tl.constexpr, HIST_RELAXED: tl.constexpr):
    """Add the histogram of pass ``P``'s digit over the keys where ``mp`` to the row's ``hist``:
    512 bins, the other keys in bin 256 (not added)."""
    digit = ((key >> (24 - 8 * P)) & 0xFF).to(tl.int32)
    _hist_atomics(hist, tl.histogram(tl.where(mp, digit, 256), 512), HIST_RELAXED)


@triton.jit
def _row_barrier(st, target):
    """Wait until ``target`` arrivals of the row's programs (this one's included) have been
    counted at its ARRIVED_WORD (``spin_sync`` devices only: every program of the row is resident).
    (Polling with volatile loads instead of atomics measured the same, within 2%.)"""
    tl.debug_barrier()
    c = tl.atomic_add(st + ARRIVED_WORD, 1, sem="acq_rel", scope="gpu") + 1
    while c < target:
        c = tl.atomic_add(st + ARRIVED_WORD, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
