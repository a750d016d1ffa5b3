# SPDX-License-Identifier: Apache-2.0
"""Triton ``swiglu`` (the shared expert's clamped SwiGLU) in one launch: one program per row
block of the merged gate | up projection, fp32 math, one rounding (bf16 through integer bits, exact
on every target and the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import SWIGLU
from vllm_dsv4_hw.ops.reference import moe as ref
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import f32_to_bf16_bits
from vllm_dsv4_hw.ops.triton.moe.grouped import _load_x, _silu

BLOCK = 1024  # columns per program


@triton.jit
def _swiglu_kernel(
    h_ptr,
    out_ptr,
    limit,
    stride_h,
    stride_o,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < I
    g = _load_x(h_ptr + t * stride_h + n, m, BF16).to(tl.float32)
    u = _load_x(h_ptr + t * stride_h + I + n, m, BF16).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = _silu(g) * u
    if BF16:
        tl.store(
            (out_ptr + t * stride_o + n).to(tl.pointer_type(tl.uint16)), f32_to_bf16_bits(a), mask=m
        )
    else:
        tl.store(out_ptr + t * stride_o + n, a, mask=m)


@register_op(SWIGLU, "triton")
def swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    if h.dtype not in (torch.bfloat16, torch.float32) or h.dim() != 2 or h.shape[1] % 2:
        return ref.swiglu(h, limit)  # float64 (oracle tests); bad shapes: its error
    t, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(t, inter, dtype=h.dtype, device=h.device)
    if t == 0 or inter == 0:
        return out
    h = h if h.stride(-1) == 1 else h.contiguous()
    has_limit = limit is not None and limit > 0
    block = min(BLOCK, next_pow2(inter))
    _swiglu_kernel[(t, cdiv(inter, block))](
        h,
        out,
        float(limit) if has_limit else 0.0,
        h.stride(0),
        out.stride(0),
        I=inter,
        BLOCK=block,
        HAS_LIMIT=has_limit,
        BF16=h.dtype == torch.bfloat16,
        **pdl_launch(h.device),
    )
    return out
