# SPDX-License-Identifier: Apache-2.0
"""Triton lightning-indexer top-k: ``indexer_topk`` of ``ops.api`` (spec section 4).

Step 1, ``_indexer_score_kernel`` (1-D grid over (token group, entry split)): a program owns
``TB`` consecutive tokens (1 for decode, ``GROUP_TOKENS`` in prefill-sized calls) and ``ITERS``
consecutive blocks of ``BLOCK_S`` compressed entries of their request. It loads the tokens' q
[TB * H, Di] (whole rows, then split into even / odd dims) and head weights once, then per block
reads the keys straight from the paged cache as (even, odd) dim pairs (``quant.load_entry_pairs``:
one contiguous load per pair and key, dequantized on the fly: bf16, fp8 (scale applied to the
logits), mxfp4, fp32 test format), computes all heads' logits with tl.dot [BLOCK_S, Di/2] x
[Di/2, TB * H] on the even and the odd halves (keys as the A operand; every key is
read once per token group and no interleave is needed), and reduces ``score = sum_h w[h] *
relu(logit[h])`` per token in fp32. A group whose tokens belong to more than
one request (or to none) is scored token by token; blocks past every token's visible entries
only store -inf (or nothing, ``SKIP_TAIL``, where the radix selection is bounded to the visible
entries). Entries not visible to the token (``ratio*s + ratio - 1 > pos``, beyond the block
table, in an unallocated page, or any entry of a token with request -1) get -inf. Scores go to a [T, n_max] fp32 buffer, n_max = block-table width
* entries per page (known on the host: no device sync). Unlike the reference (which raises), a
visible entry in an unallocated page (-1) is skipped (-inf) rather than read.

Dot precision (constexpr ``DOT``): keys of every quantized format are exact in bf16 (the fp8 key's
power-of-two scale is applied to the logits instead, which is exact), so on GPU the dot runs on bf16
tensor cores with fp32 accumulation: q in bf16 as is (``DOT_BF16``), fp32 / fp16 q split into a bf16
hi + lo pair (``DOT_BF16X2``, ~16 mantissa bits). fp32 keys (test format) and the CPU interpreter
(where bf16 dots are wrong) use an fp32 ``ieee`` dot (``DOT_F32``).

Step 2 (``indexer_select``), selection of k = min(topk, n_max) entries per token: a radix select
over the score rows (``ops.triton.topk.radix_topk``) or ``torch.topk`` (unsorted) then
``_select_compact_kernel``, whichever measured faster for the number of scores
(``tuning.IndexerTuning``). Either way the selected entries (score > -inf) come first, -1 after
(also the columns beyond n_max), in no particular order: compare results as sets. Selecting inside
the score kernel would remove the score round trip (4 B per entry written and read back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.common import quant
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, dot_dim, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import C_CVT_PTX, E2M1_E4M3_SHIFT, e2m1_pairs_to_e4m3
from vllm_dsv4_hw.ops.triton.common.quant import e4m3_bits_to_f32, load_entry_pairs
from vllm_dsv4_hw.ops.triton.indexer.launch import (  # noqa: F401  (DOT_*: the dots' modes)
    DOT_BF16,
    DOT_BF16X2,
    DOT_F32,
    DOT_FP8,
    DOT_FP8_EMU,
    GROUP_TOKENS,
    MX_DIMS,
    REG_CAP,
    _dot_mode,
    _grid,
    _key_decode,
    _launch_config,
    _q_operand,
    _reg_cap,
    _tokens_per_program,
)

_MX_BLOCK = tl.constexpr(MX_DIMS)   # MXFP4: dims per ue8m0 scale
_MX_SHIFT = tl.constexpr(127 + E2M1_E4M3_SHIFT)   # placed codes are value * 2^-6

# Upper bound on the fp32 score buffer materialized at once (elements); tokens are chunked.
_MAX_SCORE_ELEMS = 1 << 27


@triton.jit
def _q_operands(q_row, row_mask, R: tl.constexpr, DI: tl.constexpr, KP: tl.constexpr,
                DOT: tl.constexpr):
    """The dots' q operands from rows ``q_row`` ([R, 1] pointers): even and odd dims, as fp32
    (``DOT_F32``), bf16, or a bf16 hi + lo pair (``DOT_BF16X2``; lo is 0 otherwise). Each row is
    read as one contiguous run (wide loads), then split into its even / odd dims. Pairs beyond
    DI/2 (KP > DI/2) load as 0: exact zeros in the logits."""
    d = tl.arange(0, 2 * KP)
    q = tl.load(q_row + d[None, :], mask=row_mask & (d[None, :] < DI), other=0.0)
    q_e, q_o = tl.split(tl.reshape(q.to(tl.float32), (R, KP, 2)))
    if DOT == 0:
        return q_e, q_o, q_e, q_o
    qe_hi = q_e.to(tl.bfloat16)
    qo_hi = q_o.to(tl.bfloat16)
    if DOT == 2:
        return qe_hi, qo_hi, (q_e - qe_hi.to(tl.float32)).to(tl.bfloat16), \
            (q_o - qo_hi.to(tl.float32)).to(tl.bfloat16)
    return qe_hi, qo_hi, qe_hi, qo_hi


@triton.jit
def _entry_pages(bt_ptr, req, stride_bt, s0, s, vis, bt_cols, E: tl.constexpr,
                 ONE_PAGE: tl.constexpr):
    """(page [int64], entry offset in its page [int64], vis & allocated) of entries ``s`` (the
    block starting at ``s0``). ``ONE_PAGE`` (the block size divides the entries per page: the
    GPU's 64-entry blocks over 64-entry pages): the block lies in page s0 // E, looked up once as
    a scalar, so the entries' addresses are one contiguous run (the per-entry lookup and 64-bit
    address arithmetic were ~1/5 of the decode loop's instructions, sm_90 SASS)."""
    if ONE_PAGE:
        col = s0 // E   # < bt_cols for any block that holds a visible entry; clamped for others
        page = tl.load(bt_ptr + req * stride_bt + tl.minimum(col, bt_cols - 1))
        page = tl.where(col < bt_cols, page, -1) + tl.zeros_like(s).to(page.dtype)  # (a vector:
        vis = vis & (page >= 0)  # the interpreter mis-types vector & scalar)
        off = (s0 % E + (s - s0)).to(tl.int64)
    else:
        page = tl.load(bt_ptr + req * stride_bt + s // E, mask=vis & (s // E < bt_cols), other=-1)
        vis = vis & (page >= 0)
        off = (s % E).to(tl.int64)
    return tl.maximum(page, 0).to(tl.int64), off, vis


@triton.jit
def _block_logits(qe, qo, qe_lo, qo_lo, cache_ptr, bt_ptr, req, stride_bt, s0, s, vis, bt_cols,
                  page_stride, page_stride_units, j, DI: tl.constexpr, E: tl.constexpr,
                  DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, UNIT: tl.constexpr,
                  FMT: tl.constexpr, DOT: tl.constexpr, KP: tl.constexpr,
                  CVT: tl.constexpr, ONE_PAGE: tl.constexpr):
    """Logits [R, BLOCK_S] of the q rows against the keys of entries ``s`` of request ``req``
    (those with ``vis``), and which entries were read (visible and in an allocated page).
    The keys are the dots' A operand and the q operands come transposed ([KP, R]): the logits
    come back as [BLOCK_S, R] (the heads along the accumulator's columns, so the head sum after it
    stays mostly inside a thread)."""
    page64, off, vis = _entry_pages(bt_ptr, req, stride_bt, s0, s, vis, bt_cols, E, ONE_PAGE)
    pair_off = page64 * page_stride_units + off * (DATA_BYTES // UNIT)
    if SCALE_BYTES == 4:  # one aligned 32-bit scale word per key (mxfp4 / fp8, dim 128): its
        # index in words (``quant.check_cache``: the page stride is a multiple of 4; a division
        # of the byte offset cost 8 instructions per key)
        tl.static_assert((E * DATA_BYTES) % 4 == 0, "the scale words start 4-byte aligned")
        scale_arg = page64 * (page_stride // 4) + (E * DATA_BYTES) // 4 + off
    else:
        scale_arg = page64 * page_stride + E * DATA_BYTES + off * SCALE_BYTES
    # [BLOCK_S, KP] key tiles
    kmask = vis[:, None] if KP == DI // 2 else vis[:, None] & (j[None, :] < DI // 2)
    k_e, k_o = load_entry_pairs(cache_ptr, pair_off[:, None], scale_arg[:, None], j[None, :],
                                kmask, FMT, SCALE_BYTES == 4, CVT == C_CVT_PTX)
    if DOT == 0:
        logits = tl.dot(k_e, qe, input_precision="ieee")
        logits = tl.dot(k_o, qo, logits, input_precision="ieee")
    else:
        # keys are exact in bf16 (fp8 codes unscaled, e2m1 * 2^e, bf16): tensor cores
        ke = k_e.to(tl.bfloat16)
        ko = k_o.to(tl.bfloat16)
        logits = tl.dot(ke, qe)
        logits = tl.dot(ko, qo, logits)
        if DOT == 2:
            logits = tl.dot(ke, qe_lo, logits)
            logits = tl.dot(ko, qo_lo, logits)
    if FMT == 3:  # FMT_FP8_INDEXER: the key's power-of-two scale on the logits (exact)
        tl.static_assert(SCALE_BYTES == 4, "fp8 indexer keys carry one fp32 scale word")
        scale = tl.load(cache_ptr.to(tl.pointer_type(tl.float32)) + scale_arg, mask=vis,
                        other=1.0)
        logits = logits * scale[:, None]
    return logits, vis


@triton.jit
def _q_block_fp8(q_row, row_mask, c0, W: tl.constexpr, DOT: tl.constexpr):
    """Dims [c0, c0 + W) of the q rows as the dots' B operand [W, R]: the e4m3 codes as they lie
    (``DOT_FP8``), or their fp32 values (``DOT_FP8_EMU``: q handed over as fp32)."""
    d = c0 + tl.arange(0, W)
    q = tl.load(q_row + d[None, :], mask=row_mask, other=0.0)
    return tl.trans(q)


@triton.jit
def _fp8_dot(a, b, DOT: tl.constexpr):
    if DOT == 3:
        return tl.dot(a, b)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _mx_block_e4m3(cache_ptr, entry_byte, c, vis, DOT: tl.constexpr, CVT: tl.constexpr):
    """Scale block ``c`` (dims 32c .. 32c+31) of MXFP4 entries as [BLOCK_S, 32] e4m3 codes of the
    value * 2^-6 in dim order (one 16-byte load per entry; even / odd dims interleaved back)."""
    jb = tl.arange(0, _MX_BLOCK // 2)
    b = tl.load(cache_ptr + entry_byte[:, None] + c * (_MX_BLOCK // 2) + jb[None, :],
                mask=vis[:, None], other=0)
    ev, od = e2m1_pairs_to_e4m3(b, CVT == C_CVT_PTX)
    k = tl.reshape(tl.join(ev, od), (ev.shape[0], _MX_BLOCK))
    if DOT == 4:
        k = e4m3_bits_to_f32(k)
    else:
        k = k.to(tl.float8e4nv, bitcast=True)
    return k


@triton.jit
def _mx_scale(word, c):
    """2^(sb_c - 127 + 6) as fp32 (exact) for the scale byte c of each entry's scale word."""
    sb = ((word >> (8 * c)) & 0xFF).to(tl.int32)
    sbc = tl.minimum(sb, 254 - _MX_SHIFT + 127)
    hi = ((sbc - _MX_SHIFT + 127) << 23).to(tl.float32, bitcast=True)
    return hi * ((sb - sbc + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _block_logits_fp8(qb0, qb1, qb2, qb3, cache_ptr, bt_ptr, req, stride_bt, s0, s, vis,
                      bt_cols, page_stride, DI: tl.constexpr, E: tl.constexpr,
                      DATA_BYTES: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr,
                      CVT: tl.constexpr, ONE_PAGE: tl.constexpr):
    """Logits [BLOCK_S, R] of e4m3 q codes against the keys of entries ``s`` (those with
    ``vis``) on FP8 dots, and which entries were read. MXFP4: one K = 32 dot per scale block
    (q blocks ``qb0..qb3``), its fp32 result times the block's scale: the tensor core sums only
    within a block. FP8 keys: one K = DI dot (``qb0``), times the key's scale."""
    page64, off, vis = _entry_pages(bt_ptr, req, stride_bt, s0, s, vis, bt_cols, E, ONE_PAGE)
    entry_byte = page64 * page_stride + off * DATA_BYTES
    tl.static_assert((E * DATA_BYTES) % 4 == 0, "the scale words start 4-byte aligned")
    scale_word = page64 * (page_stride // 4) + (E * DATA_BYTES) // 4 + off
    if FMT == 4:
        tl.static_assert(DI == 4 * _MX_BLOCK, "FP8 dots over MXFP4 keys take head dim 128")
        word = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + scale_word, mask=vis,
                       other=0x7F7F7F7F)
        logits = _fp8_dot(_mx_block_e4m3(cache_ptr, entry_byte, 0, vis, DOT, CVT), qb0,
                          DOT) * _mx_scale(word, 0)[:, None]
        logits += _fp8_dot(_mx_block_e4m3(cache_ptr, entry_byte, 1, vis, DOT, CVT), qb1,
                           DOT) * _mx_scale(word, 1)[:, None]
        logits += _fp8_dot(_mx_block_e4m3(cache_ptr, entry_byte, 2, vis, DOT, CVT), qb2,
                           DOT) * _mx_scale(word, 2)[:, None]
        logits += _fp8_dot(_mx_block_e4m3(cache_ptr, entry_byte, 3, vis, DOT, CVT), qb3,
                           DOT) * _mx_scale(word, 3)[:, None]
    else:
        tl.static_assert(FMT == 3, "FP8 dots take MXFP4 or fp8 indexer keys")
        d = tl.arange(0, DI)
        k = tl.load(cache_ptr + entry_byte[:, None] + d[None, :], mask=vis[:, None], other=0)
        if DOT == 4:
            k = e4m3_bits_to_f32(k)
        else:
            k = k.to(tl.float8e4nv, bitcast=True)
        scale = tl.load(cache_ptr.to(tl.pointer_type(tl.float32)) + scale_word, mask=vis,
                        other=1.0)
        logits = _fp8_dot(k, qb0, DOT) * scale[:, None]
    return logits, vis


@triton.jit
def _indexer_score_kernel(q_ptr, w_ptr, qs_ptr, cache_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr,
                          stride_qt, stride_wt, stride_qs, stride_bt, stride_out, page_stride,
                          page_stride_units, n_max, n_split, bt_cols, n_programs, n_tokens,
                          H: tl.constexpr, DI: tl.constexpr, E: tl.constexpr,
                          DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                          UNIT: tl.constexpr, RATIO: tl.constexpr, FMT: tl.constexpr,
                          DOT: tl.constexpr, BLOCK_S: tl.constexpr, ITERS: tl.constexpr,
                          KP: tl.constexpr, TB: tl.constexpr,
                          CVT: tl.constexpr, SKIP_TAIL: tl.constexpr = False,
                          PDL: tl.constexpr = False, QS: tl.constexpr = False):
    """Program = (TB consecutive tokens, split of ITERS entry blocks). Keys are read as (even,
    odd) dim pairs (``quant.load_entry_pairs``: one contiguous load per pair), so logits =
    q_even @ k_even + q_odd @ k_odd (two K = DI/2 dots; four in the hi/lo mode), for the TB
    tokens' TB * H q rows at once: each key tile is loaded and dequantized once per TB tokens
    (prefill, where consecutive tokens share their request; a group whose tokens belong to
    different requests, or to none, is scored one token at a time). KP: the dots' K, DI/2 padded
    with zero pairs up to the device's smallest tl.dot (``launch.dot_dim``). SKIP_TAIL: blocks
    past every token's visible entries store nothing (a bounded ``radix_topk`` never reads them).
    QS: q is e4m3 codes (values for ``DOT_F32`` / ``DOT_FP8_EMU``) whose per-(token, head) scales
    ``qs_ptr`` multiply the head weights (positive powers of two: exact, relu commutes).
    ``DOT_FP8`` / ``DOT_FP8_EMU``: keys as the A operand (``_block_logits_fp8``)."""
    pdl_start(PDL)
    r = tl.arange(0, TB * H)
    tok_of_row = r // H
    head = r % H
    i = tl.arange(0, TB)
    j = tl.arange(0, KP)
    for pid in range(tl.program_id(0), n_programs, tl.num_programs(0)):  # grid-stride (Ascend cap)
        t0 = (pid // n_split) * TB
        sp = pid % n_split
        tok = t0 + i
        tok_ok = tok < n_tokens
        req0 = tl.load(req_ptr + t0)
        reqs = tl.load(req_ptr + tok, mask=tok_ok, other=req0)
        shared = (tl.min(reqs, axis=0) == tl.max(reqs, axis=0)) & (req0 >= 0)
        # rows of the tokens scored together: all TB (shared request) or one at a time
        for one in range(0, tl.where(shared, 1, TB)):
            # (sums of int32 flags: the interpreter types bool | bool as an integer)
            sh = shared.to(tl.int32)
            rows_ok = ((t0 + tok_of_row) < n_tokens) & ((tok_of_row == one).to(tl.int32) + sh > 0)
            tok_sel = tok_ok & ((i == one).to(tl.int32) + sh > 0)
            rt = (t0 + tok_of_row).to(tl.int64)
            req = tl.maximum(tl.max(tl.where(tok_sel, reqs, -1), axis=0), -1)
            pos = tl.load(pos_ptr + tok, mask=tok_sel, other=-1).to(tl.int64)
            visible = tl.where(tok_sel & (reqs >= 0), (pos + 1) // RATIO, 0)
            visible = tl.minimum(visible, n_max)                     # [TB]
            v_max = tl.max(visible, axis=0)
            req = tl.maximum(req, 0).to(tl.int64)
            w = tl.load(w_ptr + rt * stride_wt + head, mask=rows_ok, other=0.0).to(tl.float32)
            if QS:
                w *= tl.load(qs_ptr + rt * stride_qs + head, mask=rows_ok, other=0.0)
            q_rows = q_ptr + rt[:, None] * stride_qt + head[:, None] * DI
            if DOT >= 3:
                if FMT == 4:
                    qe = _q_block_fp8(q_rows, rows_ok[:, None], 0, _MX_BLOCK, DOT)
                    qo = _q_block_fp8(q_rows, rows_ok[:, None], _MX_BLOCK, _MX_BLOCK, DOT)
                    qe_lo = _q_block_fp8(q_rows, rows_ok[:, None], 2 * _MX_BLOCK, _MX_BLOCK, DOT)
                    qo_lo = _q_block_fp8(q_rows, rows_ok[:, None], 3 * _MX_BLOCK, _MX_BLOCK, DOT)
                else:
                    qe = _q_block_fp8(q_rows, rows_ok[:, None], 0, DI, DOT)
                    qo, qe_lo, qo_lo = qe, qe, qe
            else:
                qe, qo, qe_lo, qo_lo = _q_operands(q_rows, rows_ok[:, None], TB * H, DI, KP, DOT)
                qe, qo = tl.trans(qe), tl.trans(qo)
                qe_lo, qo_lo = tl.trans(qe_lo), tl.trans(qo_lo)
            out_rows = out_ptr + tok.to(tl.int64)[:, None] * stride_out
            for it in range(ITERS):
                s0 = (sp * ITERS + it) * BLOCK_S
                s = s0 + tl.arange(0, BLOCK_S)
                st_mask = tok_sel[:, None] & (s < n_max)[None, :]
                if s0 >= v_max:
                    # a block past every selected token's visible entries (the causal tail of a
                    # prefill chunk, the table beyond a short request): no loads, no dots
                    if not SKIP_TAIL:
                        tl.store(out_rows + s[None, :],
                                 tl.full([TB, BLOCK_S], float("-inf"), tl.float32), mask=st_mask)
                else:
                    if DOT >= 3:   # (q blocks 0..3 of MXFP4 in qe, qo, qe_lo, qo_lo)
                        logits, read = _block_logits_fp8(
                            qe, qo, qe_lo, qo_lo, cache_ptr, bt_ptr, req, stride_bt, s0, s,
                            s < v_max, bt_cols, page_stride, DI, E, DATA_BYTES, FMT, DOT, CVT,
                            E % BLOCK_S == 0)
                    else:
                        logits, read = _block_logits(
                            qe, qo, qe_lo, qo_lo, cache_ptr, bt_ptr, req, stride_bt, s0, s,
                            s < v_max, bt_cols, page_stride, page_stride_units, j, DI, E,
                            DATA_BYTES, SCALE_BYTES, UNIT, FMT, DOT, KP, CVT,
                            E % BLOCK_S == 0)
                    wl = w[None, :] * tl.maximum(logits, 0.0)      # [BLOCK_S, TB * H]
                    score = tl.trans(tl.sum(tl.reshape(wl, (BLOCK_S, TB, H)), axis=2))
                    ok = read[None, :] & (s[None, :] < visible[:, None])   # [TB, BLOCK_S]
                    tl.store(out_rows + s[None, :], tl.where(ok, score, float("-inf")),
                             mask=st_mask)


@triton.jit
def _select_compact_kernel(vals_ptr, idx_ptr, out_ptr, k, n_rows, stride_v, stride_i, stride_o,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Rows of an unsorted top-k: the selected entries (score > -inf) first, in the order
    found, then -1; int32 out. Position of a selected entry = selected ones before it; of an
    unselected one = all selected + unselected ones before it. Grid-strided over the rows."""
    pdl_start(PDL)
    j = tl.arange(0, BLOCK_K)
    m = j < k
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r = tl.cast(row, tl.int64)
        v = tl.load(vals_ptr + r * stride_v + j, mask=m, other=float("-inf"))
        i = tl.load(idx_ptr + r * stride_i + j, mask=m, other=0)
        sel = (v > float("-inf")) & m
        c = tl.cumsum(sel.to(tl.int32), axis=0)          # selected in [0, j]
        n_sel = tl.sum(sel.to(tl.int32), axis=0)
        dest = tl.where(sel, c - 1, n_sel + j - c)
        tl.store(out_ptr + r * stride_o + dest, tl.where(sel, i, -1).to(tl.int32), mask=m)


def compact_selected(vals: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
    """``torch.topk``'s unsorted rows (``vals``, ``idx`` [T, k]) into ``dst`` [T, >= k] int32:
    the selected entries (score > -inf) first, -1 after (``_select_compact_kernel``)."""
    k = idx.shape[1]
    _select_compact_kernel[(_grid(dst.shape[0], dst.device),)](
        vals, idx, dst, k, dst.shape[0], vals.stride(0), idx.stride(0), dst.stride(0),
        BLOCK_K=next_pow2(k), num_warps=4, **pdl_launch(dst.device))


def indexer_scores(q, weights, key_cache, key_fmt, block_table, token_req, token_pos, ratio,
                   n_max: int | None = None, block_s: int | None = None,
                   out: torch.Tensor | None = None, iters: int | None = None,
                   num_warps: int | None = None, num_stages: int = 2,
                   tokens_per_program: int | None = None,
                   cvt: int | None = None,
                   skip_tail: bool = False, q_scales: torch.Tensor | None = None,
                   maxnreg: int | None = None) -> torch.Tensor:
    """The [T, n_max] fp32 score buffer (masked entries -inf) of step 1 (also used by benchmarks).

    ``q_scales`` [T, Hi]: q is e4m3 codes of q / q_scales (``ops.api.indexer_topk``); the scales
    multiply the head weights in the kernel.
    ``out``: an optional preallocated [T, n_max] fp32 buffer (every element is written).
    ``skip_tail``: a block of ``block_s`` entries past the visible entries of every token scored
    with it is left unwritten; the columns below a token's visible count are always written (the
    bounded ``radix_topk`` of ``indexer_topk`` reads no others). Default: full -inf stores.
    ``block_s`` / ``iters`` / ``num_warps`` / ``num_stages`` / ``tokens_per_program`` /
    ``maxnreg`` (NVIDIA register cap: more programs per SM; None: ``REG_CAP``'s rule, 0: no
    cap): launch knobs (benchmark sweeps)."""
    t, h, di = q.shape
    dev = q.device
    fmt_code = quant.format_code(key_fmt)
    if key_fmt.dim != di:
        raise ValueError(f"key format dim {key_fmt.dim} != q head dim {di}")
    min_h = dot_dim(1, dev)  # the heads are the dots' M (K is padded: any even head dim works)
    if h & (h - 1) or di & (di - 1) or h < min_h or di < 2:
        raise ValueError(f"triton indexer needs power-of-two heads >= {min_h} and a power-of-two "
                         f"head dim >= 2, got {h}x{di}")
    if fmt_code == quant.FMT_FP8_DS_MLA:
        raise ValueError("indexer keys cannot use the fp8_ds_mla (main KV) format")
    quant.check_cache(key_cache, key_fmt)
    unit = quant.pair_unit_bytes(fmt_code)
    if key_cache.stride(0) % unit or key_fmt.data_bytes % unit or (
            fmt_code == quant.FMT_FP8_INDEXER and key_fmt.scale_bytes != 4):
        raise ValueError(f"{key_fmt.name}: page stride {key_cache.stride(0)} B is not a multiple of "
                         f"the {unit}-byte pair unit")
    e = key_fmt.entries_per_page
    if n_max is None:
        n_max = block_table.shape[1] * e
    if out is None:
        out = torch.empty(t, n_max, dtype=torch.float32, device=dev)
    elif out.shape != (t, n_max) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [{t}, {n_max}] with unit inner stride")
    if t == 0 or n_max == 0:
        return out
    if q_scales is not None and (q.dtype != torch.float8_e4m3fn
                                 or tuple(q_scales.shape) != (t, h)):
        raise ValueError(f"indexer_topk: q_scales {tuple(q_scales.shape)} needs q as e4m3 codes "
                         f"[T, Hi, Di] with q_scales [T, Hi]; got q {q.dtype} {tuple(q.shape)} "
                         f"(rope_fp8_quant gives both)")
    dot = _dot_mode(q, fmt_code)
    q = _q_operand(q, dot)
    q = q if q.is_contiguous() else q.contiguous()
    weights = weights.to(torch.float32)
    if q_scales is not None:
        qs = q_scales.to(device=dev, dtype=torch.float32)
        qs = qs if qs.stride(-1) == 1 else qs.contiguous()
        qs_stride = qs.stride(0)
    else:
        qs, qs_stride = weights, 0   # not read
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    # the block table and the requests int32 or int64 as given: the decode metadata holds
    # int64, and a cast here was one more launch per c4a layer on the selection's critical path
    # (the kernel reads either)
    bt = block_table.to(device=dev)
    bt = bt if bt.dtype in (torch.int32, torch.int64) else bt.to(torch.int32)
    bt = bt if bt.stride(-1) == 1 else bt.contiguous()
    req = token_req.to(device=dev)
    req = req if req.dtype in (torch.int32, torch.int64) else req.to(torch.int64)
    req = req.contiguous()
    pos = token_pos.to(device=dev, dtype=torch.int64).contiguous()
    if block_s is None:
        # the interpreter pays per op, not per element: few large blocks there
        block_s = 64 if dev.type != "cpu" else min(1024, max(16, next_pow2(n_max)))
    n_blocks = cdiv(n_max, block_s)
    tb = _tokens_per_program(t) if tokens_per_program is None else tokens_per_program
    if tb < 1 or tb & (tb - 1):
        raise ValueError(f"tokens_per_program must be a power of two >= 1, got {tb}")
    groups = cdiv(t, tb)
    if iters is None:
        iters = _launch_config(groups, n_blocks, dev)
    if num_warps is None:
        num_warps = 4
    n_split = cdiv(n_blocks, iters)
    if maxnreg is None:
        regs = _reg_cap(groups * n_split, tb, fmt_code, dot, dev)
    else:  # a sweep's cap (0: none); NVIDIA launches only
        regs = {"maxnreg": maxnreg} if maxnreg and dev.type == "cuda" else {}
    _indexer_score_kernel[(_grid(groups * n_split, dev, cube=True),)](
        q, weights, qs, key_cache, bt, req, pos, out,
        q.stride(0), weights.stride(0), qs_stride, bt.stride(0), out.stride(0),
        key_cache.stride(0),
        key_cache.stride(0) // unit, n_max, n_split, bt.shape[1], groups * n_split, t,
        H=h, DI=di, E=e, DATA_BYTES=key_fmt.data_bytes, SCALE_BYTES=key_fmt.scale_bytes, UNIT=unit,
        RATIO=ratio, FMT=fmt_code, DOT=dot, BLOCK_S=block_s, ITERS=iters,
        KP=dot_dim(di // 2, dev), TB=tb,
        CVT=_key_decode(fmt_code, dot, dev) if cvt is None else cvt, SKIP_TAIL=skip_tail,
        QS=q_scales is not None,
        num_warps=num_warps, num_stages=num_stages, **regs, **pdl_launch(dev))
    return out

