# SPDX-License-Identifier: Apache-2.0
"""Triton routed experts for a few tokens (``gemv_experts``): FP4 GEMVs straight over the (token,
slot) pairs, without grouping them by expert.

At decode one token hits k (6) experts and each expert row is used once, so the grouped GEMM's
16-row tiles hold one live row and its pair sorting costs ~36 small launches. Here:

* ``_gemv_gate_up_kernel``, grid (pairs, I / BN): a program reads the pair's expert id and one
  [2 BN, BK / 2] byte tile per step (BN gate rows and the BN up rows of the same columns) against
  the token's x, applies the clamped SwiGLU and stores the activation rounded to x's dtype;
* ``_gemv_down_kernel``, grid (tokens, D / BN): a program reads the ``w2`` rows of all k slots of
  its token at once (a [k, BN, BK / 2] tile per step), each against its slot's activation, scales
  each slot by its top-k weight and adds the slots in slot order (slot 0 first, the contract's).

Bytes in flight and the arithmetic per byte bound it: each step loads every row of the program's
tile in one go, and the e2m1 decode is integer bit moves and one multiply per code
(``_e2m1_pair``).
Exact over the whole ue8m0 range as the grouped kernel is: each 32-element group's fp32 dot of x
with the bare e2m1 values (exact products) is multiplied by its scale before it is added. Slots
with an id outside [0, E) contribute nothing (no host sync to check them). x and the activation
move as bf16 bit patterns converted with integer ops (exact on every target and the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.common.launch import cdiv
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import (
    C_CVT_PTX,
    CVT_INT,
    CVT_PTX,
    e2m1_pairs_to_f32,
    e4m3_mode,
)
from vllm_dsv4_hw.ops.triton.common.quant import f32_to_bf16_bits, ue8m0_to_f32
from vllm_dsv4_hw.ops.triton.moe.grouped import _as_bytes, _inner_contiguous, _load_x, _silu

# (rows per program BN, elements of K per step BK, warps) of each kernel (evidence:
# docs/tuning.md, Routed experts)
TILES = {"gate_up": (8, 512, 4), "down": (8, 256, 8)}


@triton.jit
def _e2m1_pair(b):
    """Bytes (int32 0..255) -> the fp32 values of their low and high e2m1 codes. The 3 magnitude
    bits go to fp32's exponent / top mantissa bits, where they read as the value times 2^-126
    (code 1, 0.5, as a subnormal), the sign bit to bit 31; one multiply by 2^126 is exact. fp32
    subnormals are kept on every Triton target (``tests/aot``: no ``.ftz`` in the PTX, AMD's
    denorm mode 3) and under the interpreter."""
    lo = ((b << 22) & 0x01C00000) | ((b >> 3) << 31)
    hi = ((b << 18) & 0x01C00000) | ((b >> 7) << 31)
    two126 = 8.507059173023462e37
    return lo.to(tl.float32, bitcast=True) * two126, hi.to(tl.float32, bitcast=True) * two126


@triton.jit
def _e2m1_values(b, CVT: tl.constexpr):
    """Pair bytes (uint8) -> the fp32 values of their low and high codes: the packed PTX decode
    (``ptx_codecs``, 26 instructions per 8 codes) where the device declares inline PTX, else
    ``_e2m1_pair`` (about 5 integer instructions per code). The same values."""
    if CVT == C_CVT_PTX:
        return e2m1_pairs_to_f32(b)
    else:
        return _e2m1_pair(b.to(tl.int32))


@triton.jit
def _fp4_tile_dot(xe, xo, b, sb, BK: tl.constexpr, CVT: tl.constexpr):
    """One K step of FP4 rows: ``b`` [..., BK / 2] bytes against the even / odd x elements
    (broadcastable), ``sb`` [..., BK / 32] ue8m0 bytes -> [..., BK / 32] fp32: each 32-element
    group's exact dot times its scale."""
    lo, hi = _e2m1_values(b, CVT)
    prod = lo * xe + hi * xo
    shape: tl.constexpr = prod.shape
    if len(shape) == 2:
        groups = tl.sum(tl.reshape(prod, (shape[0], BK // 32, 16)), axis=2)
    else:
        groups = tl.sum(tl.reshape(prod, (shape[0], shape[1], BK // 32, 16)), axis=3)
    return groups * ue8m0_to_f32(sb)


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    limit,
    n_exp,
    topk,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_at,
    D: tl.constexpr,
    I: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    CVT: tl.constexpr = 0,
):
    """act[pair, n] = swiglu(h[n], h[I + n]) with h = w13[e] x[pair // topk] (0 for a dropped
    slot)."""
    pdl_start(PDL)
    pair = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, 2 * BN)  # tile rows: BN gate rows, then the BN up rows of the same columns
    n = tl.program_id(1) * BN + r % BN
    # the expert id as a vector: a scalar mask broadcast into a 2-D one trips the interpreter
    e = tl.load(ids_ptr + pair + tl.zeros([2 * BN], tl.int64)).to(tl.int64)
    live = (e >= 0) & (e < n_exp)
    rmask = (n < I) & live
    e = tl.where(live, e, 0)
    row = n + (r // BN) * I
    w_rows = w_ptr + e * stride_we + row * stride_wn
    s_rows = s_ptr + e * stride_se + row * stride_sn
    x_row = x_ptr + (pair // topk) * stride_xt
    j = tl.arange(0, BK // 2)
    g = tl.arange(0, BK // 32)
    acc = tl.zeros([2 * BN, BK // 32], dtype=tl.float32)
    for k0 in range(0, D, BK):
        xe = _load_x(x_row + k0 + 2 * j, k0 + 2 * j < D, BF16_BITS)
        xo = _load_x(x_row + k0 + 2 * j + 1, k0 + 2 * j + 1 < D, BF16_BITS)
        kv = (k0 // 2 + j) < D // 2
        b = tl.load(
            w_rows[:, None] + k0 // 2 + j[None, :], mask=rmask[:, None] & kv[None, :], other=0
        )
        sb = tl.load(
            s_rows[:, None] + k0 // 32 + g[None, :],
            mask=rmask[:, None] & ((k0 // 32 + g) < D // 32)[None, :],
            other=127,
        )
        acc += _fp4_tile_dot(xe[None, :], xo[None, :], b, sb, BK, CVT)
    h = tl.reshape(tl.sum(acc, axis=1), (2, BN))
    half = tl.arange(0, 2)[:, None]
    gate = tl.sum(tl.where(half == 0, h, 0.0), axis=0)  # exact: the other half adds zeros
    up = tl.sum(tl.where(half == 1, h, 0.0), axis=0)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    nb = tl.program_id(1) * BN + tl.arange(0, BN)
    e_b = tl.load(ids_ptr + pair + tl.zeros([BN], tl.int64))
    live_b = (nb < I) & (e_b >= 0) & (e_b < n_exp)
    act = tl.where(live_b, _silu(gate) * up, 0.0)
    aptr = act_ptr + pair * stride_at + nb
    if ACT_BF16:  # RNE bf16 bits: exact everywhere (the interpreter's cast truncates)
        tl.store(aptr.to(tl.pointer_type(tl.uint16)), f32_to_bf16_bits(act), mask=nb < I)
    else:
        tl.store(aptr, act, mask=nb < I)


@triton.jit
def _gemv_down_kernel(
    a_ptr,
    ids_ptr,
    tw_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    add_ptr,
    n_exp,
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    stride_add,
    D: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P: tl.constexpr,
    BF16_BITS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ADD_BF16_BITS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    CVT: tl.constexpr = 0,
):
    """out[t, n] = sum over slots j in order of tw[t, j] * (w2[e_j] act[t * k + j])[n]
    (+ add[t, n] last), fp32."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    slot = tl.arange(0, TOPK_P)
    pair = t * TOPK + slot
    e = tl.load(ids_ptr + pair, mask=slot < TOPK, other=-1).to(tl.int64)
    live = (slot < TOPK) & (e >= 0) & (e < n_exp)
    e = tl.where(live, e, 0)
    rmask = live[:, None] & (n < D)[None, :]  # [TOPK_P, BN]
    w_rows = w_ptr + e[:, None] * stride_we + n[None, :] * stride_wn
    s_rows = s_ptr + e[:, None] * stride_se + n[None, :] * stride_sn
    a_rows = a_ptr + pair * stride_at
    j = tl.arange(0, BK // 2)
    g = tl.arange(0, BK // 32)
    acc = tl.zeros([TOPK_P, BN, BK // 32], dtype=tl.float32)
    for k0 in range(0, I, BK):
        am = live[:, None] & ((k0 + 2 * j) < I)[None, :]
        xe = _load_x(a_rows[:, None] + k0 + 2 * j[None, :], am, BF16_BITS)
        xo = _load_x(a_rows[:, None] + k0 + 2 * j[None, :] + 1, am, BF16_BITS)
        kv = (k0 // 2 + j) < I // 2
        b = tl.load(
            w_rows[:, :, None] + k0 // 2 + j[None, None, :],
            mask=rmask[:, :, None] & kv[None, None, :],
            other=0,
        )
        sb = tl.load(
            s_rows[:, :, None] + k0 // 32 + g[None, None, :],
            mask=rmask[:, :, None] & ((k0 // 32 + g) < I // 32)[None, None, :],
            other=127,
        )
        acc += _fp4_tile_dot(xe[:, None, :], xo[:, None, :], b, sb, BK, CVT)
    tw = tl.load(tw_ptr + pair, mask=live, other=0.0)
    part = tl.where(rmask, tl.sum(acc, axis=2) * tw[:, None], 0.0)
    out = tl.zeros([BN], dtype=tl.float32)
    for s in tl.static_range(TOPK):  # slot order; the other slots add exact zeros
        out += tl.sum(tl.where(slot[:, None] == s, part, 0.0), axis=0)
    if HAS_ADD:
        out += _load_x(add_ptr + t * stride_add + n, n < D, ADD_BF16_BITS)
    tl.store(out_ptr + t * stride_out + n, out, mask=n < D)


def gemv_experts(
    x,
    topk_weights,
    topk_ids,
    w13,
    w13_scale,
    w2,
    w2_scale,
    swiglu_limit,
    n_exp,
    inter,
    add=None,
    cvt=None,
):
    """``ops.api.moe_experts`` for FP4 weights and a few tokens (validated by the caller).
    ``cvt``: the e2m1 decode (``ptx_codecs``; default the device's fastest, the GPU checks
    compare the others with it)."""
    t, d = x.shape
    k = topk_ids.shape[1]
    out = torch.empty(t, d, dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return out.zero_() if add is None else out.copy_(add)
    if add is not None:
        add = _inner_contiguous(
            add if add.dtype in (torch.bfloat16, torch.float32) else add.float()
        )
    x = _inner_contiguous(x)
    ids = topk_ids.reshape(-1).contiguous()
    w13, w2, s13, s2 = (_as_bytes(w) for w in (w13, w2, w13_scale, w2_scale))
    is_bf16 = x.dtype == torch.bfloat16
    if cvt is None:
        cvt = CVT_PTX if e4m3_mode(x.device) == CVT_PTX else CVT_INT
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    has_limit = swiglu_limit is not None and swiglu_limit > 0
    bn, bk, warps = TILES["gate_up"]
    _gemv_gate_up_kernel[(t * k, cdiv(inter, bn))](
        x,
        ids,
        w13,
        s13,
        act,
        float(swiglu_limit) if has_limit else 0.0,
        n_exp,
        k,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        act.stride(0),
        D=d,
        I=inter,
        HAS_LIMIT=has_limit,
        BF16_BITS=is_bf16,
        ACT_BF16=is_bf16,
        BN=bn,
        BK=bk,
        CVT=cvt,
        num_warps=warps,
        **pdl_launch(x.device),
    )
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    bn, bk, warps = TILES["down"]
    _gemv_down_kernel[(t, cdiv(d, bn))](
        act,
        ids,
        tw,
        w2,
        s2,
        out,
        out if add is None else add,
        n_exp,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        out.stride(0),
        0 if add is None else add.stride(0),
        D=d,
        I=inter,
        TOPK=k,
        TOPK_P=triton.next_power_of_2(k),
        BF16_BITS=is_bf16,
        HAS_ADD=add is not None,
        ADD_BF16_BITS=add is not None and add.dtype == torch.bfloat16,
        BN=bn,
        BK=bk,
        CVT=cvt,
        num_warps=warps,
        **pdl_launch(x.device),
    )
    return out
