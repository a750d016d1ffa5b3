# SPDX-License-Identifier: Apache-2.0
"""Tests' access to a module's weights by official checkpoint name (``model.loader``'s mapping:
merged linears such as ``compressor.wkv_wgate`` answer to ``compressor.wkv.weight`` and
``compressor.wgate.weight``), and random weights of a sensible scale for dense test layers."""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_dsv4_hw.model.loader import checkpoint_state


def official_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Official name -> a copy of the module's tensor."""
    return {k: v.detach().clone() for k, v in checkpoint_state(module).items()}


@torch.no_grad()
def assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``module``, keyed by official name or by state_dict key (e.g. the
    stacked ``experts.w13``); every key must land and every shape match."""
    official = checkpoint_state(module)
    state = module.state_dict(keep_vars=True)
    for k, v in tensors.items():
        dest = official[k] if k in official else state[k].data
        assert tuple(dest.shape) == tuple(v.shape), (k, tuple(dest.shape), tuple(v.shape))
        dest.copy_(v)


@torch.no_grad()
def init_random_(
    module: nn.Module, generator: torch.Generator | None = None, std_scale: float = 1.0
) -> nn.Module:
    """Random dense weights (benchmarks, tests): N(0, 1/fan_in) matrices, norms around 1, ape and
    sink N(0, 1/4) / N(0, 1)."""
    for name, p in checkpoint_state(module).items():
        shape = p.shape
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
        elif name.endswith("ape"):
            v = 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
        elif name.endswith("attn_sink"):
            v = torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            v = torch.randn(shape, generator=generator, dtype=torch.float64) * (
                std_scale / math.sqrt(shape[-1])
            )
        p.copy_(v.to(p.dtype))
    return module
