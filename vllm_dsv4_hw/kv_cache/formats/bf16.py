# SPDX-License-Identifier: Apache-2.0
"""bf16 entries: main KV (dim 512, 1024 B) and indexer keys (dim 128, 256 B). No scale part.

Entry bytes: the ``dim`` values as little-endian bf16 (round to nearest even from wider inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat, check_parts, check_rows
from vllm_dsv4_hw.numerics import bf16_bytes, bf16_from_bytes


@dataclass(frozen=True)
class BF16Format(EntryFormat):
    """``dim`` bf16 values per entry (512 main: 1024 B; 128 indexer: 256 B)."""

    name: str = field(default="bf16", init=False)
    dim: int = 512
    data_bytes: int = field(default=1024, init=False)
    scale_bytes: int = field(default=0, init=False)
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        self._init_geometry(2 * self.dim)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = check_rows(self, x)
        data = bf16_bytes(xf)
        return data, data.new_empty(*data.shape[:-1], 0)

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        return bf16_from_bytes(data)
