# SPDX-License-Identifier: Apache-2.0
"""Device functions of the Triton ``sparse_attention`` kernels (``ops.triton.sparse_attention``):
loading one tile of candidate entries as stored (fp8_ds_mla, bf16 or fp32), dequantizing it in
registers, one online-softmax step of a head block over a tile, the candidates of both caches in
one loop (or a range of one cache's) in tiles, optionally with the next tile's loads in flight,
and the output store.

fp8 decoding is integer bit manipulation (portable to triton-ascend, which has no fp8 dtypes),
the hardware conversion, or the packed PTX decode of ``ptx_codecs`` where the device declares it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_dsv4_hw.kv_cache.formats.fp8_ds_mla import FP8DSMLAFormat
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import C_CVT_HW, C_CVT_PTX, e4m3_bits_to_16bit
from vllm_dsv4_hw.ops.triton.common.quant import e4m3_bits_to_f32, round_to_bf16, ue8m0_to_f32

# fp8_ds_mla entry geometry: 448 e4m3 dims in 7 blocks of 64 with one ue8m0 byte each, then 64
# bf16 rope dims at data bytes 448..575; 8 scale bytes (7 + pad).
_FMT = FP8DSMLAFormat()
_FP8_NOPE = tl.constexpr(_FMT.NOPE_DIM)
_FP8_QBLOCK = tl.constexpr(_FMT.BLOCK)
_FP8_NGROUP = tl.constexpr(_FMT.NUM_BLOCKS + 1)  # 7 scaled e4m3 groups + the rope group
_FP8_DATA_BYTES = tl.constexpr(_FMT.data_bytes)
_FP8_SCALE_BYTES = tl.constexpr(_FMT.scale_bytes)
_FP8_ROPE_ELEM = tl.constexpr(_FMT.NOPE_DIM // 2)  # the rope dims' first bf16 element in an entry
_FP8_DATA_ELEM = tl.constexpr(_FMT.data_bytes // 2)


@triton.jit
def _e4m3_to_f32(code, CVT: tl.constexpr):
    """e4m3fn codes (uint8) -> fp32: the decode the device declares (``ptx_codecs.e4m3_mode``:
    packed PTX integer ops, hardware conversion, or portable integer bit tricks)."""
    if CVT == C_CVT_PTX:
        v = e4m3_bits_to_16bit(code, tl.bfloat16).to(tl.float32)
    elif CVT == C_CVT_HW:
        v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = e4m3_bits_to_f32(code)
    return v


@triton.jit
def _load_raw_tile(
    u8_ptr,
    typed_ptr,
    slots_row_ptr,
    start,
    hi,
    E,
    PAGE_BYTES,
    PAGE_ELEMS,
    FMT: tl.constexpr,
    D: tl.constexpr,
    DATA_ELEMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Issue the loads of candidates ``[start, start + BLOCK_N)`` (those < ``hi``; slot -1 = none,
    never read) of one token's slot list: the stored bytes, not yet decoded (so the next tile can
    be in flight while this one is computed). Returns (valid [BLOCK_N], a, b, c):

    * fp8_ds_mla: a = e4m3 codes [BLOCK_N, 8, 64] u8 (group 7, the rope group, is not read),
      b = ue8m0 bytes [BLOCK_N, 8] (group 7 -> 127, i.e. 1.0), c = the rope dims as bf16 in group 7
      of a [BLOCK_N, 8, 64] tile (groups 0..6 not read; this shape kept the sm_90 build spill-free);
    * bf16 / fp32: a = values [BLOCK_N, BLOCK_D] in the stored dtype; b, c unused.

    ``u8_ptr`` is the cache as bytes, ``typed_ptr`` the same cache viewed as bf16 (bf16 entries and
    the rope dims of fp8_ds_mla) or fp32; ``PAGE_BYTES`` / ``PAGE_ELEMS`` the page stride in bytes /
    in typed elements; ``DATA_ELEMS`` an entry's data part in typed elements (bf16 / fp32).
    """
    idx = start + tl.arange(0, BLOCK_N)
    slots = tl.load(slots_row_ptr + idx, mask=idx < hi, other=-1)
    valid = slots >= 0
    s = tl.where(valid, slots, 0).to(tl.int64)
    page = s // E
    off = s - page * E
    if FMT == 2:  # FMT_FP8_DS_MLA
        g = tl.arange(0, _FP8_NGROUP)
        j = tl.arange(0, _FP8_QBLOCK)
        dims3 = g[None, :, None] * _FP8_QBLOCK + j[None, None, :]
        data_b = page * PAGE_BYTES + off * _FP8_DATA_BYTES
        a = tl.load(
            u8_ptr + data_b[:, None, None] + dims3,
            mask=valid[:, None, None] & (dims3 < _FP8_NOPE),
            other=0,
        )
        scale_b = page * PAGE_BYTES + E * _FP8_DATA_BYTES + off * _FP8_SCALE_BYTES
        b = tl.load(
            u8_ptr + scale_b[:, None] + g[None, :],
            mask=valid[:, None] & (g < _FP8_NGROUP - 1)[None, :],
            other=127,
        )
        rope_e = page * PAGE_ELEMS + off * _FP8_DATA_ELEM + _FP8_ROPE_ELEM
        c = tl.load(
            typed_ptr + rope_e[:, None, None] + (dims3 - _FP8_NOPE),
            mask=valid[:, None, None] & (dims3 >= _FP8_NOPE),
            other=0.0,
        )
    else:  # FMT_BF16 / FMT_FP32
        dims = tl.arange(0, BLOCK_D)
        e_off = page * PAGE_ELEMS + off * DATA_ELEMS
        a = tl.load(
            typed_ptr + e_off[:, None] + dims[None, :],
            mask=valid[:, None] & (dims < D)[None, :],
            other=0.0,
        )
        b = valid
        c = valid
    return valid, a, b, c


@triton.jit
def _dequant_tile(
    a,
    b,
    c,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CVT: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """The raw tile of :func:`_load_raw_tile` -> [BLOCK_N, BLOCK_D] (zeros where not read): fp32,
    or straight to bf16 where the dots take bf16 and no fp32 step is needed (the packed PTX
    decode, bf16 entries): two conversions per element fewer (fp32 -> bf16 and the f16 -> fp32
    step of the hardware cvt)."""
    if FMT == 2:  # e4m3 * 2^(ue8m0 - 127) for dims 0..447, the bf16 rope dims for 448..511
        g = tl.arange(0, _FP8_NGROUP)
        is_rope = (g == _FP8_NGROUP - 1)[None, :, None]
        if DOT_BF16 and CVT == C_CVT_PTX:
            # the power-of-two scale applied in bf16 (exact for every normal product)
            nope = e4m3_bits_to_16bit(a, tl.bfloat16) * ue8m0_to_f32(b).to(tl.bfloat16)[:, :, None]
            kv = tl.reshape(tl.where(is_rope, c, nope), (BLOCK_N, BLOCK_D))
        else:
            nope = _e4m3_to_f32(a, CVT) * ue8m0_to_f32(b)[:, :, None]
            kv = tl.reshape(tl.where(is_rope, c.to(tl.float32), nope), (BLOCK_N, BLOCK_D))
    elif DOT_BF16:  # bf16 entries as stored (of the other formats only bf16 takes bf16 dots)
        kv = a
    else:
        kv = a.to(tl.float32)
    return kv


@triton.jit
def _attend_tile(q, m_i, l_i, acc, kv, valid, qk_scale2, DOT_BF16: tl.constexpr):
    """One online-softmax step of a [BLOCK_H] head block over a [BLOCK_N] candidate tile (K = V)."""
    if DOT_BF16:  # bf16 tensor-core inputs (exact for q and the entries), fp32 accumulation
        kvd = kv.to(tl.bfloat16)
        s = tl.dot(q, tl.trans(kvd))
    else:  # true fp32 products (no tf32)
        kvd = kv
        s = tl.dot(q, tl.trans(kvd), input_precision="ieee")
    s = tl.where(valid[None, :], s * qk_scale2, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_BF16:
        pv = tl.dot(p.to(tl.bfloat16), kvd)
    else:
        pv = tl.dot(p, kvd, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q,
    m_i,
    l_i,
    acc,
    u8_ptr,
    typed_ptr,
    slots_row_ptr,
    lo,
    hi,
    E,
    PAGE_BYTES,
    PAGE_ELEMS,
    end,
    qk_scale2,
    FMT: tl.constexpr,
    D: tl.constexpr,
    DATA_ELEMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CVT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Candidates ``[lo, hi)`` of one token's slot list (one cache) in tiles of BLOCK_N, the
    tiles from ``end`` on (only -1 slots) not visited."""
    if PREFETCH:  # one tile in flight ahead of the compute (register double buffering)
        valid, a, b, c = _load_raw_tile(
            u8_ptr,
            typed_ptr,
            slots_row_ptr,
            lo,
            hi,
            E,
            PAGE_BYTES,
            PAGE_ELEMS,
            FMT,
            D,
            DATA_ELEMS,
            BLOCK_N,
            BLOCK_D,
        )
        for start in range(lo, end, BLOCK_N):
            n_valid, n_a, n_b, n_c = _load_raw_tile(
                u8_ptr,
                typed_ptr,
                slots_row_ptr,
                start + BLOCK_N,
                hi,
                E,
                PAGE_BYTES,
                PAGE_ELEMS,
                FMT,
                D,
                DATA_ELEMS,
                BLOCK_N,
                BLOCK_D,
            )
            kv = _dequant_tile(a, b, c, FMT, BLOCK_N, BLOCK_D, CVT, DOT_BF16)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv, valid, qk_scale2, DOT_BF16)
            valid, a, b, c = n_valid, n_a, n_b, n_c
    else:
        for start in range(lo, end, BLOCK_N):
            valid, a, b, c = _load_raw_tile(
                u8_ptr,
                typed_ptr,
                slots_row_ptr,
                start,
                hi,
                E,
                PAGE_BYTES,
                PAGE_ELEMS,
                FMT,
                D,
                DATA_ELEMS,
                BLOCK_N,
                BLOCK_D,
            )
            kv = _dequant_tile(a, b, c, FMT, BLOCK_N, BLOCK_D, CVT, DOT_BF16)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv, valid, qk_scale2, DOT_BF16)
    return m_i, l_i, acc


@triton.jit
def _tile_source(
    start, hi, W, w_u8, w_typed, w_row, w_E, w_PB, w_PE, c_u8, c_typed, c_row, c_E, c_PB, c_PE
):
    """Where the tile at candidate ``start`` (of a range ending at ``hi``) lies: the window's cache and slot
    row below ``W``, the compressed one from ``W`` on (scalar selects; no tile straddles ``W``).
    Returns (bytes, typed view, slot row, first and end index in that row, E, page bytes, page
    elements)."""
    in_w = start < W
    return (
        tl.where(in_w, w_u8, c_u8),
        tl.where(in_w, w_typed, c_typed),
        tl.where(in_w, w_row, c_row),
        tl.where(in_w, start, start - W),
        tl.where(in_w, tl.minimum(hi, W), hi - W),
        tl.where(in_w, w_E, c_E),
        tl.where(in_w, w_PB, c_PB),
        tl.where(in_w, w_PE, c_PE),
    )


@triton.jit
def _attend_candidates(
    q,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    end,
    W,
    w_u8,
    w_typed,
    w_row,
    w_E,
    w_PB,
    w_PE,
    c_u8,
    c_typed,
    c_row,
    c_E,
    c_PB,
    c_PE,
    qk_scale2,
    FMT: tl.constexpr,
    D: tl.constexpr,
    DATA_ELEMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CVT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Candidates ``[lo, hi)`` of the window (``[0, W)``) and then the compressed list in one
    loop of BLOCK_N tiles (``W`` and ``lo`` multiples of BLOCK_N), up to ``end`` (the tiles from
    there on hold only -1 slots). One loop, not one per cache:
    the sm_90 build of the 64-head tile spilled its second loop's state (85 reloads per tile),
    the single loop is spill-free, and Triton's pipeliner can keep its loads in flight."""
    if PREFETCH:  # one tile in flight ahead of the compute (register double buffering)
        u8, ty, row, i0, i1, E, PB, PE = _tile_source(
            lo, hi, W, w_u8, w_typed, w_row, w_E, w_PB, w_PE, c_u8, c_typed, c_row, c_E, c_PB, c_PE
        )
        valid, a, b, c = _load_raw_tile(
            u8, ty, row, i0, i1, E, PB, PE, FMT, D, DATA_ELEMS, BLOCK_N, BLOCK_D
        )
        for start in range(lo, end, BLOCK_N):
            u8, ty, row, i0, i1, E, PB, PE = _tile_source(
                start + BLOCK_N,
                hi,
                W,
                w_u8,
                w_typed,
                w_row,
                w_E,
                w_PB,
                w_PE,
                c_u8,
                c_typed,
                c_row,
                c_E,
                c_PB,
                c_PE,
            )
            n_valid, n_a, n_b, n_c = _load_raw_tile(
                u8, ty, row, i0, i1, E, PB, PE, FMT, D, DATA_ELEMS, BLOCK_N, BLOCK_D
            )
            kv = _dequant_tile(a, b, c, FMT, BLOCK_N, BLOCK_D, CVT, DOT_BF16)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv, valid, qk_scale2, DOT_BF16)
            valid, a, b, c = n_valid, n_a, n_b, n_c
    else:
        for start in range(lo, end, BLOCK_N):
            u8, ty, row, i0, i1, E, PB, PE = _tile_source(
                start,
                hi,
                W,
                w_u8,
                w_typed,
                w_row,
                w_E,
                w_PB,
                w_PE,
                c_u8,
                c_typed,
                c_row,
                c_E,
                c_PB,
                c_PE,
            )
            valid, a, b, c = _load_raw_tile(
                u8, ty, row, i0, i1, E, PB, PE, FMT, D, DATA_ELEMS, BLOCK_N, BLOCK_D
            )
            kv = _dequant_tile(a, b, c, FMT, BLOCK_N, BLOCK_D, CVT, DOT_BF16)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv, valid, qk_scale2, DOT_BF16)
    return m_i, l_i, acc


@triton.jit
def _store_rows(ptrs, x, mask, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:  # the interpreter truncates fp32 -> bf16: round to nearest even first
        x = round_to_bf16(x)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)
