# SPDX-License-Identifier: Apache-2.0
"""MXFP4 indexer key entry: ``dim`` (128) e2m1 values packed two per byte + one ue8m0 scale per
32-element block (64 + 4 = 68 B for dim 128).

Entry bytes: ``[0, dim/2)`` packed codes; byte ``j`` holds element ``2j`` in its **low** nibble and
element ``2j+1`` in its **high** nibble (vLLM ``_fp32x2_to_fp4x2``: ``cvt.rn.satfinite.e2m1x2.f32``
with the odd element as the high operand). ``[dim/2, dim/2 + dim/32)``: one ue8m0 byte per block
(byte = exponent + 127). Data part = packed codes, scale part = the ue8m0 bytes.

e2m1 nibble: bit 3 sign, bits 2..1 exponent, bit 0 mantissa; magnitudes by code 0..7:
0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantization (vLLM ``_quantize_mxfp4_pair``, official ``kernel.py``): round to bf16; per block of 32
``amax = max(amax, 6 * 2^-126)``, ``e = clamp(ceil(log2(amax / 6)), -127, 127)``, ``s = 2^e``;
each value ``x / s`` is rounded to the nearest e2m1 value, ties to even code, saturating at +-6.
Dequant: ``e2m1 * s``. Inputs must be finite. The codecs live in ``vllm_dsv4_hw.numerics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat, check_parts, check_rows
from vllm_dsv4_hw.numerics import (
    E2M1_MAX,
    FP4_BLOCK,
    MXFP4_AMAX_FLOOR,
    ceil_log2,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    pow2,
    round_to_bf16,
    ue8m0_decode,
    ue8m0_encode,
    unpack_nibbles,
)


@dataclass(frozen=True)
class MXFP4Format(EntryFormat):
    """Indexer key in MXFP4: e2m1 pairs per byte + ue8m0 per 32-block (68 B for dim 128)."""

    BLOCK: ClassVar[int] = FP4_BLOCK

    name: str = field(default="mxfp4", init=False)
    dim: int = 128
    data_bytes: int = field(default=64, init=False)
    scale_bytes: int = field(default=4, init=False)
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        self._init_geometry(self.dim // 2, dim_multiple=self.BLOCK)
        object.__setattr__(self, "scale_bytes", self.dim // self.BLOCK)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = round_to_bf16(check_rows(self, x))
        lead = xf.shape[:-1]
        blocks = xf.reshape(*lead, self.dim // self.BLOCK, self.BLOCK)
        amax = blocks.abs().amax(dim=-1).clamp_min(MXFP4_AMAX_FLOOR)
        e = ceil_log2(amax / E2M1_MAX).clamp(-127, 127)
        codes = e2m1_encode(blocks / pow2(e).unsqueeze(-1)).reshape(*lead, self.dim)
        return pack_nibbles(codes), ue8m0_encode(e)

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        lead = data.shape[:-1]
        vals = e2m1_decode(unpack_nibbles(data)).reshape(*lead, self.dim // self.BLOCK, self.BLOCK)
        return (vals * ue8m0_decode(scales).unsqueeze(-1)).reshape(*lead, self.dim)
