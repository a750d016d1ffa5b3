# SPDX-License-Identifier: Apache-2.0
"""npu ``kv_insert``, ``kv_gather``: paged caches.

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
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.ops.api import KV_GATHER, KV_INSERT
from vllm_dsv4_hw.ops.npu._vendor import call, call_fn, npu_op, vllm_ascend_op
from vllm_dsv4_hw.ops.reference import kv_cache as ref_kv
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
            call_fn(
                SCATTER_V2, v2, var.view(torch.int8), index, rows_part.contiguous().view(torch.int8)
            )
        else:
            call(
                "npu_scatter_nd_update_",
                var.view(torch.int8),
                index,
                rows_part.contiguous().view(torch.int8),
            )


@register_op(KV_GATHER, "npu")
def kv_gather(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    """The reference gather (row indexing + the format's decode in tensor ops): no torch_npu
    operator is needed for it; registered so that an insert and a gather always pair up."""
    return paged.gather_rows(cache, slots, fmt)
