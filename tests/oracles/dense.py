# SPDX-License-Identifier: Apache-2.0
"""Float64 oracles for RMSNorm, RoPE (complex multiplication), YaRN, sink attention."""

from __future__ import annotations

import math

import torch


def rms_norm_oracle(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x64 = x.double()
    ms = (x64 * x64).sum(dim=-1, keepdim=True) / x64.shape[-1]
    y = x64 / torch.sqrt(ms + eps)
    if weight is not None:
        y = y * weight.double()
    return y


def yarn_inv_freq_oracle(
    theta: float,
    dim: int,
    factor: float | None = None,
    original_max_positions: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> list[float]:
    """Per-pair frequencies as plain Python floats, straight from the YaRN formula
    (``factor=None``: plain RoPE)."""
    base = [theta ** (-(2.0 * j) / dim) for j in range(dim // 2)]
    if factor is None:
        return base

    def corr(rot: float) -> float:
        return (
            dim * math.log(original_max_positions / (rot * 2.0 * math.pi)) / (2.0 * math.log(theta))
        )

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for j in range(dim // 2):
        denom = (hi - lo) if hi != lo else 0.001
        ramp = min(max((j - lo) / denom, 0.0), 1.0)
        extrapolation_weight = 1.0 - ramp  # 1 = keep the original frequency
        out.append(base[j] / factor * (1.0 - extrapolation_weight) + base[j] * extrapolation_weight)
    return out


def rope_angles_oracle(positions, inv_freq) -> torch.Tensor:
    """[T, R/2] float64 angles p * f_j."""
    p = torch.as_tensor(positions, dtype=torch.float64).reshape(-1, 1)
    f = torch.as_tensor(inv_freq, dtype=torch.float64).reshape(1, -1)
    return p * f


def rope_oracle(x: torch.Tensor, positions, inv_freq, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE as complex multiplication: (x[2j] + i x[2j+1]) * exp(+-i p f_j) on the last R dims
    of x [T, ..., D]; float64 out."""
    inv = torch.as_tensor(inv_freq, dtype=torch.float64)
    r = 2 * inv.numel()
    x64 = x.double()
    out = x64.clone()
    ang = rope_angles_oracle(positions, inv)  # [T, R/2]
    if inverse:
        ang = -ang
    rot = torch.polar(torch.ones_like(ang), ang)  # complex128 [T, R/2]
    rot = rot.reshape((x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,))
    tail = x64[..., x.shape[-1] - r :]
    z = torch.complex(tail[..., 0::2], tail[..., 1::2]) * rot
    out[..., x.shape[-1] - r :: 2] = z.real
    out[..., x.shape[-1] - r + 1 :: 2] = z.imag
    return out


def dense_attention_with_sink(
    q: torch.Tensor, keys: torch.Tensor, valid_mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D], keys [T, N, D] (K = V), valid_mask [T, N] bool, sink [H] -> [T, H, D] float64.

    Per (t, h): softmax over [scale * q.k_s for valid s] + [sink_h], sink column dropped;
    a token with no valid key gives zeros. Explicit loops.
    """
    q64, k64, s64 = q.double(), keys.double(), sink.double()
    t_n, h_n, d = q64.shape
    out = torch.zeros(t_n, h_n, d, dtype=torch.float64)
    for t in range(t_n):
        idx = [n for n in range(keys.shape[1]) if bool(valid_mask[t, n])]
        if not idx:
            continue
        kt = k64[t, idx]  # [n, D]
        for h in range(h_n):
            logits = (kt @ q64[t, h]) * scale
            all_logits = torch.cat([logits, s64[h].reshape(1)])
            w = torch.softmax(all_logits, dim=0)[:-1]
            out[t, h] = w @ kt
    return out
