# SPDX-License-Identifier: Apache-2.0
"""Triton ``kv_insert`` / ``kv_gather``: quantize rows into, and dequantize rows out of, a paged cache,
one program per row.

Every entry format of ``kv_cache.formats`` is supported (fp32, bf16, fp8_ds_mla, fp8_indexer, mxfp4)
with the bit-level codecs of ``quant.py``; the bytes written are identical to the reference codecs'.
Caches whose base or page stride is not 4-byte aligned (never the case for real page sizes, but
allowed by the format contract) take a bytewise path for their 2- and 4-byte fields.
The host helpers here (:func:`entry_layout`, :func:`check_insert_args`, :func:`cache_aligned`) and
:func:`insert_entry` are shared with the fused ``qnorm_rope_kv_insert`` kernel.

Triton ``entry_slots``: the indexer's selected entry indices [T, K] to paged-cache slots in one
launch (the torch form is ~14 elementwise / gather launches per c4a layer at decode, on the
indexer branch's critical path). Program = one token row x ``BLOCK`` indices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.api import KV_GATHER, KV_INSERT
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import (
    FMT_BF16,
    FMT_FP8_DS_MLA,
    FMT_FP8_INDEXER,
    FMT_FP32,
    FMT_MXFP4,
    bf16_bits_to_f32,
    ceil_log2_div,
    e4m3_bits_to_f32,
    entry_offsets,
    f32_to_bf16_bits,
    f32_to_e4m3_bits,
    format_code,
    fp8_ds_mla_quantize_pairs,
    load_f32_bytewise,
    mxfp4_dequant,
    mxfp4_quantize_pairs,
    pow2_f32,
    round_to_bf16,
    store_bytes_u32,
    ue8m0_to_f32,
)
from vllm_dsv4_hw.ops.triton.common.rows import grid_1d


# -- host helpers ---------------------------------------------------------------------------------
def entry_layout(fmt) -> tuple[int, int, int]:
    """(FMT code, NB, BP): the [NB, BP] pair tile of one entry (a tile row = one quant block)."""
    code = format_code(fmt)
    dim = fmt.dim
    npairs = dim // 2
    if dim % 2 or next_pow2(npairs) != npairs:
        raise ValueError(f"{fmt.name}: triton kernels need a power-of-two entry dim, got {dim}")
    if code == FMT_FP8_DS_MLA:
        return code, 8, 32
    if code == FMT_FP8_INDEXER:
        return code, 1, npairs
    if code == FMT_MXFP4:
        if dim < 32:
            raise ValueError(f"{fmt.name}: triton kernels need dim >= 32, got {dim}")
        return code, dim // 32, 16
    assert code in (FMT_BF16, FMT_FP32)
    bp = min(32, npairs)
    return code, npairs // bp, bp


def cache_aligned(cache: torch.Tensor) -> bool:
    """True when 2- / 4-byte fields can be accessed through wide pointers (base and pages 4-aligned)."""
    return cache.data_ptr() % 4 == 0 and (cache.shape[0] <= 1 or cache.stride(0) % 4 == 0)


def _check_slot_values(slots: torch.Tensor, cache: torch.Tensor, fmt) -> None:
    # Host-side range check only for CPU tensors: on accelerators it would synchronize every step;
    # the kernels skip any slot outside [0, capacity) instead of writing out of bounds.
    if slots.device.type == "cpu" and slots.numel():
        capacity = cache.shape[0] * fmt.entries_per_page
        bad = (slots < -1) | (slots >= capacity)
        if bool(bad.any()):
            raise ValueError(
                f"{fmt.name}: slots must be -1 or in [0, {capacity}) ({cache.shape[0]} "
                f"pages x {fmt.entries_per_page}); got e.g. {int(slots[bad][0])}"
            )


def _check_cache_and_slots(cache: torch.Tensor, slots, fmt) -> torch.Tensor:
    fmt.page_views(cache)  # layout checks (uint8, 2-D, page size)
    if cache.shape[0] and cache.stride(1) != 1:
        raise ValueError(f"{fmt.name}: cache pages must be contiguous (stride {cache.stride()})")
    if (
        not isinstance(slots, torch.Tensor)
        or slots.is_floating_point()
        or slots.is_complex()
        or slots.dtype == torch.bool
    ):
        raise ValueError(
            f"{fmt.name}: slots must be an integer tensor, got "
            f"{getattr(slots, 'dtype', type(slots).__name__)}"
        )
    return slots.to(cache.device)


def check_insert_args(cache: torch.Tensor, slots, n: int, fmt) -> torch.Tensor:
    """Validate cache / slots for ``n`` rows; return the slots on the cache's device."""
    slots = _check_cache_and_slots(cache, slots, fmt)
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(
            f"{fmt.name}: slots must be [N] with N = {n} rows, got {tuple(slots.shape)}"
        )
    _check_slot_values(slots, cache, fmt)
    return slots


# -- device helpers -------------------------------------------------------------------------------
# Format codes as constexpr globals (compiled Triton rejects plain-int globals inside kernels).
_FP32 = tl.constexpr(FMT_FP32)
_BF16 = tl.constexpr(FMT_BF16)
_FP8_DS_MLA = tl.constexpr(FMT_FP8_DS_MLA)
_FP8_INDEXER = tl.constexpr(FMT_FP8_INDEXER)
_MXFP4 = tl.constexpr(FMT_MXFP4)


@triton.jit
def _store_bf16(cache_ptr, off, x, mask, ALIGNED: tl.constexpr):
    """fp32 ``x`` -> bf16 (nearest even) at byte offsets ``off`` (2-byte aligned when ALIGNED)."""
    bits = f32_to_bf16_bits(x)
    if ALIGNED:
        tl.store((cache_ptr + off).to(tl.pointer_type(tl.uint16)), bits, mask=mask)
    else:
        b = bits.to(tl.uint32)
        tl.store(cache_ptr + off, (b & 0xFF).to(tl.uint8), mask=mask)
        tl.store(cache_ptr + off + 1, ((b >> 8) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_bf16(cache_ptr, off, mask, ALIGNED: tl.constexpr):
    if ALIGNED:
        u = tl.load((cache_ptr + off).to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
    else:
        lo = tl.load(cache_ptr + off, mask=mask, other=0).to(tl.uint32)
        hi = tl.load(cache_ptr + off + 1, mask=mask, other=0).to(tl.uint32)
        u = lo | (hi << 8)
    return bf16_bits_to_f32(u)


@triton.jit
def store_entry(
    cache_ptr, data_off, scale_off, xe, xo, pidx, blk, ok, FMT: tl.constexpr, ALIGNED: tl.constexpr
):
    """Quantize one entry held as fp32 pairs and write its data and scale parts.

    ``xe`` / ``xo`` [NB, BP] are dims 2j / 2j+1, j = ``pidx`` = blk * BP + p; a tile row is one
    quantization block (fp8_ds_mla: BP 32, NB 8; mxfp4: BP 16; fp8_indexer: NB 1). ``ok`` is a
    scalar bool (slot valid). Bit-exact with the PyTorch codecs of ``kv_cache.formats`` (same
    math as ``quant.store_entry_pairs``; bf16 / fp32 fields bytewise unless ALIGNED)."""
    de = 2 * pidx  # even dim of every pair
    oki = ok.to(tl.int32)
    mask = (pidx * 0 + oki) != 0  # (vector masks by comparison: see quant.store_entry_pairs)
    bmask = (blk * 0 + oki) != 0
    if FMT == _FP32:
        if ALIGNED:
            tl.store((cache_ptr + data_off + 4 * de).to(tl.pointer_type(tl.float32)), xe, mask=mask)
            tl.store(
                (cache_ptr + data_off + 4 * de + 4).to(tl.pointer_type(tl.float32)), xo, mask=mask
            )
        else:
            store_bytes_u32(cache_ptr, data_off + 4 * de, xe.to(tl.uint32, bitcast=True), mask)
            store_bytes_u32(cache_ptr, data_off + 4 * de + 4, xo.to(tl.uint32, bitcast=True), mask)
    elif FMT == _BF16:
        _store_bf16(cache_ptr, data_off + 2 * de, xe, mask, ALIGNED)
        _store_bf16(cache_ptr, data_off + 2 * de + 2, xo, mask, ALIGNED)
    elif FMT == _FP8_DS_MLA:
        ce, co, ex, xe_b, xo_b = fp8_ds_mla_quantize_pairs(xe, xo)
        nope = de < 448
        tl.store(cache_ptr + data_off + de, ce, mask=mask & nope)
        tl.store(cache_ptr + data_off + de + 1, co, mask=mask & nope)
        rope_off = data_off + 448 + 2 * (de - 448)
        rope = de >= 448
        _store_bf16(cache_ptr, rope_off, xe_b, mask & rope, ALIGNED)
        _store_bf16(cache_ptr, rope_off + 2, xo_b, mask & rope, ALIGNED)
        # 7 ue8m0 bytes; row 7 is the bf16 rope block: its byte is the zero pad
        tl.store(
            cache_ptr + scale_off + blk, tl.where(blk < 7, ex + 127, 0).to(tl.uint8), mask=bmask
        )
    elif FMT == _FP8_INDEXER:
        xe = round_to_bf16(xe)
        xo = round_to_bf16(xo)
        amax = tl.maximum(
            tl.max(tl.max(tl.abs(xe), axis=1), axis=0), tl.max(tl.max(tl.abs(xo), axis=1), axis=0)
        )
        ex = ceil_log2_div(tl.maximum(amax, 1e-4), 0x600000, 8)
        inv = pow2_f32(-ex)
        tl.store(cache_ptr + data_off + de, f32_to_e4m3_bits(xe * inv), mask=mask)
        tl.store(cache_ptr + data_off + de + 1, f32_to_e4m3_bits(xo * inv), mask=mask)
        store_bytes_u32(cache_ptr, scale_off, pow2_f32(ex).to(tl.uint32, bitcast=True), ok)
    else:  # MXFP4: e2m1 pairs (2j low nibble) + one ue8m0 byte per 32-dim block
        byte, ex = mxfp4_quantize_pairs(xe, xo)
        tl.store(cache_ptr + data_off + pidx, byte, mask=mask)
        tl.store(cache_ptr + scale_off + blk, (ex + 127).to(tl.uint8), mask=bmask)


@triton.jit
def load_entry(cache_ptr, data_off, scale_off, d, mask, FMT: tl.constexpr, ALIGNED: tl.constexpr):
    """Dims ``d`` of the entries at ``data_off`` / ``scale_off`` -> fp32 (masked lanes: 0)."""
    if FMT == _FP32:
        if ALIGNED:
            v = tl.load(
                (cache_ptr + data_off + 4 * d).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0
            )
        else:
            v = load_f32_bytewise(cache_ptr, data_off + 4 * d, mask)
    elif FMT == _BF16:
        v = _load_bf16(cache_ptr, data_off + 2 * d, mask, ALIGNED)
    elif FMT == _FP8_DS_MLA:
        nope = d < 448
        code = tl.load(cache_ptr + data_off + d, mask=mask & nope, other=0)
        sb = tl.load(cache_ptr + scale_off + d // 64, mask=mask & nope, other=127)
        rope = _load_bf16(cache_ptr, data_off + 448 + 2 * (d - 448), mask & (d >= 448), ALIGNED)
        v = tl.where(nope, e4m3_bits_to_f32(code) * ue8m0_to_f32(sb), rope)
    elif FMT == _FP8_INDEXER:
        code = tl.load(cache_ptr + data_off + d, mask=mask, other=0)
        v = e4m3_bits_to_f32(code) * load_f32_bytewise(cache_ptr, scale_off + d * 0, mask)
    else:
        v = mxfp4_dequant(cache_ptr, data_off, scale_off, d, mask)
    return v


@triton.jit
def insert_entry(
    cache_ptr,
    slot,
    capacity,
    E,
    page_stride,
    xe,
    xo,
    pidx,
    blk,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Write one entry held as fp32 pairs [NB, BP] at ``slot`` (skipped unless 0 <= slot < cap)."""
    valid = (slot >= 0) & (slot < capacity)
    data_off, scale_off = entry_offsets(
        tl.where(valid, slot, 0), E, page_stride, DATA_BYTES, SCALE_BYTES
    )
    store_entry(cache_ptr, data_off, scale_off, xe, xo, pidx, blk, valid, FMT, ALIGNED)


@triton.jit
def _kv_insert_kernel(
    cache_ptr,
    slots_ptr,
    x_ptr,
    n_rows,
    x_stride,
    page_stride,
    capacity,
    E,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    NB: tl.constexpr,
    BP: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    blk = tl.arange(0, NB)
    pidx = blk[:, None] * BP + tl.arange(0, BP)[None, :]
    for row in range(pid, n_rows, nprog):
        r = tl.cast(row, tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        if slot >= 0:
            src = x_ptr + r * x_stride
            xe = tl.load(src + 2 * pidx).to(tl.float32)
            xo = tl.load(src + 2 * pidx + 1).to(tl.float32)
            insert_entry(
                cache_ptr,
                slot,
                capacity,
                E,
                page_stride,
                xe,
                xo,
                pidx,
                blk,
                DATA_BYTES,
                SCALE_BYTES,
                FMT,
                ALIGNED,
            )


@triton.jit
def _kv_gather_kernel(
    cache_ptr,
    slots_ptr,
    out_ptr,
    n_rows,
    page_stride,
    capacity,
    E,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    dm = d < DIM
    for row in range(pid, n_rows, nprog):
        r = tl.cast(row, tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        valid = (slot >= 0) & (slot < capacity)
        data_off, scale_off = entry_offsets(
            tl.where(valid, slot, 0), E, page_stride, DATA_BYTES, SCALE_BYTES
        )
        m = dm & ((d * 0 + valid.to(tl.int32)) != 0)
        v = load_entry(cache_ptr, data_off, scale_off, d, m, FMT, ALIGNED)
        tl.store(out_ptr + r * DIM + d, tl.where(m, v, 0.0), mask=dm)


# -- ops ------------------------------------------------------------------------------------------
@register_op(KV_INSERT, "triton")
def kv_insert(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[-1] != fmt.dim:
        raise ValueError(
            f"{fmt.name}: x must be [N, {fmt.dim}], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if not x.is_floating_point():
        raise ValueError(f"{fmt.name}: x must be a floating-point tensor, got {x.dtype}")
    code, nb, bp = entry_layout(fmt)
    slots = check_insert_args(cache, slots, x.shape[0], fmt)
    n = x.shape[0]
    if n == 0 or cache.shape[0] == 0:
        return
    x = x.to(cache.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    _kv_insert_kernel[grid_1d(n, cache.device)](
        cache,
        slots,
        x,
        n,
        x.stride(0),
        cache.stride(0),
        cache.shape[0] * fmt.entries_per_page,
        fmt.entries_per_page,
        DATA_BYTES=fmt.data_bytes,
        SCALE_BYTES=fmt.scale_bytes,
        NB=nb,
        BP=bp,
        FMT=code,
        ALIGNED=cache_aligned(cache),
        num_warps=4 if fmt.dim >= 512 else 2,
        **pdl_launch(cache.device),
    )


@register_op(KV_GATHER, "triton")
def kv_gather(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    code = format_code(fmt)
    slots = _check_cache_and_slots(cache, slots, fmt)
    _check_slot_values(slots, cache, fmt)
    out = torch.empty(*slots.shape, fmt.dim, dtype=torch.float32, device=cache.device)
    n = slots.numel()
    if n == 0:
        return out
    if cache.shape[0] == 0:
        return out.zero_()
    flat = slots.reshape(-1)
    _kv_gather_kernel[grid_1d(n, cache.device)](
        cache,
        flat,
        out,
        n,
        cache.stride(0),
        cache.shape[0] * fmt.entries_per_page,
        fmt.entries_per_page,
        DIM=fmt.dim,
        BLOCK_D=next_pow2(fmt.dim),
        DATA_BYTES=fmt.data_bytes,
        SCALE_BYTES=fmt.scale_bytes,
        FMT=code,
        ALIGNED=cache_aligned(cache),
        num_warps=4 if fmt.dim >= 512 else 2,
        **pdl_launch(cache.device),
    )
    return out


@triton.jit
def _entry_slots_kernel(
    bt_ptr,
    req_ptr,
    idx_ptr,
    out_ptr,
    k,
    n_cols,
    stride_bt,
    stride_idx,
    stride_out,
    PER_PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    i = tl.load(idx_ptr + t * stride_idx + offs, mask=m, other=-1).to(tl.int64)
    col = i // PER_PAGE
    ok = (i >= 0) & (col < n_cols)
    req = tl.load(req_ptr + t).to(tl.int64)
    page = tl.load(bt_ptr + req * stride_bt + col, mask=m & ok, other=-1).to(tl.int64)
    slot = tl.where(ok & (page >= 0), page * PER_PAGE + i % PER_PAGE, -1)
    tl.store(out_ptr + t * stride_out + offs, slot, mask=m)


@register_op(api.ENTRY_SLOTS, "triton")
def entry_slots(
    block_table: torch.Tensor, token_req: torch.Tensor, idx: torch.Tensor, per_page: int
) -> torch.Tensor:
    t, k = idx.shape
    dev = idx.device
    out = torch.empty(t, k, dtype=torch.int64, device=dev)
    if t == 0 or k == 0:
        return out
    bt = block_table if block_table.device == dev else block_table.to(dev)
    bt = bt if bt.stride(-1) == 1 else bt.contiguous()
    req = token_req if token_req.device == dev else token_req.to(dev)
    block = min(1024, next_pow2(k))
    _entry_slots_kernel[(t, cdiv(k, block))](
        bt,
        req,
        idx,
        out,
        k,
        bt.shape[1],
        bt.stride(0),
        idx.stride(0),
        out.stride(0),
        PER_PAGE=per_page,
        BLOCK=block,
        num_warps=4,
        **pdl_launch(dev),
    )
    return out
