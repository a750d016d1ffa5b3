# SPDX-License-Identifier: Apache-2.0
"""The ``fp8_block_linear`` op on Triton: which GEMM takes a call. A few rows with x quantized (or
given as e4m3 codes) take the one-row GEMV (``gemv``); other W8A8 calls the tensor-core W8A8
tiles (``w8a8``) where the device has FP8 dots; everything else the W8A16 tiles (``block``), on
the quantized activations' values where ``quantize_x`` asked for them."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import FP8_BLOCK_LINEAR
from vllm_dsv4_hw.ops.reference.linear import (
    Fp8LinearArgs,
    check_fp8_block_linear_args,
    check_prequantized_x,
    prequantized_values,
    quantize_activations,
)
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.linear import gemv as fp8_gemv
from vllm_dsv4_hw.ops.triton.linear import w8a8 as fp8_dot_linear
from vllm_dsv4_hw.ops.triton.linear.block import launch


def _gemv_knobs(gemv) -> dict:
    """``fp8_block_linear``'s ``gemv`` knob: None (the product's rule), False (the tiles), True
    or a dict of ``fp8_gemv.launch`` knobs (the GEMV wherever it runs, with those knobs)."""
    return gemv if isinstance(gemv, dict) else {}


def _takes_gemv(a: Fp8LinearArgs, gemv, knobs: dict, codes: bool = False) -> bool:
    """The call goes to the GEMV: by ``LinearTuning.gemv_max_rows`` (no tile knob given), or forced by
    ``gemv`` (True / knobs: up to its ``LIMIT_ROWS``)."""
    if gemv is False or knobs:
        return False
    forced = gemv is True or isinstance(gemv, dict)
    return fp8_gemv.takes(a, fp8_gemv.LIMIT_ROWS if forced else None, codes=codes)


@register_op(FP8_BLOCK_LINEAR, "triton")
def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
    quantize_x: bool = False,
    x_scales: torch.Tensor | None = None,
    **knobs,
) -> torch.Tensor:
    """The op contract (``ops.api.fp8_block_linear``); the keyword-only ``knobs`` (those of
    :func:`launch`, or of ``fp8_dot_linear.launch`` with ``quantize_x``) are for benchmarks and
    tests. ``quantize_x`` takes the W8A8 kernel where it runs (``fp8_dot_linear.supports``), else
    this kernel on the quantized activations' values, the same products (a float64 x, an odd
    scale block, a device without FP8 dots): kept in bf16 for bf16 x (e4m3 times a power of two
    from 2^-31 up is a bf16 value: exact, the 16-bit dot), else fp32. A few rows, x quantized
    here or given as codes, take the GEMV (``fp8_gemv``: the same products, summed with FMAs)
    where its ``MAX_ROWS`` lets them, or up to its ``LIMIT_ROWS`` with ``gemv=True`` (or a
    dict of its launch knobs); ``gemv=False`` keeps the tile kernels."""
    if x_scales is not None:  # x given as e4m3 codes + scales
        out_dtype = check_prequantized_x(x, x_scales, int(block[1]), out_dtype)
        # the values' dtype: bf16 holds every e4m3 value times a power of two exactly
        vdt = out_dtype if out_dtype in (torch.float32, torch.float64) else torch.bfloat16
        a = check_fp8_block_linear_args(x, weight, scale, block, out_dtype, x_dtype=vdt)
        xs = x_scales if a.grouped else x_scales.unsqueeze(1)
        codes = x if a.grouped else x.unsqueeze(1)
        gemv = knobs.pop("gemv", None)
        if vdt != torch.float64 and _takes_gemv(a, gemv, knobs, codes=True):
            return fp8_gemv.launch(a._replace(x=codes), x_scales=xs, **_gemv_knobs(gemv))
        if vdt != torch.float64 and fp8_dot_linear.supports(a._replace(x=x)):  # codes to dots
            return fp8_dot_linear.launch(a._replace(x=codes), x_scales=xs, **knobs)
        vals = prequantized_values(x, x_scales, a.bk).to(vdt)  # the 16-bit kernel on the values
        return launch(a._replace(x=vals if a.grouped else vals.unsqueeze(1)), **knobs)
    a = check_fp8_block_linear_args(x, weight, scale, block, out_dtype)
    if not quantize_x:
        return launch(a, **knobs)
    # few rows: the GEMV (``fp8_gemv``, where its MAX_ROWS takes the call; gemv=True: any rows
    # it can take, gemv=False: the tile kernels)
    gemv = knobs.pop("gemv", None)
    if _takes_gemv(a, gemv, knobs):
        return fp8_gemv.launch(a, **_gemv_knobs(gemv))
    if fp8_dot_linear.supports(a):
        return fp8_dot_linear.launch(a, **knobs)
    xq = quantize_activations(a.x.reshape(a.m * a.g, a.k), a.bk).view(a.m, a.g, a.k)
    keep = {torch.bfloat16: torch.bfloat16, torch.float64: torch.float64}
    return launch(a._replace(x=xq.to(keep.get(x.dtype, torch.float32))), **knobs)
