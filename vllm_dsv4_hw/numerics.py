# SPDX-License-Identifier: Apache-2.0
"""The number formats DeepSeek V4 stores: e4m3, e2m1, ue8m0 and bf16, and the block sizes they are
scaled over. One place for every codec and constant the KV-cache entry formats
(``kv_cache.formats``), the checkpoint weight formats (``quant.formats``) and the PyTorch reference
ops share; the Triton and npu kernels implement the same rules on the device (tests compare them
bit for bit with these).

* **e4m3** (OCP ``float8_e4m3fn``): largest finite 448; encode rounds to nearest even.
* **e2m1** (FP4, one nibble: bit 3 sign, bits 2..1 exponent, bit 0 mantissa): magnitudes 0, 0.5, 1,
  1.5, 2, 3, 4, 6 by code 0..7; encode rounds to nearest, ties to the even code, saturating at 6;
  two per byte, element ``2j`` in the low nibble.
* **ue8m0** (``float8_e8m0fnu``): one exponent byte, value ``2^(byte - 127)``; every block scale is a
  power of two, so dequantization is exact.

The codecs work on integer bit patterns (no float8 dtype needed), so they run on every device,
including ones without fp8 types; tests check them against torch's float8 casts.
"""

from __future__ import annotations

import torch

# -- block sizes ---------------------------------------------------------------------------------
FP8_WEIGHT_BLOCK = 128  # FP8 linear weights: one ue8m0 scale per 128x128 block
FP4_BLOCK = 32  # MXFP4 (expert weights, indexer keys): one ue8m0 scale per 32 elements
KV_FP8_BLOCK = 64  # fp8_ds_mla main KV: one ue8m0 scale per 64 dims

# -- limits and amax floors ----------------------------------------------------------------------
FP8_E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # vLLM / official: fmaxf(amax, 1e-4) before computing an activation scale
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126  # vLLM's MXFP4 quantizer: the smallest normal scale
WEIGHT_AMAX_FLOOR = 2.0**-100  # weight quantization: all-zero blocks still get a normal scale


# -- powers of two and ue8m0 ---------------------------------------------------------------------
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
    """ue8m0 bytes (uint8 or ``float8_e8m0fnu``) -> float32 scale ``2^(b - 127)`` (255 -> inf)."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    if b.dtype != torch.uint8:
        raise ValueError(f"ue8m0 scales must be float8_e8m0fnu or uint8, got {b.dtype}")
    return pow2(b.to(torch.int32) - 127)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> ``float8_e8m0fnu`` (byte = e + 127, kept finite: at most 254)."""
    return (e.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


# -- bf16 ----------------------------------------------------------------------------------------
def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (round to nearest even) -> fp32."""
    return x.to(torch.bfloat16).float()


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` -> bf16 little-endian bytes ``[..., 2n]`` (round to nearest even)."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def bf16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., 2n]`` -> float32 ``[..., n]``."""
    return b.contiguous().view(torch.bfloat16).float()


# -- e4m3 (OCP float8_e4m3fn) --------------------------------------------------------------------
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


# -- e2m1 (FP4) ----------------------------------------------------------------------------------
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 nibble codes (uint8 in 0..15): nearest value, ties to the even code,
    saturating at +-6; the sign bit follows IEEE (negatives rounding to 0 give 0x8)."""
    a = v.float().abs()
    # Midpoints between consecutive magnitudes; '>' where the lower code is even (tie stays),
    # '>=' where the upper code is even (tie goes up).
    code = (
        (a > 0.25).to(torch.int32)
        + (a >= 0.75).to(torch.int32)
        + (a > 1.25).to(torch.int32)
        + (a >= 1.75).to(torch.int32)
        + (a > 2.5).to(torch.int32)
        + (a >= 3.5).to(torch.int32)
        + (a > 5.0).to(torch.int32)
    )
    return (code | (torch.signbit(v).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 nibble codes (0..15) -> float32."""
    lut = torch.tensor(
        E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=code.device
    )
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
