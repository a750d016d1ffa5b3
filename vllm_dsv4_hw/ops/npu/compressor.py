# SPDX-License-Identifier: Apache-2.0
"""npu ``compressor_store``: the dispatched ``compressor_pool`` (triton-ascend where it runs, else
the reference: no torch_npu operator pools), then the npu rms_norm, rope and kv_insert."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.api import COMPRESSOR_STORE
from vllm_dsv4_hw.ops.npu.kv_cache import kv_insert
from vllm_dsv4_hw.ops.npu.norm import rms_norm
from vllm_dsv4_hw.ops.npu.rope import rope
from vllm_dsv4_hw.ops.registry import register_op


@register_op(COMPRESSOR_STORE, "npu")
def compressor_store(
    kv,
    score,
    positions,
    ape,
    state,
    state_slots,
    group_rows,
    ratio,
    norm_weight,
    eps,
    cos_sin,
    group_entry_index,
    cache,
    cache_slots,
    fmt,
) -> None:
    entries = api.compressor_pool(kv, score, positions, ape, state, state_slots, group_rows, ratio)
    if entries.shape[0] == 0:
        return
    entries = rms_norm(entries, norm_weight, eps)
    rope_pos = group_entry_index.to(device=entries.device, dtype=torch.int64) * ratio
    entries = rope(entries, rope_pos, cos_sin)
    kv_insert(cache, cache_slots.to(device=entries.device, dtype=torch.int64), entries, fmt)
