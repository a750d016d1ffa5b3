"""Row-wise top-k of fp32 scores by radix select (the indexer's selection step).

``radix_topk(scores [T, n], k, out [T, k] int32)`` writes, per row, the indices of the k largest
scores that are > -inf first and leaves -1 after them (``out`` must come filled with -1). No host
synchronization, fixed launch count (CUDA-graph safe), exact: the k-th largest key is found digit
by digit, so the selected set is a top-k set; deterministic: the entries above the k-th score come
in ascending index order, then those equal to it, lowest indices first (ties go to the lowest
index), so the same scores give the same bits every run (attention sums its candidates in this
order).

Why: ``torch.topk`` over one long row (262,144 scores per decode token at 1M context) runs its
multi-block radix select in ~9 launches on few SMs: 62 us per row on the H200, more than the scoring
itself. Here every pass is spread over the whole row.

Keys: fp32 bits mapped to uint32 so that unsigned order is float order (negative: all bits
flipped; positive: sign bit set); -inf maps to 0x007FFFFF, below every finite score.

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

The state is one zeroed int32 buffer of ``_STATE`` words per row: histograms at 0..1023, prefix
1024, need 1025, the arrival count 1026, 1027 unused (the kernels use these offsets as literals).
Last-arrival selection: each program's atomics, a block barrier, then one acq_rel count; the last
program reads the table from L2 (``.cg``), where the atomics landed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.launch import sm_count
from vllm_dsv4_hw.ops.triton.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.platform.device import adaptor_for

INTERP_BLOCK = 1 << 16
ONE_LAUNCH = True


def auto_block(rows: int, n: int) -> int:
    """Scores per program on a GPU: about 128 programs per call, 1,024..4,096 scores each. H200,
    2026-12-02 (``decode_kernels --only topk``, k = 512, us): 1 x 32,768 scores 38.2 at 4,096 ->
    27.6 at 1,024; 1 x 262,144: 39.0 -> 33.7 at 2,048; 32 x 32,768: 57.4 at 4,096 (57.1 at
    2,048, 76.2 at 1,024)."""
    return min(4096, max(1024, triton.next_power_of_2(max(1, rows * n // 128))))
_NEG_INF_KEY = 0x007FFFFF
_STATE = 4 * 256 + 4  # per row: 4 histograms, prefix, need, count above, count equal


@triton.jit
def _block_keys(scores_ptr, state_ptr, n, stride, n_blk, BLOCK: tl.constexpr):
    """This program's row, score offsets, order-preserving keys, in-row mask, state row."""
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    offs = (pid % n_blk) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(scores_ptr + row * stride + offs, mask=m, other=float("-inf"))
    u = b.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return offs, key, m, state_ptr + row * 1028


@triton.jit
def _last_of_row(st, n_blk):
    """True in the row's last program to arrive (after its own atomics); resets the count."""
    tl.debug_barrier()
    arrived = tl.atomic_add(st + 1026, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_blk - 1
    if last:
        tl.store(st + 1026, 0)
    return last


@triton.jit
def _hist_kernel(scores_ptr, state_ptr, k, n, stride, n_blk, PASS: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    _, key, m, st = _block_keys(scores_ptr, state_ptr, n, stride, n_blk, BLOCK)
    if PASS > 0:
        prefix = tl.load(st + 1024).to(tl.uint32, bitcast=True)
        m = m & ((key >> (32 - 8 * PASS)) == prefix)
    digit = ((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
    digit = tl.where(m, digit, 256)                       # bins >= 256: not counted
    h = tl.histogram(digit, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(st + PASS * 256 + bins, h, mask=(bins < 256) & (h > 0), sem="acq_rel",
                  scope="gpu")
    if _last_of_row(st, n_blk):
        _select(st, k, PASS)


@triton.jit
def _select(st, k, PASS: tl.constexpr):
    bins = tl.arange(0, 256)
    h = tl.load(st + PASS * 256 + bins, cache_modifier=".cg")
    if PASS == 0:
        need = k
        prefix = tl.zeros([], dtype=tl.uint32)
    else:
        need = tl.load(st + 1025, cache_modifier=".cg")
        prefix = tl.load(st + 1024, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h     # keys with digit >= b
    d = tl.max(tl.where(ge >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > d, h, 0), axis=0)
    tl.store(st + 1024, ((prefix << 8) | d.to(tl.uint32)).to(tl.int32, bitcast=True))
    tl.store(st + 1025, need - above)


@triton.jit
def _block_picks(scores_ptr, state_ptr, n, stride, n_blk, BLOCK: tl.constexpr):
    """This program's keys above tau (taken) and equal to tau (taken while need lasts)."""
    offs, key, m, st = _block_keys(scores_ptr, state_ptr, n, stride, n_blk, BLOCK)
    tau = tl.load(st + 1024).to(tl.uint32, bitcast=True)
    gt = m & (key > tau)
    eq = m & (key == tau) & (key != 0x007FFFFF)  # -inf entries are never selected
    return offs, gt, eq, st


@triton.jit
def _count_kernel(scores_ptr, state_ptr, counts_ptr, n, stride, n_blk, BLOCK: tl.constexpr,
                  NB: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    _, gt, eq, st = _block_picks(scores_ptr, state_ptr, n, stride, n_blk, BLOCK)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    cnt = counts_ptr + pid.to(tl.int64) * 2
    tl.store(cnt, tl.sum(gt.to(tl.int32), axis=0))
    tl.store(cnt + 1, tl.sum(eq.to(tl.int32), axis=0))
    if _last_of_row(st, n_blk):
        # exclusive sums over the row's blocks, in block order: each block's first slots
        b = tl.arange(0, NB)
        ok = b < n_blk
        rc = counts_ptr + row * n_blk * 2 + b * 2
        g = tl.load(rc, mask=ok, other=0, cache_modifier=".cg")
        e = tl.load(rc + 1, mask=ok, other=0, cache_modifier=".cg")
        tl.store(rc, tl.cumsum(g, axis=0) - g, mask=ok)
        tl.store(rc + 1, tl.cumsum(e, axis=0) - e, mask=ok)


@triton.jit
def _gather_kernel(scores_ptr, state_ptr, base_ptr, out_ptr, n, stride, stride_out, n_blk, k,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    offs, gt, eq, st = _block_picks(scores_ptr, state_ptr, n, stride, n_blk, BLOCK)
    need = tl.load(st + 1025)
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


@triton.jit
def _row_barrier(st, target):
    """Wait until ``target`` arrivals of the row's programs (this one's included) have been
    counted at st[1026] (``spin_sync`` devices only: every program of the row is resident)."""
    tl.debug_barrier()
    c = tl.atomic_add(st + 1026, 1, sem="acq_rel", scope="gpu") + 1
    while c < target:
        c = tl.atomic_add(st + 1026, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _fused_kernel(scores_ptr, state_ptr, counts_ptr, out_ptr, k, n, stride, stride_out, n_blk,
                  BLOCK: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr = False):
    """The whole selection in one launch: the passes above with a row barrier where a launch
    ended, the select computed by every program of the row from the same histogram (integer
    counts: the same digit everywhere), so the keys are read once and the output is the
    multi-launch form's, bit for bit."""
    pdl_start(PDL)
    offs, key, m, st = _block_keys(scores_ptr, state_ptr, n, stride, n_blk, BLOCK)
    pid = tl.program_id(0)
    row = (pid // n_blk).to(tl.int64)
    blk = pid % n_blk
    bins = tl.arange(0, 512)
    b256 = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    need = k + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(4):
        mp = m
        if p > 0:
            mp = m & ((key >> (32 - 8 * p)) == prefix)
        digit = tl.where(mp, ((key >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256)
        h = tl.histogram(digit, 512)
        tl.atomic_add(st + p * 256 + bins, h, mask=(bins < 256) & (h > 0), sem="acq_rel",
                      scope="gpu")
        _row_barrier(st, n_blk * (p + 1))
        hh = tl.load(st + p * 256 + b256, cache_modifier=".cg")
        ge = tl.sum(hh, axis=0) - tl.cumsum(hh, axis=0) + hh
        d = tl.max(tl.where(ge >= need, b256, -1), axis=0)
        need = need - tl.sum(tl.where(b256 > d, hh, 0), axis=0)
        prefix = (prefix << 8) | d.to(tl.uint32)
    gt = m & (key > prefix)
    eq = m & (key == prefix) & (key != 0x007FFFFF)  # -inf entries are never selected
    g = gt.to(tl.int32)
    e = eq.to(tl.int32)
    cnt = counts_ptr + pid.to(tl.int64) * 2
    tl.store(cnt, tl.sum(g, axis=0))
    tl.store(cnt + 1, tl.sum(e, axis=0))
    _row_barrier(st, n_blk * 5)
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


def _one_launch(device: torch.device, programs: int, n_blk: int) -> bool:
    """Whether the one-launch form may run: every program of the call resident at once on a
    ``spin_sync`` device (at most one per multiprocessor), or one program per row (nothing to
    wait for: the interpreter, which runs programs one after another)."""
    if n_blk == 1:
        return True
    if device.type != "cuda" or not adaptor_for(device.type).capabilities.spin_sync:
        return False
    return programs <= sm_count(device)


def radix_topk(scores: torch.Tensor, k: int, out: torch.Tensor, block: int | None = None,
               one_launch: bool | None = None) -> torch.Tensor:
    """scores [T, n] fp32 (unit inner stride), 1 <= k <= n; out [T, >= k] int32 filled with -1:
    columns [0, k) get the selected entries first, -1 after. ``block``: scores per program (a
    power of two), ``one_launch``: force the form (where it may run); benchmarks and tests."""
    t, n = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("radix_topk: scores must be fp32 with unit inner stride")
    if not 1 <= k <= n or out.shape[0] != t or out.shape[1] < k or out.dtype != torch.int32:
        raise ValueError(f"radix_topk: need 1 <= k={k} <= n={n} and int32 out [T, >= k]")
    if t == 0:
        return out
    blk = block or (INTERP_BLOCK if scores.device.type == "cpu" else auto_block(t, n))
    blk = min(blk, triton.next_power_of_2(n))
    n_blk = triton.cdiv(n, blk)
    state = torch.zeros(t, _STATE, dtype=torch.int32, device=scores.device)
    base = torch.empty(t, n_blk, 2, dtype=torch.int32, device=scores.device)
    if ONE_LAUNCH if one_launch is None else one_launch:
        if _one_launch(scores.device, t * n_blk, n_blk):
            _fused_kernel[(t * n_blk,)](scores, state, base, out, k, n, scores.stride(0),
                                        out.stride(0), n_blk, BLOCK=blk,
                                        NB=triton.next_power_of_2(n_blk), num_warps=8,
                                        **pdl_launch(scores.device))
            return out
    for p in range(4):
        _hist_kernel[(t * n_blk,)](scores, state, k, n, scores.stride(0), n_blk, PASS=p,
                                   BLOCK=blk, num_warps=8, **pdl_launch(scores.device))
    # counts, then (in place) each block's first slots
    _count_kernel[(t * n_blk,)](scores, state, base, n, scores.stride(0), n_blk, BLOCK=blk,
                                NB=triton.next_power_of_2(n_blk), num_warps=8,
                                **pdl_launch(scores.device))
    _gather_kernel[(t * n_blk,)](scores, state, base, out, n, scores.stride(0), out.stride(0),
                                 n_blk, k, BLOCK=blk, num_warps=8, **pdl_launch(scores.device))
    return out
