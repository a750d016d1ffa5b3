# SPDX-License-Identifier: Apache-2.0
"""Reference ``qnorm_rope_kv_insert`` (the layer's query prologue and window-KV insert): the plain
composition of the reference ops its contract (``ops.api``) names, with fp32 intermediates.
Accelerated backends fuse it."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.ops.api import QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.checks import check_qnorm_rope_kv_insert_args
from vllm_dsv4_hw.ops.reference.norm import rms_norm
from vllm_dsv4_hw.ops.reference.rope import rope
from vllm_dsv4_hw.ops.registry import register_op


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_op(QNORM_ROPE_KV_INSERT, "reference")
def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    fmt,
) -> torch.Tensor:
    check_qnorm_rope_kv_insert_args(q, kv, fmt)
    md = _math_dtype(q.dtype)
    q_out = rope(rms_norm(q.to(md), None, eps), positions, cos_sin).to(q.dtype)
    k = rope(kv.to(md), positions, cos_sin)
    paged.insert_rows(window_cache, window_slots, k, fmt)
    return q_out
