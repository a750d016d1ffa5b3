"""npu ``kv_insert``, ``kv_gather``, ``qnorm_rope_kv_insert``, ``compressor_store``: paged caches.

Insert = the entry format's codec (plain tensor ops, which run on the NPU: no torch_npu quantizer
produces these formats -- npu_quantize / npu_dynamic_quant emit int8 with linear scales, not e4m3 /
e2m1 codes with power-of-two scales) + ``torch_npu.npu_scatter_nd_update_`` into the page views:
one scatter for the entries' data parts ``[P, E, data_bytes]`` and one for their scale parts
``[P, E, scale_bytes]``, indexed by (page, offset) rows. The cache is uint8, which the scatter does
not take on A2/A3, so both sides are viewed as int8 (same bytes). Page padding and neighbouring
entries are never touched. In a process where vllm-ascend loaded its operators the two scatters
are its ``npu_scatter_nd_update_v2`` instead (same ScatterNd semantics, int8 as well, and it is
handed the strides of the page views, which are not contiguous when a page holds scale bytes).

``kv_gather`` is the reference gather (indexing + decode are plain tensor ops).
``qnorm_rope_kv_insert`` and ``compressor_store`` compose the npu rms_norm / rope / kv_insert (each
under its own failure policy); the pooling of ``compressor_store`` is the dispatched
``compressor_pool`` (triton-ascend where it runs, else the reference: no torch_npu operator pools).
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.api import COMPRESSOR_STORE, KV_GATHER, KV_INSERT, QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.npu._vendor import call, call_fn, npu_op, vllm_ascend_op
from vllm_dsv4_hw.ops.npu.norm import rms_norm
from vllm_dsv4_hw.ops.npu.rope import rope
from vllm_dsv4_hw.ops.reference import fused as ref_fused
from vllm_dsv4_hw.ops.reference import kv_cache_ops as ref_kv
from vllm_dsv4_hw.ops.registry import register_op

# vllm-ascend's ScatterNdUpdate taking var's strides (its DSA cache scatter), where it is loaded
SCATTER_V2 = "npu_scatter_nd_update_v2"


@register_op(KV_INSERT, "npu")
@npu_op(KV_INSERT, ref_kv.kv_insert)
def kv_insert(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    rows = paged.encoded_rows(cache, slots, x, fmt)
    if rows is None:
        return
    data_v, scale_v, slots, data, scales = rows
    e = fmt.entries_per_page
    index = torch.stack([slots // e, slots % e], dim=-1)  # [N, 2]: (page, offset)
    parts = [(data_v, data)] + ([(scale_v, scales)] if fmt.scale_bytes else [])
    v2 = vllm_ascend_op(SCATTER_V2)
    for var, rows_part in parts:
        if v2 is not None:  # writes through var's strides: no contiguous round trip of the view
            call_fn(SCATTER_V2, v2, var.view(torch.int8), index,
                    rows_part.contiguous().view(torch.int8))
        else:
            call("npu_scatter_nd_update_", var.view(torch.int8), index,
                 rows_part.contiguous().view(torch.int8))


@register_op(KV_GATHER, "npu")
def kv_gather(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    """The reference gather (row indexing + the format's decode in tensor ops): no torch_npu
    operator is needed for it; registered so that an insert and a gather always pair up."""
    return paged.gather_rows(cache, slots, fmt)


@register_op(QNORM_ROPE_KV_INSERT, "npu")
def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, eps: float, window_cache: torch.Tensor,
                         window_slots: torch.Tensor, fmt) -> torch.Tensor:
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[0] != q.shape[0] or kv.shape[1] != q.shape[2] \
            or fmt.dim != kv.shape[1] or q.dtype == torch.float64:
        # bad shapes raise the contract's error there; float64 (oracle path) has no NPU dtype
        return ref_fused.qnorm_rope_kv_insert(q, kv, positions, cos_sin, eps, window_cache,
                                              window_slots, fmt)
    q_out = rope(rms_norm(q.float(), None, eps), positions, cos_sin).to(q.dtype)
    k = rope(kv.float(), positions, cos_sin)
    kv_insert(window_cache, window_slots, k, fmt)
    return q_out


@register_op(COMPRESSOR_STORE, "npu")
def compressor_store(kv, score, positions, ape, state, state_slots, group_rows, ratio,
                     norm_weight, eps, cos_sin, group_entry_index, cache, cache_slots,
                     fmt) -> None:
    entries = api.compressor_pool(kv, score, positions, ape, state, state_slots, group_rows, ratio)
    if entries.shape[0] == 0:
        return
    entries = rms_norm(entries, norm_weight, eps)
    rope_pos = group_entry_index.to(device=entries.device, dtype=torch.int64) * ratio
    entries = rope(entries, rope_pos, cos_sin)
    kv_insert(cache, cache_slots.to(device=entries.device, dtype=torch.int64), entries, fmt)
