# SPDX-License-Identifier: Apache-2.0
"""fp32: an exact float32 entry format (4 * dim bytes, no scale part).

Not a vLLM or DeepSeek cache format: it exists only for oracle tests and debugging, where the cache
must not add quantization error (gather returns exactly what was inserted, as float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat, check_parts, check_rows


@dataclass(frozen=True)
class FP32Format(EntryFormat):
    """Exact float32 entries (tests and debugging only): ``dim`` little-endian fp32 values."""

    name: str = field(default="fp32", init=False)
    dim: int = 512
    data_bytes: int = field(default=2048, init=False)
    scale_bytes: int = field(default=0, init=False)
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        self._init_geometry(4 * self.dim)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = check_rows(self, x).clone().contiguous().view(torch.uint8)  # never alias x
        return data, data.new_empty(*data.shape[:-1], 0)

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        return data.contiguous().view(torch.float32)
