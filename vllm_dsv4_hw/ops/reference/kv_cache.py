# SPDX-License-Identifier: Apache-2.0
"""Reference ``kv_insert`` / ``kv_gather``: quantize rows into, and dequantize rows out of, a paged
cache through its entry format (``kv_cache.paged``); ``entry_slots``: logical entry indices to
slots. Runs on every device (integer bit codecs, torch indexing)."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import register_op


@register_op(api.KV_INSERT, "reference")
def kv_insert(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    paged.insert_rows(cache, slots, x, fmt)


@register_op(api.KV_GATHER, "reference")
def kv_gather(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    return paged.gather_rows(cache, slots, fmt)


@register_op(api.ENTRY_SLOTS, "reference")
def entry_slots(
    block_table: torch.Tensor, token_req: torch.Tensor, idx: torch.Tensor, per_page: int
) -> torch.Tensor:
    idx = idx.to(torch.int64)
    col = idx // per_page
    valid = (idx >= 0) & (col < block_table.shape[1])
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    pages = block_table.to(device=idx.device, dtype=torch.int64)[
        token_req.to(device=idx.device, dtype=torch.int64)[:, None], safe // per_page
    ]
    slots = pages * per_page + safe % per_page
    return torch.where(valid & (pages >= 0), slots, torch.full_like(slots, -1))
