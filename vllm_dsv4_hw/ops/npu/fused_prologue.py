# SPDX-License-Identifier: Apache-2.0
"""npu ``qnorm_rope_kv_insert``: the npu rms_norm, rope and kv_insert composed (each under its own
failure policy)."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.npu.kv_cache import kv_insert
from vllm_dsv4_hw.ops.npu.norm import rms_norm
from vllm_dsv4_hw.ops.npu.rope import rope
from vllm_dsv4_hw.ops.reference import fused_prologue as ref_fused
from vllm_dsv4_hw.ops.registry import register_op


@register_op(QNORM_ROPE_KV_INSERT, "npu")
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
    if (
        q.dim() != 3
        or kv.dim() != 2
        or kv.shape[0] != q.shape[0]
        or kv.shape[1] != q.shape[2]
        or fmt.dim != kv.shape[1]
        or q.dtype == torch.float64
    ):
        # bad shapes raise the contract's error there; float64 (oracle path) has no NPU dtype
        return ref_fused.qnorm_rope_kv_insert(
            q, kv, positions, cos_sin, eps, window_cache, window_slots, fmt
        )
    q_out = rope(rms_norm(q.float(), None, eps), positions, cos_sin).to(q.dtype)
    k = rope(kv.float(), positions, cos_sin)
    kv_insert(window_cache, window_slots, k, fmt)
    return q_out
