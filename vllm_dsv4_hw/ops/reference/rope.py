# SPDX-License-Identifier: Apache-2.0
"""Reference RoPE: the cos/sin tables (plain and YaRN), the GPT-J interleaved rotation and the
attention output's epilogue ``inv_rope_fp8_quant`` (inverse rotation, then e4m3 in 128-dim groups).

Table layout (the ``cos_sin`` argument of ``ops.rope``): row p = [cos(p*f_0..p*f_{R/2-1}),
sin(p*f_0..p*f_{R/2-1})], float32. Angles are computed in float64 on the CPU, then cast, so a
table is accurate to fp32 rounding even at positions near 2^20.

YaRN as in the official DeepSeek code (no mscale: cos/sin are not scaled):
  f_j = theta^(-2j/R); low = floor(R*ln(L/(beta_fast*2pi)) / (2 ln theta)),
  high = ceil(R*ln(L/(beta_slow*2pi)) / (2 ln theta)), clamped to [0, R-1] (L = original max positions);
  ramp_j = clamp((j - low) / (high - low), 0, 1) (high += 0.001 when equal);
  f'_j = f_j / factor * ramp_j + f_j * (1 - ramp_j).
"""

from __future__ import annotations

import math

import torch

from vllm_dsv4_hw.config import DSV4Config, YarnParams
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.numerics import FP8_E4M3_MAX, ceil_log2, pow2
from vllm_dsv4_hw.ops.api import INV_ROPE_FP8_QUANT, O_QUANT_AMAX_FLOOR, O_QUANT_GROUP, ROPE
from vllm_dsv4_hw.ops.checks import check_inv_rope_fp8_quant_args, check_rope_args
from vllm_dsv4_hw.ops.registry import register_op

_TABLE_CHUNK = 1 << 15


def rope_inv_freq(theta: float, rope_dim: int, yarn: YarnParams | None = None) -> torch.Tensor:
    """The R/2 rotation frequencies (radians per position) as a float64 CPU tensor."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    if theta <= 1:
        raise ValueError(f"rope theta must be > 1, got {theta}")
    dim = rope_dim
    freqs = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn is None:
        return freqs

    def correction_dim(num_rotations: float) -> float:
        return (
            dim
            * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
    # ramp 0 (high-frequency dims, below `low`): unchanged; ramp 1 (beyond `high`): divided by factor.
    return freqs / yarn.factor * ramp + freqs * (1.0 - ramp)


def rope_cos_sin(
    theta: float,
    rope_dim: int,
    max_positions: int,
    yarn: YarnParams | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[max_positions, rope_dim] float32 table: cos of the R/2 angles, then their sin."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    inv_freq = rope_inv_freq(theta, rope_dim, yarn)
    half = rope_dim // 2
    table = torch.empty(max_positions, rope_dim, dtype=torch.float32)
    # Chunked over positions: float64 temporaries stay small (a full 2^20-row table would need
    # ~0.5 GiB of them).
    for start in range(0, max_positions, _TABLE_CHUNK):
        stop = min(max_positions, start + _TABLE_CHUNK)
        angles = torch.outer(torch.arange(start, stop, dtype=torch.float64), inv_freq)
        table[start:stop, :half] = angles.cos()
        table[start:stop, half:] = angles.sin()
    return table.to(device)


def rope_tables_for(
    cfg: DSV4Config,
    ratio: int,
    max_positions: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The table of a layer with compress ratio ``ratio``: 0 -> ``rope_theta`` without YaRN;
    4 / 128 -> ``compress_rope_theta`` with YaRN (shared by queries, window keys, compressed
    entries and the indexer of that layer). ``max_positions`` defaults to the model's maximum."""
    compressed = kind_of(ratio).compressed
    n = cfg.max_position_embeddings if max_positions is None else max_positions
    if not compressed:
        return rope_cos_sin(cfg.rope_theta, cfg.rope_dim, n, None, device)
    return rope_cos_sin(cfg.compress_rope_theta, cfg.rope_dim, n, cfg.yarn, device)


@register_op(ROPE, "reference")
def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) of the last R dims of x [T, ..., D] by angle_j(positions[t])."""
    check_rope_args(x, positions, cos_sin)
    r = cos_sin.shape[-1]
    half = r // 2
    md = torch.float64 if x.dtype == torch.float64 else torch.float32
    cs = cos_sin[positions.to(device=cos_sin.device, dtype=torch.long)].to(
        device=x.device, dtype=md
    )
    bshape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cs[:, :half].reshape(bshape)
    sin = cs[:, half:].reshape(bshape)
    if inverse:
        sin = -sin
    pairs = x[..., x.shape[-1] - r :].to(md).unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    out = x.clone()
    out[..., x.shape[-1] - r :] = rotated.to(x.dtype)
    return out


@register_op(INV_ROPE_FP8_QUANT, "reference")
def inv_rope_fp8_quant(
    o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inv_rope_fp8_quant_args(o, O_QUANT_GROUP)
    t, h, d = o.shape
    x = rope(o.float(), positions, cos_sin, inverse=inverse)
    xg = x.reshape(t, h, d // O_QUANT_GROUP, O_QUANT_GROUP)
    amax = xg.abs().amax(dim=-1).clamp_min(O_QUANT_AMAX_FLOOR)
    scales = pow2(ceil_log2(amax / FP8_E4M3_MAX))  # exact powers of two, [T, H, D/128] fp32
    q = (xg / scales.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).reshape(t, h, d), scales
