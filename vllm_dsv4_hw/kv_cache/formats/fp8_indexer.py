# SPDX-License-Identifier: Apache-2.0
"""FP8 indexer key entry: ``dim`` (128) e4m3 values + one float32 scale (132 B).

Entry bytes: ``[0, dim)`` e4m3 codes (OCP ``float8_e4m3fn``), ``[dim, dim + 4)`` the scale as a
little-endian float32. The data part is the ``dim`` code bytes, the scale part the 4 scale bytes (in a
page: all entries' codes, then all entries' scales), as vLLM's fused indexer compressor writes it.

Quantization (vLLM ``_fused_kv_compress_norm_rope_insert_indexer_attn``): round the key to bf16, then
one block over the whole vector: ``s = 2^ceil(log2(max(amax, 1e-4) / 448))`` (a power of two, stored
in fp32), ``q = clamp(x / s, -448, 448)`` to e4m3 (round to nearest even). Dequant: ``e4m3(q) * s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat, check_parts, check_rows
from vllm_dsv4_hw.numerics import e4m3_decode, fp8_block_quantize, pow2, round_to_bf16


@dataclass(frozen=True)
class FP8IndexerFormat(EntryFormat):
    """Indexer key: ``dim`` e4m3 + one fp32 power-of-two scale (132 B for dim 128)."""

    name: str = field(default="fp8_indexer", init=False)
    dim: int = 128
    data_bytes: int = field(default=128, init=False)
    scale_bytes: int = field(default=4, init=False)
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        self._init_geometry(self.dim)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = round_to_bf16(check_rows(self, x))
        codes, e = fp8_block_quantize(xf.unsqueeze(-2))  # one block: [..., 1, dim]
        scales = pow2(e).contiguous().view(torch.uint8)  # [..., 1] fp32 -> [..., 4] bytes
        return codes.squeeze(-2), scales

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        scale = scales.contiguous().view(torch.float32)  # [..., 1]
        return e4m3_decode(data) * scale
