# SPDX-License-Identifier: Apache-2.0
"""Triton compressor: ``compressor_store`` (and ``compressor_pool``) of ``ops.api`` (spec section 3).

Two launches, because rows written by this step are read by groups of the same step (the op gets
member rows as state slots only, so a group cannot locate its new rows in the kv / score inputs):

1. ``_write_rows_kernel`` (1-D grid over tokens): ``state[slot] = [kv | score + ape[pos % ratio]]``
   in fp32 (slot -1 skipped).
2. ``_pool_kernel`` (1-D grid over completed groups): a program pools its group's ``coff*ratio``
   member rows with a per-channel online softmax over rows (``BLOCK_R`` rows per iteration; absent
   rows: kv 0, score -inf); then, for ``compressor_store``, RMSNorm_w, GPT-J RoPE on the last R dims
   (R = cos_sin width, 64 in the model) at position ``ratio * entry_index``, and quantize + paged
   insert with the entry format (constexpr ``FMT``: fp32 / bf16 / fp8_ds_mla main entries, bf16 /
   fp8 / mxfp4 indexer keys: ``quant.store_entry_pairs``); for ``compressor_pool`` it writes the
   pooled fp32 vector instead.

Inside the pool kernel an entry is kept as *pairs*: ``xe`` / ``xo`` [NB, BP] hold dims 2j and 2j+1
(pair j = row * BP + column), loaded from the state as one 8-byte word per pair. RoPE then needs no
shuffles (it rotates (xe, xo) pair-wise), MXFP4 packs (xe, xo) into one byte, and each tile row of
BP pairs is one quantization block of the format. All math is fp32; dtype-specific code lives in
``quant.py``; no inline PTX, 1-D grids.

On GPUs a program takes one group (one token for the row writes); under the Triton interpreter,
where every op costs Python overhead whatever the tile size, programs take up to 64 groups (256
tokens) at once: tile rows are then (group, block) pairs, which the same code handles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common import quant
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2, program_cap
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import entry_offsets, store_entry_pairs

_OUT_CACHE = 0  # compressor_store: norm + rope + quantize + insert
_OUT_POOLED = 1  # compressor_pool: write the pooled fp32 vector


@triton.jit
def _write_rows_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    ape_ptr,
    state_ptr,
    slot_ptr,
    n_tokens,
    n_blocks,
    stride_kv,
    stride_score,
    stride_ape,
    stride_state,
    WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """BT tokens per program: state[slot, :WIDTH] = kv, state[slot, WIDTH:] = score + ape[pos % R]
    (slot -1 skipped)."""
    pdl_start(PDL)
    for blk_t in range(tl.program_id(0), n_blocks, tl.num_programs(0)):  # grid-stride
        t = blk_t * BT + tl.arange(0, BT)  # [BT]
        tv = t < n_tokens
        slot = tl.load(slot_ptr + t, mask=tv, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + t, mask=tv, other=0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = (c[None, :] < WIDTH) & (slot >= 0)[:, None]  # [BT, BLOCK]
        t64 = t.to(tl.int64)[:, None]
        kv = tl.load(kv_ptr + t64 * stride_kv + c[None, :], mask=m, other=0.0).to(tl.float32)
        sc = tl.load(score_ptr + t64 * stride_score + c[None, :], mask=m, other=0.0).to(tl.float32)
        ape = tl.load(
            ape_ptr + (pos % RATIO)[:, None] * stride_ape + c[None, :], mask=m, other=0.0
        ).to(tl.float32)
        row = state_ptr + slot[:, None] * stride_state + c[None, :]
        tl.store(row, kv, mask=m)
        tl.store(row + WIDTH, sc + ape, mask=m)


@triton.jit
def _f32_pair(u):
    """uint64 holding two little-endian fp32 (dims 2j, 2j+1) -> (even, odd) fp32."""
    lo = (u & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    hi = (u >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _pool_kernel(
    state_ptr,
    rows_ptr,
    n_groups,
    n_gblocks,
    stride_state_pairs,
    stride_rows,
    # compressor_store only:
    w_ptr,
    eps,
    cos_sin_ptr,
    stride_cs,
    entry_ptr,
    cache_ptr,
    cache_slot_ptr,
    page_stride,
    # compressor_pool only:
    out_ptr,
    stride_out,
    D: tl.constexpr,
    RATIO: tl.constexpr,
    COFF: tl.constexpr,
    NB: tl.constexpr,
    BP: tl.constexpr,
    GB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    E: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    OUT: tl.constexpr,
    ROPE: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """GB groups per program (1 on GPUs; more under the interpreter, where per-op overhead
    dominates). Tile rows q = (group, block): QR = GB * NB rows of BP pairs; W = COFF * RATIO
    member rows per group."""
    pdl_start(PDL)
    for gblk in range(tl.program_id(0), n_gblocks, tl.num_programs(0)):  # grid-stride
        if SKIP_EMPTY:
            # one group per program, stored to the cache: a group without a cache slot (a decode
            # token that completes no entry; graph-safe metadata carries one such group per token)
            # stores nothing, so its member rows are not read at all
            n_rows = tl.where(tl.load(cache_slot_ptr + gblk) >= 0, COFF * RATIO, 0)
        else:
            n_rows = COFF * RATIO
        q = tl.arange(0, GB * NB)
        gi = gblk * GB + q // NB  # [QR] group of each tile row
        gv = gi < n_groups
        g64 = tl.minimum(gi, n_groups - 1).to(tl.int64)
        blk = q % NB  # [QR] block of the row in its entry
        p = tl.arange(0, BP)
        pidx = blk[:, None] * BP + p[None, :]  # [QR, BP] pair index within the entry
        pidx3 = pidx[None, :, :]  # [1, QR, BP]

        m_e = tl.full([GB * NB, BP], float("-inf"), tl.float32)
        m_o = tl.full([GB * NB, BP], float("-inf"), tl.float32)
        l_e = tl.zeros([GB * NB, BP], tl.float32)
        l_o = tl.zeros([GB * NB, BP], tl.float32)
        a_e = tl.zeros([GB * NB, BP], tl.float32)
        a_o = tl.zeros([GB * NB, BP], tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R] member rows, oldest first
            slot = tl.load(
                rows_ptr + g64[None, :] * stride_rows + r[:, None],
                mask=(r[:, None] < COFF * RATIO) & gv[None, :],
                other=-1,
            )  # [BLOCK_R, QR]
            present = (slot >= 0)[:, :, None]
            # (even, odd) channel pairs as one 8-byte load each: offsets in pairs of fp32
            row = (
                state_ptr.to(tl.pointer_type(tl.uint64))
                + slot.to(tl.int64)[:, :, None] * stride_state_pairs
            )
            # member row j reads channel block j // RATIO (c4a: previous group -> [0, D),
            # own -> [D, 2D)); col: [BLOCK_R, QR, BP] offsets in fp32 pairs
            col = ((r // RATIO) * (D // 2))[:, None, None] + pidx3
            kv_e, kv_o = _f32_pair(tl.load(row + col, mask=present, other=0))
            sc_e, sc_o = _f32_pair(tl.load(row + (COFF * D // 2) + col, mask=present, other=0))
            sc_e = tl.where(present, sc_e, float("-inf"))
            sc_o = tl.where(present, sc_o, float("-inf"))
            # online softmax over rows, per channel (a chunk may be all-absent: keep -inf safe)
            n_e = tl.maximum(m_e, tl.max(sc_e, axis=0))
            n_o = tl.maximum(m_o, tl.max(sc_o, axis=0))
            s_e = tl.where(n_e == float("-inf"), 0.0, n_e)
            s_o = tl.where(n_o == float("-inf"), 0.0, n_o)
            al_e = tl.exp(m_e - s_e)
            al_o = tl.exp(m_o - s_o)
            p_e = tl.exp(sc_e - s_e[None, :, :])
            p_o = tl.exp(sc_o - s_o[None, :, :])
            l_e = l_e * al_e + tl.sum(p_e, axis=0)
            l_o = l_o * al_o + tl.sum(p_o, axis=0)
            a_e = a_e * al_e + tl.sum(p_e * kv_e, axis=0)
            a_o = a_o * al_o + tl.sum(p_o * kv_o, axis=0)
            m_e = n_e
            m_o = n_o
        xe = a_e / tl.where(l_e == 0.0, 1.0, l_e)  # l == 0 only in rows of groups past n_groups
        xo = a_o / tl.where(l_o == 0.0, 1.0, l_o)

        if OUT == 1:
            orow = out_ptr + g64[:, None] * stride_out + 2 * pidx
            om = gv[:, None] & (pidx >= 0)
            tl.store(orow, xe, mask=om)
            tl.store(orow + 1, xo, mask=om)
        else:
            # RMSNorm with weight (fp32): sum of squares per row, then per group (rows of one group)
            ss_row = tl.sum(xe * xe + xo * xo, axis=1)  # [QR]
            ss_g = tl.sum(tl.reshape(ss_row, [GB, NB]), axis=1)  # [GB]
            ss = tl.reshape(tl.broadcast_to(ss_g[:, None], [GB, NB]), [GB * NB])  # [QR]
            rstd = (1.0 / tl.sqrt(ss / D + eps))[:, None]
            xe = xe * rstd * tl.load(w_ptr + 2 * pidx).to(tl.float32)
            xo = xo * rstd * tl.load(w_ptr + 2 * pidx + 1).to(tl.float32)
            # GPT-J RoPE on the last ROPE dims at position RATIO * entry_index: pair j of the
            # rope part rotates by angle j (cos_sin row: ROPE/2 cos, then ROPE/2 sin)
            rpos = tl.load(entry_ptr + g64).to(tl.int64) * RATIO  # [QR]
            j = pidx - (D - ROPE) // 2
            in_rope = (j >= 0) & gv[:, None]
            cs_row = cos_sin_ptr + rpos[:, None] * stride_cs
            cos = tl.load(cs_row + j, mask=in_rope, other=1.0)
            sin = tl.load(cs_row + ROPE // 2 + j, mask=in_rope, other=0.0)
            re = xe * cos - xo * sin
            ro = xe * sin + xo * cos
            xe = tl.where(in_rope, re, xe)
            xo = tl.where(in_rope, ro, xo)
            # quantize + insert (one entry per group; its rows carry their own offsets)
            cslot = tl.load(cache_slot_ptr + g64).to(tl.int64)  # [QR]
            ok = (cslot >= 0) & gv
            data_off, scale_off = entry_offsets(
                tl.maximum(cslot, 0), E, page_stride, DATA_BYTES, SCALE_BYTES
            )
            store_entry_pairs(cache_ptr, data_off[:, None], scale_off, xe, xo, pidx, blk, ok, FMT)


def _layout(fmt_code: int, d: int) -> tuple[int, int]:
    """(NB, BP): rows of pairs = quantization blocks of the format."""
    if fmt_code == quant.FMT_FP8_DS_MLA:
        return d // 64, 32
    if fmt_code == quant.FMT_MXFP4:
        return d // 32, 16
    if fmt_code == quant.FMT_FP8_INDEXER:
        return 1, d // 2
    half = max(1, d // 2)
    bp = min(32, half)
    return half // bp, bp


def _check_inputs(kv, score, positions, ape, state, state_slots, group_rows, ratio):
    kind = kind_of(ratio)
    coff = kind.coff
    if kv.dim() != 2 or kv.shape[-1] % coff:
        raise ValueError(f"kv must be [T, coff*d] with coff={coff}, got {tuple(kv.shape)}")
    d = kv.shape[-1] // coff
    if d & (d - 1) or d < 2:
        raise ValueError(f"triton compressor needs an even power-of-two d, got {d}")
    if score.shape != kv.shape:
        raise ValueError(f"score {tuple(score.shape)} must match kv {tuple(kv.shape)}")
    if ape.shape != (ratio, coff * d):
        raise ValueError(f"ape must be [{ratio}, {coff * d}], got {tuple(ape.shape)}")
    width = kind.state_width(d)
    if state.dtype != torch.float32 or state.dim() != 2 or state.shape[-1] != width:
        raise ValueError(f"state must be fp32 [S, {width}], got {state.dtype} {tuple(state.shape)}")
    if state.stride(-1) != 1 or state.stride(0) % 2 or state.data_ptr() % 8:
        raise ValueError(
            "triton compressor: state rows must be contiguous, 8-byte aligned, with an "
            "even row stride"
        )
    if group_rows.dim() != 2 or group_rows.shape[1] != kind.group_width:
        raise ValueError(
            f"group_rows must be [G, {kind.group_width}] for ratio {ratio}, got "
            f"{tuple(group_rows.shape)}"
        )
    return coff, d


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _write_rows(kv, score, positions, ape, state, state_slots, ratio, coff, d):
    n = kv.shape[0]
    if n == 0:
        return
    dev = kv.device
    kv, score, ape = _contig(kv), _contig(score), _contig(ape)
    slots = state_slots.to(device=dev, dtype=torch.int64).contiguous()
    pos = positions.to(device=dev, dtype=torch.int64).contiguous()
    width = coff * d
    bt = _INTERP_TOKENS if _interpreted(dev) else 1
    nblk = cdiv(n, bt)
    _write_rows_kernel[(_grid(nblk, dev),)](
        kv,
        score,
        pos,
        ape,
        state,
        slots,
        n,
        nblk,
        kv.stride(0),
        score.stride(0),
        ape.stride(0),
        state.stride(0),
        WIDTH=width,
        RATIO=ratio,
        BLOCK=next_pow2(width),
        BT=bt,
        num_warps=4,
        **pdl_launch(dev),
    )


def _grid(n: int, device: torch.device) -> int:
    """Programs for ``n`` blocks (the kernels are grid-strided): capped by the device's declared
    grid bound (``launch.program_cap``)."""
    return max(1, min(n, program_cap(device)))


def _interpreted(device: torch.device) -> bool:
    return device.type == "cpu"  # the Triton interpreter (TRITON_INTERPRET=1)


# Under the interpreter every op costs ~0.1 ms of Python whatever the tile size, so programs take
# many groups / tokens at once (on GPUs: one group / token per program for parallelism).
_INTERP_GROUPS = 64
_INTERP_TOKENS = 256


def _block_r(ratio: int, d: int, gb: int) -> int:
    # member rows per iteration: 4 tiles of [BLOCK_R, GB * d/2] fp32 live at once
    w = kind_of(ratio).group_width
    budget = POOL_CONFIG["row_budget"] if gb == 1 else 1 << 18
    return max(1, min(w, budget // (gb * d)))


# GPU launch knobs of the pool kernel (benchmarks/decode_kernels.py sweeps them): member-row
# elements per iteration (BLOCK_R = row_budget // d) and warps for d >= 512 / smaller d.
# A small row budget pools a completed group fastest at decode; small d is insensitive
# (evidence: docs/tuning.md, Compressor pool launch).
POOL_CONFIG = {"row_budget": 1024, "warps_large": 8, "warps_small": 4}


def _launch_pool(
    state,
    group_rows,
    ratio,
    coff,
    d,
    fmt_code,
    out_mode,
    *,
    norm_weight=None,
    eps=0.0,
    cos_sin=None,
    entry_index=None,
    cache=None,
    cache_slots=None,
    fmt=None,
    out=None,
):
    g = group_rows.shape[0]
    dev = state.device
    rows = group_rows.to(device=dev, dtype=torch.int64).contiguous()
    nb, bp = _layout(fmt_code, d)
    dummy_f = state
    if out_mode == _OUT_CACHE:
        e, data_bytes, scale_bytes = fmt.entries_per_page, fmt.data_bytes, fmt.scale_bytes
        w = _contig(norm_weight.to(dev))
        cs = _contig(cos_sin.to(device=dev, dtype=torch.float32))
        ent = entry_index.to(device=dev, dtype=torch.int64).contiguous()
        cslots = cache_slots.to(device=dev, dtype=torch.int64).contiguous()
        rope_dim = cs.shape[1]
        args = (w, float(eps), cs, cs.stride(0), ent, cache, cslots, cache.stride(0), dummy_f, 0)
    else:
        e, data_bytes, scale_bytes = 1, 0, 0
        rope_dim = 0
        args = (dummy_f, 0.0, dummy_f, 0, rows, state, rows, 0, out, out.stride(0))
    gb = min(_INTERP_GROUPS, next_pow2(g)) if _interpreted(dev) else 1
    ngb = cdiv(g, gb)
    _pool_kernel[(_grid(ngb, dev),)](
        state,
        rows,
        g,
        ngb,
        state.stride(0) // 2,
        rows.stride(0),
        *args,
        D=d,
        RATIO=ratio,
        COFF=coff,
        NB=nb,
        BP=bp,
        GB=gb,
        BLOCK_R=_block_r(ratio, d, gb),
        E=e,
        DATA_BYTES=data_bytes,
        SCALE_BYTES=scale_bytes,
        FMT=fmt_code,
        OUT=out_mode,
        ROPE=rope_dim,
        SKIP_EMPTY=out_mode == _OUT_CACHE and gb == 1,
        num_warps=POOL_CONFIG["warps_large" if d >= 512 else "warps_small"],
        **pdl_launch(dev),
    )


@register_op(api.COMPRESSOR_POOL, "triton")
def compressor_pool(kv, score, positions, ape, state, state_slots, group_rows, ratio):
    """Triton ``compressor_pool``: write rows (launch 1), pool completed groups (launch 2)."""
    coff, d = _check_inputs(kv, score, positions, ape, state, state_slots, group_rows, ratio)
    _write_rows(kv, score, positions, ape, state, state_slots, ratio, coff, d)
    g = group_rows.shape[0]
    out = torch.empty(g, d, dtype=torch.float32, device=state.device)
    if g:
        _launch_pool(state, group_rows, ratio, coff, d, quant.FMT_FP32, _OUT_POOLED, out=out)
    return out


@register_op(api.COMPRESSOR_STORE, "triton")
def compressor_store(
    kv,
    score,
    positions,
    ape,
    state,
    state_slots,
    group_rows,
    ratio,
    norm_weight,
    eps,
    cos_sin,
    group_entry_index,
    cache,
    cache_slots,
    fmt,
) -> None:
    """Triton ``compressor_store``: write rows (launch 1); then one fused program per completed group:
    pool + RMSNorm_w + RoPE + quantize + paged insert with ``fmt`` (launch 2)."""
    coff, d = _check_inputs(kv, score, positions, ape, state, state_slots, group_rows, ratio)
    fmt_code = quant.format_code(fmt)
    if fmt.dim != d:
        raise ValueError(f"format {fmt.name} holds dim {fmt.dim} entries, compressor d is {d}")
    if cos_sin.dim() != 2 or cos_sin.shape[-1] % 2 or cos_sin.shape[-1] > d:
        raise ValueError(
            f"cos_sin must be [P, R] with R even and <= {d}, got {tuple(cos_sin.shape)}"
        )
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [{d}], got {tuple(norm_weight.shape)}")
    quant.check_cache(cache, fmt)
    _write_rows(kv, score, positions, ape, state, state_slots, ratio, coff, d)
    if group_rows.shape[0] == 0:
        return
    _launch_pool(
        state,
        group_rows,
        ratio,
        coff,
        d,
        fmt_code,
        _OUT_CACHE,
        norm_weight=norm_weight,
        eps=eps,
        cos_sin=cos_sin,
        entry_index=group_entry_index,
        cache=cache,
        cache_slots=cache_slots,
        fmt=fmt,
    )
