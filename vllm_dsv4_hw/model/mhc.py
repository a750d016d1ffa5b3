# SPDX-License-Identifier: Apache-2.0
"""The model's last mHC step, ``hc_head``: collapses the streams ``h [T, hc, D]`` after the last
layer with ``hc_head_fn [hc, hc * D]``, ``hc_head_scale [1]`` and ``hc_head_base [hc]``:
``w = sigmoid(scale * mix + base) + hc_eps``, ``out = sum_j w_j * h_j`` (mix as in
``ops.reference.mhc``); the model's final RMSNorm comes after it. Once a step, so plain PyTorch;
the per-layer seams are the ops ``hc_pre`` / ``hc_seam`` / ``hc_post``."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.reference.mhc import hc_math_dtype, hc_mix_logits

__all__ = ["hc_head", "hc_math_dtype"]


def hc_head(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Collapse the streams ``h [T, hc, D]`` after the last layer -> ``[T, D]`` in h's dtype."""
    md = hc_math_dtype(h.dtype)
    mix = hc_mix_logits(h, fn, norm_eps)
    w = torch.sigmoid(mix * scale.to(md) + base.to(md)) + hc_eps
    return (w.unsqueeze(-1) * h.to(md)).sum(dim=1).to(h.dtype)
