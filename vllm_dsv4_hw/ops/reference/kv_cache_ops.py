"""Reference ``kv_insert`` / ``kv_gather``: quantize rows into, and dequantize rows out of, a paged
cache through its entry format (``kv_cache.paged``). Runs on every device (integer bit codecs)."""

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
