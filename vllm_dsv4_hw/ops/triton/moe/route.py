# SPDX-License-Identifier: Apache-2.0
"""Triton router (``moe_route``) in two launches instead of ~11 PyTorch ones:

* ``_router_scores_kernel``, grid (tokens, E / BE): BE gate rows against the token's x (fp32
  dots over D), ``sqrt(softplus(.))``, stored [T, E] fp32; the gate weight is read by many
  programs at once, each with few dependent loads;
* ``_router_select_kernel``, one program per token: ``s + bias``, k rounds of "largest value,
  lowest id among equals" (the contract's order and tie rule), or the token's hash row; the
  selected scores, renormalised in slot order and scaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import MOE_ROUTE
from vllm_dsv4_hw.ops.reference import moe as ref
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.moe.grouped import _inner_contiguous, _load_x

# Scores: gate rows per program and elements of D per step. Two rows and all of V4-Flash's D in
# one step: 128 programs of one load each for its 256 experts (8 rows in 512-wide steps, 32
# programs of 8 dependent steps, took 17.9 us at one token where 2 MB is 0.6 us; H100,
# docs/tuning.md "Router"). The selection is one warp per token: its reductions are shuffles.
BE = 2
BD = 4096
SCORE_WARPS = 4
SELECT_WARPS = 1


@triton.jit
def _softplus(v):
    """torch's softplus (threshold 20); exp(v) below -15, where log(1 + exp(v)) rounds to it."""
    mid = tl.log(1.0 + tl.exp(tl.minimum(v, 20.0)))
    return tl.where(v > 20.0, v, tl.where(v < -15.0, tl.exp(v), mid))


@triton.jit
def _router_scores_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    E,
    stride_xt,
    stride_we,
    stride_ot,
    D: tl.constexpr,
    BE: tl.constexpr,
    BD: tl.constexpr,
    BF16_BITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BE + tl.arange(0, BE)
    rmask = rows < E
    acc = tl.zeros([BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dm = dd < D
        xv = _load_x(x_ptr + t * stride_xt + dd, dm, BF16_BITS).to(tl.float32)
        wv = tl.load(
            w_ptr + rows[:, None] * stride_we + dd[None, :],
            mask=rmask[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + rows, tl.sqrt(_softplus(acc)), mask=rmask)


@triton.jit
def _router_select_kernel(
    s_ptr,
    bias_ptr,
    hash_ptr,
    w_out_ptr,
    id_out_ptr,
    E,
    scaling,
    stride_st,
    K: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HASH: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EP)
    em = offs < E
    s = tl.load(s_ptr + t * stride_st + offs, mask=em, other=0.0)
    sel = s
    if HAS_BIAS:
        sel = s + tl.load(bias_ptr + offs, mask=em, other=0.0)
    sel = tl.where(em, sel, float("-inf"))
    slots = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    w = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(K):
        if HASH:
            i = tl.load(hash_ptr + t * K + j).to(tl.int32)
        else:
            top = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == top, offs, EP), axis=0)  # the lowest id among equals
            sel = tl.where(offs == i, float("-inf"), sel)
        wi = tl.sum(tl.where(offs == i, s, 0.0), axis=0)
        ids = tl.where(slots == j, i.to(tl.int64), ids)
        w = tl.where(slots == j, wi, w)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(w_out_ptr + t * K + slots, w * scaling, mask=slots < K)
    tl.store(id_out_ptr + t * K + slots, ids, mask=slots < K)


@register_op(MOE_ROUTE, "triton")
def moe_route(x, gate_w, bias, hash_ids, top_k, norm_topk_prob, scaling):
    ref._check_route_args(x, gate_w, bias, hash_ids, top_k)
    if x.dtype not in (torch.bfloat16, torch.float32):  # float64: the oracle tests' reference
        return ref.moe_route(x, gate_w, bias, hash_ids, top_k, norm_topk_prob, scaling)
    t, d = x.shape
    e = gate_w.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    x, w = _inner_contiguous(x), _inner_contiguous(gate_w)
    scores = torch.empty(t, e, dtype=torch.float32, device=x.device)
    _router_scores_kernel[(t, cdiv(e, BE))](
        x,
        w,
        scores,
        e,
        x.stride(0),
        w.stride(0),
        scores.stride(0),
        D=d,
        BE=BE,
        BD=min(BD, next_pow2(d)),
        BF16_BITS=x.dtype == torch.bfloat16,
        num_warps=SCORE_WARPS,
        **pdl_launch(x.device),
    )
    hashed = hash_ids is not None
    _router_select_kernel[(t,)](
        scores,
        bias if bias is not None else scores,
        hash_ids.contiguous() if hashed else ids,
        weights,
        ids,
        e,
        float(scaling),
        scores.stride(0),
        K=top_k,
        KP=next_pow2(top_k),
        EP=next_pow2(e),
        HAS_BIAS=bias is not None,
        HASH=hashed,
        NORM=norm_topk_prob,
        num_warps=SELECT_WARPS,
        **pdl_launch(x.device),
    )
    return weights, ids
