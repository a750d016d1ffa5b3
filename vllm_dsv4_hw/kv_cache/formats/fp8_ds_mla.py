"""``fp8_ds_mla``: the fp8 main-KV entry (584 B) and the bit-exact codecs the fp8 formats share.

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

The codecs below work on integer bit patterns only (no float8 dtype needed), so they run on every
device, including ones without fp8 types (Ascend); tests check them against torch's float8_e4m3fn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat

FP8_E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # vLLM / official: fmaxf(amax, 1e-4) before computing the scale


# -- shared input checks ------------------------------------------------------------------------
def check_rows(fmt: EntryFormat, x: torch.Tensor) -> torch.Tensor:
    """Validate ``x [..., fmt.dim]`` (floating) and return it as float32."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fmt.name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{fmt.name}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != fmt.dim:
        raise ValueError(
            f"{fmt.name}: x must be [N, {fmt.dim}] (last dim = format dim {fmt.dim}), "
            f"got shape {tuple(x.shape)}"
        )
    return x.float()


def check_parts(fmt: EntryFormat, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Validate ``data [..., data_bytes]`` and ``scales [..., scale_bytes]`` (uint8)."""
    for what, t, width in (("data", data, fmt.data_bytes), ("scales", scales, fmt.scale_bytes)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fmt.name}: {what} must be a uint8 tensor, got {got}")
        if t.dim() < 1 or t.shape[-1] != width:
            raise ValueError(
                f"{fmt.name}: {what} must be [N, {width}], got shape {tuple(t.shape)}"
            )
    if data.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"{fmt.name}: data {tuple(data.shape)} and scales {tuple(scales.shape)} disagree on rows"
        )


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (round to nearest even) -> fp32."""
    return x.to(torch.bfloat16).float()


# -- powers of two and ue8m0 --------------------------------------------------------------------
def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^e for integer ``e`` (-149 <= e <= 127 finite; e >= 128 gives inf)."""
    e = e.to(torch.int32)
    normal = (e.clamp(-126, 128) + 127) << 23
    sub = torch.ones_like(e) << (e.clamp(-149, -127) + 149)
    bits = torch.where(e >= -126, normal, sub)
    bits = torch.where(e < -149, torch.zeros_like(bits), bits)
    return bits.view(torch.float32)


def ceil_log2(r: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(r))`` (int32) for positive normal float32 ``r`` (read from its bits)."""
    bits = r.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return exp - 127 + (frac != 0).to(torch.int32)


def ue8m0_encode(e: torch.Tensor) -> torch.Tensor:
    """Exponent -> ue8m0 byte ``clamp(e + 127, 0, 255)``."""
    return (e.to(torch.int32) + 127).clamp(0, 255).to(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte -> float32 scale ``2^(b - 127)`` (byte 255 -> inf)."""
    return pow2(b.to(torch.int32) - 127)


# -- e4m3 (OCP float8_e4m3fn) -------------------------------------------------------------------
def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 with ``|v| <= 448`` -> e4m3fn bit patterns (uint8), round to nearest even.

    Callers clamp to +-448 first (values above would need saturation or become NaN). The sign bit
    follows IEEE (``-0.0`` and negatives that round to zero give 0x80), as torch's cast does.
    """
    v = v.float().contiguous()
    a = v.abs()
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127  # unbiased exponent of |v|
    e = e.clamp(min=-6)  # below 2^-6 the e4m3 subnormal spacing 2^-9 applies
    m = torch.round(a * pow2(3 - e)).to(torch.int32)  # |v| / 2^(e-3), ties to even
    code = (e + 6) * 8 + m  # continuous across binades: m == 16 rolls into the next exponent
    code = code | (torch.signbit(v).to(torch.int32) << 7)
    return code.to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """e4m3fn bit patterns (uint8) -> float32 (0x7F / 0xFF -> NaN)."""
    c = code.to(torch.int32)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    mag = torch.where(exp == 0, man, man + 8).to(torch.float32) * pow2(
        torch.where(exp == 0, torch.full_like(exp, -9), exp - 10)
    )
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag)


def fp8_block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``x [..., nb, bs]`` (fp32) -> (e4m3 codes [..., nb, bs] u8, exponents [..., nb] int32)
    with the power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` per block."""
    amax = x.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    e = ceil_log2(amax / FP8_E4M3_MAX)
    q = (x / pow2(e).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return e4m3_encode(q), e


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` -> bf16 little-endian bytes ``[..., 2n]`` (round to nearest even)."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def bf16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., 2n]`` -> float32 ``[..., n]``."""
    return b.contiguous().view(torch.bfloat16).float()


@dataclass(frozen=True)
class FP8DSMLAFormat(EntryFormat):
    """vLLM's ``fp8_ds_mla`` main-KV entry: 448 e4m3 + 64 bf16 rope dims + 7 ue8m0 + 1 pad."""

    NOPE_DIM: ClassVar[int] = 448
    ROPE_DIM: ClassVar[int] = 64
    BLOCK: ClassVar[int] = 64
    NUM_BLOCKS: ClassVar[int] = 7

    name: str = field(default="fp8_ds_mla", init=False)
    dim: int = field(default=512, init=False)
    data_bytes: int = field(default=576, init=False)  # 448 e4m3 + 128 B of bf16 rope dims
    scale_bytes: int = field(default=8, init=False)  # 7 ue8m0 + 1 zero pad
    entries_per_page: int = 64

    def __post_init__(self) -> None:
        if self.entries_per_page <= 0:
            raise ValueError(f"{self.name}: entries_per_page must be > 0, got {self.entries_per_page}")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = round_to_bf16(check_rows(self, x))
        lead = xf.shape[:-1]
        nope = xf[..., : self.NOPE_DIM].reshape(*lead, self.NUM_BLOCKS, self.BLOCK)
        codes, e = fp8_block_quantize(nope)
        data = torch.cat([codes.reshape(*lead, self.NOPE_DIM), bf16_bytes(xf[..., self.NOPE_DIM:])],
                         dim=-1)
        scales = torch.cat([ue8m0_encode(e), torch.zeros_like(e[..., :1], dtype=torch.uint8)], dim=-1)
        return data, scales

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        check_parts(self, data, scales)
        lead = data.shape[:-1]
        vals = e4m3_decode(data[..., : self.NOPE_DIM]).reshape(*lead, self.NUM_BLOCKS, self.BLOCK)
        nope = vals * ue8m0_decode(scales[..., : self.NUM_BLOCKS]).unsqueeze(-1)
        rope = bf16_from_bytes(data[..., self.NOPE_DIM:])
        return torch.cat([nope.reshape(*lead, self.NOPE_DIM), rope], dim=-1)
