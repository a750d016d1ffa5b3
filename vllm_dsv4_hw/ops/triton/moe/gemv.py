# SPDX-License-Identifier: Apache-2.0
"""Triton routed experts for a few tokens (``gemv_experts``): FP4 GEMVs straight over the (token,
slot) pairs, without grouping them by expert.

At decode one token hits k (6) experts and each expert row is used once, so the grouped GEMM's
16-row tiles hold one live row and its pair sorting costs ~36 small launches. Here:

* ``_gemv_gate_up_kernel``, grid (pairs, I / BN): a program reads the pair's expert id, BN gate
  rows and the BN up rows of the same columns (FP4 bytes and ue8m0 scales) against the token's x,
  applies the clamped SwiGLU and stores the activation rounded to x's dtype;
* ``_gemv_down_kernel``, grid (tokens, D / BN): a program walks the token's k slots in slot order,
  each a GEMV of its expert's ``w2`` rows against the slot's activation times its top-k weight,
  and stores the fp32 sum, so the slot sum of the contract (slot 0 first) happens in registers.

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
from vllm_dsv4_hw.ops.triton.common.quant import e2m1_to_f32, f32_to_bf16_bits, ue8m0_to_f32
from vllm_dsv4_hw.ops.triton.moe.grouped import _as_bytes, _inner_contiguous, _load_x, _silu

# weight rows per program and elements of K per step (16 scale groups): the fastest of 8 / 16 / 32
# x 256 / 512 / 1024 at 1 and 4 tokens (evidence: docs/tuning.md, Routed experts)
BN = 8
BK = 512


@triton.jit
def _fp4_rows_dot(
    x_row,
    w_rows,
    s_rows,
    rmask,
    K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """[BN] fp32: the dots of BN FP4 weight rows (byte pointers ``w_rows``, scale pointers
    ``s_rows``) with x (K elements at ``x_row``), each 32-element group scaled before it is
    added."""
    j = tl.arange(0, BK // 2)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        xe = _load_x(x_row + k0 + 2 * j, k0 + 2 * j < K, BF16_BITS)
        xo = _load_x(x_row + k0 + 2 * j + 1, k0 + 2 * j + 1 < K, BF16_BITS)
        kv = (k0 // 2 + j) < K // 2
        b = tl.load(
            w_rows[:, None] + k0 // 2 + j[None, :], mask=rmask[:, None] & kv[None, :], other=0
        ).to(tl.int32)
        prod = e2m1_to_f32(b & 0xF) * xe[None, :] + e2m1_to_f32((b >> 4) & 0xF) * xo[None, :]
        groups = tl.sum(tl.reshape(prod, (BN, BK // 32, 16)), axis=2)  # [BN, BK / 32]
        g = tl.arange(0, BK // 32)
        sb = tl.load(
            s_rows[:, None] + k0 // 32 + g[None, :],
            mask=rmask[:, None] & ((k0 // 32 + g) < K // 32)[None, :],
            other=127,
        )
        acc += tl.sum(groups * ue8m0_to_f32(sb), axis=1)
    return acc


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
):
    """act[pair, n] = swiglu(h[n], h[I + n]) with h = w13[e] x[pair // topk] (0 for a dropped
    slot)."""
    pdl_start(PDL)
    pair = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    # the expert id as a vector: a scalar mask broadcast into a 2-D one trips the interpreter
    e = tl.load(ids_ptr + pair + tl.zeros([BN], tl.int64)).to(tl.int64)
    live = (e >= 0) & (e < n_exp)
    e = tl.where(live, e, 0)
    rmask = (n < I) & live
    x_row = x_ptr + (pair // topk) * stride_xt
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    g = _fp4_rows_dot(x_row, w_e + n * stride_wn, s_e + n * stride_sn, rmask, D, BN, BK, BF16_BITS)
    u = _fp4_rows_dot(
        x_row, w_e + (n + I) * stride_wn, s_e + (n + I) * stride_sn, rmask, D, BN, BK, BF16_BITS
    )
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = tl.where(rmask, _silu(g) * u, 0.0)
    aptr = act_ptr + pair * stride_at + n
    if ACT_BF16:  # RNE bf16 bits: exact everywhere (the interpreter's cast truncates)
        tl.store(aptr.to(tl.pointer_type(tl.uint16)), f32_to_bf16_bits(act), mask=n < I)
    else:
        tl.store(aptr, act, mask=n < I)


@triton.jit
def _gemv_down_kernel(
    a_ptr,
    ids_ptr,
    tw_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_exp,
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    D: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[t, n] = sum over slots j in order of tw[t, j] * (w2[e_j] act[t * k + j])[n], fp32."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair + tl.zeros([BN], tl.int64)).to(tl.int64)
        live = (e >= 0) & (e < n_exp)
        e = tl.where(live, e, 0)
        rmask = (n < D) & live
        dot = _fp4_rows_dot(
            a_ptr + pair * stride_at,
            w_ptr + e * stride_we + n * stride_wn,
            s_ptr + e * stride_se + n * stride_sn,
            rmask,
            I,
            BN,
            BK,
            BF16_BITS,
        )
        acc += tl.where(rmask, dot * tl.load(tw_ptr + pair), 0.0)
    tl.store(out_ptr + t * stride_out + n, acc, mask=n < D)


def gemv_experts(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, swiglu_limit, n_exp, inter
):
    """``ops.api.moe_experts`` for FP4 weights and a few tokens (validated by the caller)."""
    t, d = x.shape
    k = topk_ids.shape[1]
    out = torch.empty(t, d, dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return out.zero_()
    x = _inner_contiguous(x)
    ids = topk_ids.reshape(-1).contiguous()
    w13, w2, s13, s2 = (_as_bytes(w) for w in (w13, w2, w13_scale, w2_scale))
    is_bf16 = x.dtype == torch.bfloat16
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    has_limit = swiglu_limit is not None and swiglu_limit > 0
    _gemv_gate_up_kernel[(t * k, cdiv(inter, BN))](
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
        BN=BN,
        BK=BK,
        **pdl_launch(x.device),
    )
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gemv_down_kernel[(t, cdiv(d, BN))](
        act,
        ids,
        tw,
        w2,
        s2,
        out,
        n_exp,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        out.stride(0),
        D=d,
        I=inter,
        TOPK=k,
        BF16_BITS=is_bf16,
        BN=BN,
        BK=BK,
        **pdl_launch(x.device),
    )
    return out
