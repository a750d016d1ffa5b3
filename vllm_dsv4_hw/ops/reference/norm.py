# SPDX-License-Identifier: Apache-2.0
"""Reference RMSNorm: weighted (``RMSNorm_w``) and weightless (the per-head query norm)."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import QKV_RMS_NORM, RMS_NORM
from vllm_dsv4_hw.ops.checks import check_qkv_rms_norm_args
from vllm_dsv4_hw.ops.registry import register_op


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 math for every narrower float; float64 inputs keep float64 (exact oracle comparisons).
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_op(RMS_NORM, "reference")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) [* weight], computed in fp32, returned in x's dtype."""
    md = _math_dtype(x.dtype)
    xf = x.to(md)
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        if weight.shape != x.shape[-1:]:
            raise ValueError(
                f"rms_norm: weight shape {tuple(weight.shape)} != last dim {x.shape[-1]} of x"
            )
        y = y * weight.to(md)
    return y.to(x.dtype)


@register_op(QKV_RMS_NORM, "reference")
def qkv_rms_norm(
    q_r: torch.Tensor, q_w: torch.Tensor, kv: torch.Tensor, kv_w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_qkv_rms_norm_args(q_r, kv)
    return rms_norm(q_r, q_w, eps), rms_norm(kv, kv_w, eps)
