# SPDX-License-Identifier: Apache-2.0
"""Triton RMSNorm: ``rms_norm`` (weighted / weightless, any row length) and ``qkv_rms_norm`` (the
q_r and kv RMSNorms of one layer in one launch: horizontal fusion, one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import QKV_RMS_NORM, RMS_NORM
from vllm_dsv4_hw.ops.checks import check_qkv_rms_norm_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.rows import (
    grid_1d,
    is_f64,
    out_is_bf16,
    row_view,
    to_math,
    to_out,
)


@triton.jit
def rsqrt_m(v, F64: tl.constexpr):
    if F64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.rsqrt(v)


@triton.jit
def rms_norm_row(
    x_ptr,
    w_ptr,
    out_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_W: tl.constexpr,
    F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """One row: out = x / sqrt(mean(x^2) + eps) [* w] (fp32 math, one rounding at the store)."""
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = to_math(tl.load(x_ptr + offs, mask=m, other=0.0), F64)
    y = x * rsqrt_m(tl.sum(x * x, axis=0) / N + eps, F64)
    if HAS_W:
        y = y * to_math(tl.load(w_ptr + offs, mask=m, other=0.0), F64)
    tl.store(out_ptr + offs, to_out(y, OUT_BF16), mask=m)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    x_stride,
    out_stride,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_W: tl.constexpr,
    F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, n_rows, nprog):
        r = tl.cast(row, tl.int64)
        rms_norm_row(
            x_ptr + r * x_stride,
            w_ptr,
            out_ptr + r * out_stride,
            eps,
            N,
            BLOCK,
            HAS_W,
            F64,
            OUT_BF16,
        )


@triton.jit
def _qkv_rms_norm_kernel(
    q_ptr,
    qw_ptr,
    qo_ptr,
    kv_ptr,
    kvw_ptr,
    kvo_ptr,
    n_tokens,
    q_stride,
    qo_stride,
    kv_stride,
    kvo_stride,
    eps,
    NQ: tl.constexpr,
    BQ: tl.constexpr,
    NKV: tl.constexpr,
    BKV: tl.constexpr,
    Q_F64: tl.constexpr,
    Q_BF16: tl.constexpr,
    KV_F64: tl.constexpr,
    KV_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    # Programs [0, T) normalize q_r rows, [T, 2T) kv rows: no communication between programs.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, 2 * n_tokens, nprog):
        if row < n_tokens:
            t = tl.cast(row, tl.int64)
            rms_norm_row(
                q_ptr + t * q_stride,
                qw_ptr,
                qo_ptr + t * qo_stride,
                eps,
                NQ,
                BQ,
                True,
                Q_F64,
                Q_BF16,
            )
        else:
            t = tl.cast(row - n_tokens, tl.int64)
            rms_norm_row(
                kv_ptr + t * kv_stride,
                kvw_ptr,
                kvo_ptr + t * kvo_stride,
                eps,
                NKV,
                BKV,
                True,
                KV_F64,
                KV_BF16,
            )


def _warps(block: int) -> int:
    return 8 if block >= 4096 else (4 if block >= 512 else 1)


@register_op(RMS_NORM, "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    if weight is not None:
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != last dim {n} of x")
        weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    x2 = row_view(x, n)
    o2 = out.view(-1, n)
    rows = x2.shape[0]
    block = next_pow2(n)
    _rms_norm_kernel[grid_1d(rows, x.device)](
        x2,
        weight if weight is not None else x2,
        o2,
        rows,
        x2.stride(0),
        o2.stride(0),
        float(eps),
        N=n,
        BLOCK=block,
        HAS_W=weight is not None,
        F64=is_f64(x),
        OUT_BF16=out_is_bf16(out),
        num_warps=_warps(block),
        **pdl_launch(x.device),
    )
    return out


@register_op(QKV_RMS_NORM, "triton")
def qkv_rms_norm(
    q_r: torch.Tensor, q_w: torch.Tensor, kv: torch.Tensor, kv_w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_qkv_rms_norm_args(q_r, kv)
    if q_w.shape != q_r.shape[-1:] or kv_w.shape != kv.shape[-1:]:
        raise ValueError(
            f"qkv_rms_norm: weights {tuple(q_w.shape)}, {tuple(kv_w.shape)} do not "
            f"match q_r {tuple(q_r.shape)} / kv {tuple(kv.shape)}"
        )
    # Inputs may be column slices of one fused [T, q_lora + D] projection: only unit inner stride.
    q2, kv2 = row_view(q_r, q_r.shape[1]), row_view(kv, kv.shape[1])
    q_out = torch.empty(q_r.shape, dtype=q_r.dtype, device=q_r.device)
    kv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    t = q_r.shape[0]
    if t == 0:
        return q_out, kv_out
    nq, nkv = q_r.shape[1], kv.shape[1]
    bq, bkv = next_pow2(nq), next_pow2(nkv)
    _qkv_rms_norm_kernel[grid_1d(2 * t, q_r.device)](
        q2,
        q_w.contiguous(),
        q_out,
        kv2,
        kv_w.contiguous(),
        kv_out,
        t,
        q2.stride(0),
        q_out.stride(0),
        kv2.stride(0),
        kv_out.stride(0),
        float(eps),
        NQ=nq,
        BQ=bq,
        NKV=nkv,
        BKV=bkv,
        Q_F64=is_f64(q_r),
        Q_BF16=out_is_bf16(q_out),
        KV_F64=is_f64(kv),
        KV_BF16=out_is_bf16(kv_out),
        num_warps=_warps(max(bq, bkv)),
        **pdl_launch(q_r.device),
    )
    return q_out, kv_out
