"""bf16 entries: main KV (dim 512, 1024 B) and indexer keys (dim 128, 256 B). No scale part.

Entry bytes: the ``dim`` values as little-endian bf16 (round to nearest even from wider inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat
from vllm_dsv4_hw.kv_cache.formats.fp8_ds_mla import (
    bf16_bytes,
    bf16_from_bytes,
    check_parts,
    check_rows,
)


def _scaleless_page_views(fmt: EntryFormat, cache: torch.Tensor):
    """``EntryFormat.page_views`` for formats with ``scale_bytes == 0`` (the base view(-1, E, 0)
    of an empty slice is ambiguous in torch, so the page count is given explicitly)."""
    if cache.dtype != torch.uint8 or cache.dim() != 2:
        raise ValueError(f"{fmt.name}: cache must be uint8 [num_pages, page_bytes], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if cache.shape[1] < fmt.min_page_bytes:
        raise ValueError(f"{fmt.name}: page of {cache.shape[1]} B < {fmt.min_page_bytes} B")
    p, e = cache.shape[0], fmt.entries_per_page
    data = cache[:, : e * fmt.data_bytes].view(p, e, fmt.data_bytes)
    start = e * fmt.data_bytes
    scales = cache[:, start:start].view(p, e, 0)
    return data, scales


@dataclass(frozen=True)
class BF16Format(EntryFormat):
    """``dim`` bf16 values per entry (512 main: 1024 B; 128 indexer: 256 B)."""

    name: str = field(default="bf16", init=False)
    dim: int = 512
    data_bytes: int = field(default=1024, init=False)
    scale_bytes: int = field(default=0, init=False)
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        if self.dim <= 0:
            raise ValueError(f"{self.name}: dim must be > 0, got {self.dim}")
        if self.entries_per_page <= 0:
            raise ValueError(f"{self.name}: entries_per_page must be > 0, got {self.entries_per_page}")
        object.__setattr__(self, "data_bytes", 2 * self.dim)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = check_rows(self, x)
        data = bf16_bytes(xf)
        return data, data.new_empty(*data.shape[:-1], 0)

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        return bf16_from_bytes(data)

    def page_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _scaleless_page_views(self, cache)
