# SPDX-License-Identifier: Apache-2.0
"""Weight formats of the official DeepSeek V4 checkpoints: block FP8 linears and MXFP4 experts.

* **FP8 linear** (``name.weight`` + ``name.scale``): the weight ``[N, K]`` is ``float8_e4m3fn``; the
  scale ``[ceil(N/128), ceil(K/128)]`` is ``float8_e8m0fnu`` (ue8m0: one exponent byte, value
  ``2^(byte-127)``), one per 128x128 block. Dequantized weight = ``e4m3 * scale`` of its block.
  Quantization (the official / DeepGEMM ue8m0 recipe): per block ``s = 2^ceil(log2(amax / 448))``,
  ``q = e4m3(clamp(w / s, -448, 448))`` with round-to-nearest-even.
* **FP4 routed expert** (``experts.E.wN.weight`` + ``.scale``): the weight ``[N, K]`` is stored as
  ``int8 [N, K/2]``, two e2m1 codes per byte, element ``2j`` in the **low** nibble and ``2j+1`` in
  the high nibble (bit 3 sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by code 0..7); the scale
  ``[N, K/32]`` is ``float8_e8m0fnu``, one per 32 consecutive elements along K.
  Quantization: per 32-block ``s = 2^ceil(log2(amax / 6))``, each ``w / s`` rounded to the nearest
  e2m1 value (ties to the even code, saturating at 6).

Both dequantize exactly into bf16 (a power-of-two scale times a value with at most 3 mantissa bits),
which the checkpoint generator uses to make its bf16 checkpoints hold the very weights its FP8
checkpoints encode.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.numerics import (
    E2M1_MAX,
    FP4_BLOCK,
    FP8_E4M3_MAX,
    FP8_WEIGHT_BLOCK,
    WEIGHT_AMAX_FLOOR,
    ceil_log2,
    e2m1_decode,
    e2m1_encode,
    e8m0_from_exponent,
    pack_nibbles,
    pow2,
    ue8m0_decode,
    unpack_nibbles,
)


def _check_matrix(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError(f"{what}: weight has non-finite values")
    return w


def _pad_to(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = w.shape
    if (n, k) == (rows, cols):
        return w
    out = w.new_zeros(rows, cols)
    out[:n, :k] = w
    return out


def quantize_fp8_block(
    w: torch.Tensor, block: int = FP8_WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (``float8_e4m3fn [N, K]``, ``float8_e8m0fnu [ceil(N/b), ceil(K/b)]``)."""
    w = _check_matrix(w, "fp8 block quantization")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    blocks = _pad_to(w, nb * block, kb * block).reshape(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(WEIGHT_AMAX_FLOOR)
    e = ceil_log2(amax / FP8_E4M3_MAX)
    s = pow2(e)[:, None, :, None]
    q = (blocks / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(nb * block, kb * block)[:n, :k].contiguous()
    return q, e8m0_from_exponent(e)


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block: int = FP8_WEIGHT_BLOCK
) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block``: float32 ``[N, K]``."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(
            f"fp8 weight must be a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}"
        )
    n, k = q.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 scale must be {want} for a {(n, k)} weight, got {tuple(scale.shape)}"
        )
    s = ue8m0_decode(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def quantize_fp4_experts(
    w: torch.Tensor, block: int = FP4_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (K a multiple of 32) -> (``int8 [N, K/2]``, ``float8_e8m0fnu [N, K/32]``)."""
    w = _check_matrix(w, "fp4 expert quantization")
    n, k = w.shape
    if k % block:
        raise ValueError(f"fp4 expert weight: K={k} is not a multiple of {block}")
    blocks = w.reshape(n, k // block, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(WEIGHT_AMAX_FLOOR)
    e = ceil_log2(amax / E2M1_MAX)
    codes = e2m1_encode(blocks / pow2(e).unsqueeze(-1)).reshape(n, k)
    return pack_nibbles(codes).view(torch.int8), e8m0_from_exponent(e)


def dequantize_fp4_experts(
    packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK
) -> torch.Tensor:
    """Inverse of ``quantize_fp4_experts``: float32 ``[N, K]``."""
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"fp4 weight must be a 2-D int8/uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    n, half = packed.shape
    k = 2 * half
    if tuple(scale.shape) != (n, k // block):
        raise ValueError(
            f"fp4 scale must be {(n, k // block)} for a {(n, k)} weight, got {tuple(scale.shape)}"
        )
    vals = e2m1_decode(unpack_nibbles(packed.view(torch.uint8))).reshape(n, k // block, block)
    return (vals * ue8m0_decode(scale).unsqueeze(-1)).reshape(n, k)


def fp8_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight an FP8 block checkpoint of ``w`` encodes."""
    return dequantize_fp8_block(*quantize_fp8_block(w))


def fp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight an MXFP4 expert checkpoint of ``w`` encodes."""
    return dequantize_fp4_experts(*quantize_fp4_experts(w))
