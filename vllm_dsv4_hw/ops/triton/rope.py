# SPDX-License-Identifier: Apache-2.0
"""Triton GPT-J RoPE (``rope``): one program per (token, row) of ``x [T, ..., D]``, pair layout.

Triton ``inv_rope_fp8_quant``: inverse RoPE on the last R dims of each head of the attention
output (or the forward rotation, ``inverse=False``: the indexer's q^I), then FP8 e4m3 quantization in 128-dim groups with power-of-two (ue8m0) fp32 scales,
(token, head) rows looped over the programs. The e4m3 codes are written as bytes: built by the
hardware cvt where the device declares one (``fp8_cvt``: CUDA sm_89+, ROCm; round to nearest even,
the values are already within +-448), else from integer bit operations (bit-exact with it: the
interpreter, whose fp8 cast does not round to nearest even, and devices without fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import INV_ROPE_FP8_QUANT, O_QUANT_AMAX_FLOOR, O_QUANT_GROUP, ROPE
from vllm_dsv4_hw.ops.checks import (
    check_fused_rope_args,
    check_inv_rope_fp8_quant_args,
    check_rope_args,
)
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import ceil_log2_div, f32_to_e4m3_bits, pow2_f32
from vllm_dsv4_hw.ops.triton.common.rows import (
    grid_1d,
    is_f64,
    out_is_bf16,
    rope_pairs,
    to_math,
    to_out,
)
from vllm_dsv4_hw.platform.device import adaptor_for


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    cs_ptr,
    out_ptr,
    n_rows,
    rows_per_tok,
    x_tok_stride,
    x_row_stride,
    cs_stride,
    NP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    INVERSE: tl.constexpr,
    F64: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
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
def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
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
        x3,
        pos,
        cs,
        out,
        n_rows,
        rows_per_tok,
        x3.stride(0),
        x3.stride(1),
        cs.stride(0),
        NP=d // 2,
        BLOCK_P=next_pow2(d // 2),
        FIRST_PAIR=(d - r) // 2,
        HALF=r // 2,
        INVERSE=bool(inverse),
        F64=is_f64(x),
        OUT_BF16=out_is_bf16(out),
        num_warps=4 if d >= 512 else 1,
        **pdl_launch(x.device),
    )
    return out


# Launch by row count: one (token, head) row per iteration; 1 warp per row from 257 rows, 4
# below; the cvt encode below MANY_ROWS, the integer one from there: each the faster where it
# applies; tiles of several rows per iteration were slower (evidence: docs/tuning.md,
# inv_rope_fp8_quant launch).
MANY_ROWS = 4096
MANY_ROWS_TILE = 1
MANY_ROWS_WARPS = 1


def launch_shape(n_rows: int) -> tuple[int, int, bool]:
    """(rows per iteration, num_warps, whether the cvt encode pays) of a call over ``n_rows``
    (token, head) rows; the cvt only where the device has one (``hw_encode``)."""
    if n_rows >= MANY_ROWS:
        return MANY_ROWS_TILE, MANY_ROWS_WARPS, False
    return 1, (4 if n_rows <= 256 else 1), True


@triton.jit
def _e4m3_codes(v, HW_ENC: tl.constexpr):
    """e4m3 bytes of fp32 values within +-448: one packed cvt per pair of values (``HW_ENC``;
    sm_90 SASS of the decode program: 871 -> 647 instructions per row) or the integer encode."""
    if HW_ENC:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return f32_to_e4m3_bits(v)


def hw_encode(device: torch.device) -> bool:
    """Whether the kernel encodes with the device's cvt: a GPU that declares ``fp8_cvt`` (the
    interpreter's fp8 cast rounds ties up, so CPU tensors keep the integer encode)."""
    return device.type != "cpu" and adaptor_for(device.type).capabilities.fp8_cvt


@triton.jit
def _pairs_row(
    src,
    pos_ptr,
    cs_ptr,
    out_ptr,
    r,
    rm,
    t,
    cs_stride,
    amax_floor,
    NG: tl.constexpr,
    BG: tl.constexpr,
    GP: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    HW_ENC: tl.constexpr,
    INV: tl.constexpr,
):
    """Rows ``r`` [ROWS] as pairs: the even and odd halves [ROWS, BG, GP] by two stride-2
    gathers, rotated by ``rope_pairs``, stored as two stride-2 byte scatters; returns the
    groups' scale exponents [ROWS, BG]."""
    g = tl.arange(0, BG)
    pidx = (g[:, None] * GP + tl.arange(0, GP)[None, :])[None, :, :]  # [1, BG, GP]
    pm = rm[:, None, None] & (g < NG)[None, :, None] & (pidx >= 0)
    xe = tl.load(src + 2 * pidx, mask=pm, other=0.0).to(tl.float32)
    xo = tl.load(src + 2 * pidx + 1, mask=pm, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t, mask=rm, other=0).to(tl.int64)
    ye, yo = rope_pairs(
        xe, xo, (cs_ptr + pos * cs_stride)[:, None, None], pidx, FIRST_PAIR, HALF, INV, False
    )
    amax = tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=2)  # [ROWS, BG]
    ex = ceil_log2_div(tl.maximum(amax, amax_floor), 0x600000, 8)  # 448 = 1.75 * 2^8
    inv = pow2_f32(-ex)[:, :, None]
    dst = (out_ptr + r * (NG * GP * 2))[:, None, None]
    tl.store(dst + 2 * pidx, _e4m3_codes(ye * inv, HW_ENC), mask=pm)
    tl.store(dst + 2 * pidx + 1, _e4m3_codes(yo * inv, HW_ENC), mask=pm)
    return ex


@triton.jit
def _inv_rope_fp8_quant_kernel(
    o_ptr,
    pos_ptr,
    cs_ptr,
    out_ptr,
    scale_ptr,
    n_rows,
    n_heads,
    o_tok_stride,
    o_head_stride,
    cs_stride,
    amax_floor,
    NG: tl.constexpr,
    BG: tl.constexpr,
    GP: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    HW_ENC: tl.constexpr,
    PDL: tl.constexpr = False,
    INV: tl.constexpr = True,
):
    pdl_start(PDL)
    # ROWS (token, head) rows per iteration (a knob; the launch rule takes ROWS = 1)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    jr = tl.arange(0, ROWS)
    g = tl.arange(0, BG)
    for blk in range(pid, tl.cdiv(n_rows, ROWS), nprog):
        r = tl.cast(blk, tl.int64) * ROWS + jr  # [ROWS]
        rm = r < n_rows
        t = r // n_heads
        src = (o_ptr + t * o_tok_stride + (r % n_heads) * o_head_stride)[:, None, None]
        ex = _pairs_row(
            src,
            pos_ptr,
            cs_ptr,
            out_ptr,
            r,
            rm,
            t,
            cs_stride,
            amax_floor,
            NG,
            BG,
            GP,
            FIRST_PAIR,
            HALF,
            HW_ENC,
            INV,
        )
        tl.store(
            scale_ptr + r[:, None] * NG + g[None, :],
            pow2_f32(ex),
            mask=rm[:, None] & (g < NG)[None, :],
        )


@register_op(INV_ROPE_FP8_QUANT, "triton")
def inv_rope_fp8_quant(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    inverse: bool = True,
    *,
    rows: int | None = None,
    num_warps: int | None = None,
    hw_enc: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (``ops.api.inv_rope_fp8_quant``); ``rows`` / ``num_warps``: launch knobs for
    benchmarks and tests (default ``launch_shape``); ``hw_enc``: force the encode (default: the
    cvt where ``launch_shape`` finds it pays and ``hw_encode`` has it; the GPU tier compares both
    bit for bit)."""
    check_inv_rope_fp8_quant_args(o, O_QUANT_GROUP)
    t, h, d = o.shape
    check_fused_rope_args("inv_rope_fp8_quant", positions, cos_sin, t, d)
    r = cos_sin.shape[-1]
    ng = d // O_QUANT_GROUP
    out = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=o.device)
    scales = torch.empty(t, h, ng, dtype=torch.float32, device=o.device)
    if out.numel() == 0:
        return out, scales
    if o.stride(-1) != 1:
        o = o.contiguous()
    cs = cos_sin.to(o.device)
    if cs.stride(-1) != 1:
        cs = cs.contiguous()
    pos = positions.to(o.device)
    auto_rows, auto_warps, cvt_pays = launch_shape(t * h)
    rows = auto_rows if rows is None else rows
    if hw_enc is None:
        hw_enc = cvt_pays and hw_encode(o.device)
    _inv_rope_fp8_quant_kernel[grid_1d(cdiv(t * h, rows), o.device)](
        o,
        pos,
        cs,
        out.view(torch.uint8),
        scales,
        t * h,
        h,
        o.stride(0),
        o.stride(1),
        cs.stride(0),
        float(O_QUANT_AMAX_FLOOR),
        NG=ng,
        BG=next_pow2(ng),
        GP=O_QUANT_GROUP // 2,
        FIRST_PAIR=(d - r) // 2,
        HALF=r // 2,
        ROWS=rows,
        HW_ENC=hw_enc,
        INV=bool(inverse),
        num_warps=auto_warps if num_warps is None else num_warps,
        **pdl_launch(o.device),
    )
    return out, scales
