# SPDX-License-Identifier: Apache-2.0
"""Float64 oracles for the peer rows and the error measure both sides are judged by.

The oracle of an op is the product's reference backend evaluated in float64 (the spec's semantics,
``vllm_dsv4_hw/ops/reference``); cache entries are read back with the reference decoder, which is
exact (e4m3 x power-of-two scale, bf16).
"""

from __future__ import annotations

import torch


def ref(op: str):
    import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
    from vllm_dsv4_hw.ops.registry import REGISTRY

    return REGISTRY.implementations(op)["reference"].fn


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| over finite oracle values (NaN in got counts as infinite)."""
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} against the oracle's {tuple(want.shape)}")
    diff = (got - want).abs()
    if torch.isnan(got).any():
        return float("inf")
    scale = want.abs().max().clamp_min(1e-30)
    return float(diff.max() / scale) if diff.numel() else 0.0


def entries(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    """The decoded entries at ``slots`` (float32, exact)."""
    return ref("kv_gather")(cache, slots, fmt)


def dequant_groups(x_fp8: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., D] fp8 with scales [..., D / group] -> float64."""
    return x_fp8.double() * scales.double().repeat_interleave(group, -1)
