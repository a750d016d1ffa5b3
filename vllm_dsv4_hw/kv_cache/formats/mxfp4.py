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
Dequant: ``e2m1 * s``. Inputs must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat
from vllm_dsv4_hw.kv_cache.formats.fp8_ds_mla import (
    ceil_log2,
    check_parts,
    check_rows,
    pow2,
    round_to_bf16,
    ue8m0_decode,
    ue8m0_encode,
)

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 nibble codes (uint8 in 0..15): nearest value, ties to the even code,
    saturating at +-6; the sign bit follows IEEE (negatives rounding to 0 give 0x8)."""
    a = v.float().abs()
    # Midpoints between consecutive magnitudes; '>' where the lower code is even (tie stays),
    # '>=' where the upper code is even (tie goes up).
    code = ((a > 0.25).to(torch.int32) + (a >= 0.75).to(torch.int32) + (a > 1.25).to(torch.int32)
            + (a >= 1.75).to(torch.int32) + (a > 2.5).to(torch.int32) + (a >= 3.5).to(torch.int32)
            + (a > 5.0).to(torch.int32))
    return (code | (torch.signbit(v).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 nibble codes (0..15) -> float32."""
    lut = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32,
                       device=code.device)
    return lut[code.long() & 0xF]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 2n] (0..15) -> bytes [..., n]: element 2j low nibble, 2j+1 high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n] -> codes [..., 2n] (inverse of ``pack_nibbles``)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


@dataclass(frozen=True)
class MXFP4Format(EntryFormat):
    """Indexer key in MXFP4: e2m1 pairs per byte + ue8m0 per 32-block (68 B for dim 128)."""

    BLOCK: ClassVar[int] = 32

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
