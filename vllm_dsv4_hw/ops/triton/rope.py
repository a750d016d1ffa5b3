"""Triton GPT-J RoPE (``rope``): one program per (token, row) of ``x [T, ..., D]``, pair layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import ROPE
from vllm_dsv4_hw.ops.checks import check_rope_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common import grid_1d, is_f64, out_is_bf16, rope_pairs, to_math, to_out
from vllm_dsv4_hw.ops.triton.launch import next_pow2
from vllm_dsv4_hw.ops.triton.pdl import pdl_launch, pdl_start


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cs_ptr, out_ptr, n_rows, rows_per_tok, x_tok_stride,
                 x_row_stride, cs_stride, NP: tl.constexpr, BLOCK_P: tl.constexpr,
                 FIRST_PAIR: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr,
                 F64: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    p = tl.arange(0, BLOCK_P)
    m = p < NP
    for row in range(pid, n_rows, nprog):
        r = tl.cast(row, tl.int64)
        t = r // rows_per_tok
        src = x_ptr + t * x_tok_stride + (r % rows_per_tok) * x_row_stride
        xe = to_math(tl.load(src + 2 * p, mask=m, other=0.0), F64)
        xo = to_math(tl.load(src + 2 * p + 1, mask=m, other=0.0), F64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        ye, yo = rope_pairs(xe, xo, cs_ptr + pos * cs_stride, p, FIRST_PAIR, HALF, INVERSE, F64)
        dst = out_ptr + r * (2 * NP)
        tl.store(dst + 2 * p, to_out(ye, OUT_BF16), mask=m)
        tl.store(dst + 2 * p + 1, to_out(yo, OUT_BF16), mask=m)


@register_op(ROPE, "triton")
def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         inverse: bool = False) -> torch.Tensor:
    check_rope_args(x, positions, cos_sin)
    r = cos_sin.shape[-1]
    d = x.shape[-1]
    if d % 2:  # pairs would straddle the rope boundary: not a layout any model uses
        from vllm_dsv4_hw.ops.reference.rope import rope as ref_rope

        return ref_rope(x, positions, cos_sin, inverse)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    t = x.shape[0]
    if x.numel() == 0:
        return out
    x3 = x.reshape(t, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    rows_per_tok = x3.shape[1]
    cs = cos_sin.to(x.device)
    if cs.stride(-1) != 1:
        cs = cs.contiguous()
    pos = positions.to(x.device)
    n_rows = t * rows_per_tok
    _rope_kernel[grid_1d(n_rows, x.device)](
        x3, pos, cs, out, n_rows, rows_per_tok, x3.stride(0), x3.stride(1), cs.stride(0),
        NP=d // 2, BLOCK_P=next_pow2(d // 2), FIRST_PAIR=(d - r) // 2, HALF=r // 2,
        INVERSE=bool(inverse), F64=is_f64(x), OUT_BF16=out_is_bf16(out),
        num_warps=4 if d >= 512 else 1, **pdl_launch(x.device))
    return out
