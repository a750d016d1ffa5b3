# SPDX-License-Identifier: Apache-2.0
"""``fp8_ds_mla``: the fp8 main-KV entry (584 B).

Entry layout (spec section 5; byte offsets within an entry-contiguous ``encode`` row):

* ``[0, 448)``   dims 0..447 as e4m3 (OCP ``float8_e4m3fn`` bit patterns), 7 blocks of 64 dims;
* ``[448, 576)`` dims 448..511 (the rope dims) as bf16, little-endian;
* ``[576, 583)`` one ue8m0 scale byte per block (byte = exponent + 127, scale = 2^exponent);
* ``583``        padding, always 0.

The data part is bytes ``[0, 576)``, the scale part ``[576, 584)``; in a paged block the data parts
of all entries come first, then the 8-byte scale groups (``EntryFormat.page_views``).

Quantization of a 64-dim block (as vLLM's ``quantize_and_insert_k_cache`` and the official code):
the input is first rounded to bf16 (the official code quantizes bf16 activations; vLLM's fused
compressor casts fp32 -> bf16 -> fp32 "to match reference"), then
``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``q = clamp(x / s, -448, 448)`` rounded to e4m3 with
round-to-nearest-even. Dequantization is ``e4m3(q) * s`` in fp32. Inputs must be finite.

The codecs live in ``vllm_dsv4_hw.numerics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat, check_parts, check_rows
from vllm_dsv4_hw.numerics import (
    KV_FP8_BLOCK,
    bf16_bytes,
    bf16_from_bytes,
    e4m3_decode,
    fp8_block_quantize,
    round_to_bf16,
    ue8m0_decode,
    ue8m0_encode,
)


@dataclass(frozen=True)
class FP8DSMLAFormat(EntryFormat):
    """vLLM's ``fp8_ds_mla`` main-KV entry: 448 e4m3 + 64 bf16 rope dims + 7 ue8m0 + 1 pad."""

    NOPE_DIM: ClassVar[int] = 448
    ROPE_DIM: ClassVar[int] = 64
    BLOCK: ClassVar[int] = KV_FP8_BLOCK
    NUM_BLOCKS: ClassVar[int] = 7

    name: str = field(default="fp8_ds_mla", init=False)
    dim: int = field(default=512, init=False)
    data_bytes: int = field(default=576, init=False)  # 448 e4m3 + 128 B of bf16 rope dims
    scale_bytes: int = field(default=8, init=False)  # 7 ue8m0 + 1 zero pad
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        if self.entries_per_page <= 0:
            raise ValueError(
                f"{self.name}: entries_per_page must be > 0, got {self.entries_per_page}"
            )

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = round_to_bf16(check_rows(self, x))
        lead = xf.shape[:-1]
        nope = xf[..., : self.NOPE_DIM].reshape(*lead, self.NUM_BLOCKS, self.BLOCK)
        codes, e = fp8_block_quantize(nope)
        data = torch.cat(
            [codes.reshape(*lead, self.NOPE_DIM), bf16_bytes(xf[..., self.NOPE_DIM :])], dim=-1
        )
        scales = torch.cat(
            [ue8m0_encode(e), torch.zeros_like(e[..., :1], dtype=torch.uint8)], dim=-1
        )
        return data, scales

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        lead = data.shape[:-1]
        vals = e4m3_decode(data[..., : self.NOPE_DIM]).reshape(*lead, self.NUM_BLOCKS, self.BLOCK)
        nope = vals * ue8m0_decode(scales[..., : self.NUM_BLOCKS]).unsqueeze(-1)
        rope = bf16_from_bytes(data[..., self.NOPE_DIM :])
        return torch.cat([nope.reshape(*lead, self.NOPE_DIM), rope], dim=-1)
