# SPDX-License-Identifier: Apache-2.0
"""Triton MoE: the router (``moe_route``, ``route``) and the routed experts (``moe_experts``):
FP4 GEMVs over the (token, slot) pairs for a few tokens (``gemv``), the grouped GEMM over
expert-sorted pairs above (``grouped``); the switch is ``ops.tuning.MoETuning.gemv_max_tokens``."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops import tuning
from vllm_dsv4_hw.ops.api import MOE_EXPERTS
from vllm_dsv4_hw.ops.reference.moe import check_addend, validate_moe_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.moe.activation import swiglu  # noqa: F401  (registers swiglu)
from vllm_dsv4_hw.ops.triton.moe.gemv import gemv_experts
from vllm_dsv4_hw.ops.triton.moe.grouped import grouped_experts
from vllm_dsv4_hw.ops.triton.moe.route import moe_route  # noqa: F401  (registers moe_route)


@register_op(MOE_EXPERTS, "triton")
def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    swiglu_limit: float | None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``ops.api.moe_experts``; x bf16 or fp32 (float64 is the reference's)."""
    n_exp, inter, fp4 = validate_moe_args(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale)
    check_addend(x, add)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"moe_experts (triton): x must be bf16 or fp32, got {x.dtype}")
    args = (x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, swiglu_limit)
    if fp4 and x.shape[0] <= tuning.current().moe.gemv_max_tokens:
        return gemv_experts(*args, n_exp, inter, add)  # the add in the down GEMV's epilogue
    out = grouped_experts(*args)
    return out if add is None else out.add_(add)
