# SPDX-License-Identifier: Apache-2.0
"""The product's DeepSeek V4 layers at real dimensions with random weights in the checkpoints'
formats, for the decode benchmarks.

Nothing here is a copy of a layer: the attention layers are
:class:`vllm_dsv4_hw.attention.layer.DSV4Attention` (the class ``vllm serve`` runs, built on vLLM's
linear layers with the plugin's FP8 block method), the whole-model stack is
:class:`vllm_dsv4_hw.model.network.DSV4Network` (mHC, MoE with FP4 experts, FP8 shared expert,
head). Their random weights are generated on the device as the official checkpoint stores them
(``tools.checkpoint.random_tensors``: e4m3 + ue8m0 128x128 blocks, FP4 e2m1 experts, bf16 / fp32
elsewhere) and loaded through the product's loader, so the benchmark runs the resident formats.

:class:`AttentionStack` is the attention-only benchmark of issue 6 (a pre-norm residual stream
``h = h + attn(RMSNorm(h))`` between the layers; MoE, mHC, embedding and head left out).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.layer import DSV4Attention
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.model.loader import load_weights
from vllm_dsv4_hw.model.network import DSV4Network
from vllm_dsv4_hw.parallel import ParallelLayout
from vllm_dsv4_hw.quant.scheme import SHIPPED, shipped
from vllm_dsv4_hw.tools.checkpoint import random_tensors
from vllm_dsv4_hw.tools.checkpoint_layout import (
    attention_specs,
    hf_dict_of,
    layer_specs,
    tensor_specs,
)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters: what one decode step reads from its weights."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _strip(prefix: str, tensors):
    n = len(prefix) + 1
    for name, t in tensors:
        yield name[n:], t


def build_layer(
    cfg: DSV4Config,
    layer_id: int,
    *,
    device: torch.device,
    seed: int,
    max_positions: int,
    dtype=torch.bfloat16,
) -> DSV4Attention:
    """One attention layer of ``shipped(cfg)``, random weights loaded through the loader."""
    cfg = shipped(cfg)
    prefix = f"layers.{layer_id}.attn"
    with torch.device(device):
        layer = DSV4Attention(
            cfg, layer_id, dtype=dtype, max_positions=max_positions, device=device, prefix=prefix
        )
    specs = attention_specs(prefix, hf_dict_of(cfg), cfg.compress_ratios[layer_id])
    load_weights(layer, _strip(prefix, random_tensors(specs, "fp8", seed, device)))
    return layer.requires_grad_(False)


class AttentionStack(nn.Module):
    """The attention layers of a model (or of its first ``n`` layers) with their attn_norm
    weights; ``forward`` runs one step over the residual stream."""

    def __init__(
        self, cfg: DSV4Config, device: torch.device, max_positions: int, seed: int = 0
    ) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers = nn.ModuleList(
            build_layer(cfg, i, device=device, seed=seed, max_positions=max_positions)
            for i in range(cfg.num_layers)
        )
        self.attn_norms = nn.ParameterList()
        for _ in range(cfg.num_layers):
            w = 1 + 0.1 * torch.randn(cfg.hidden_size, device=device, generator=gen)
            self.attn_norms.append(nn.Parameter(w.to(torch.bfloat16), requires_grad=False))
        self.ratios = tuple(cfg.compress_ratios)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.ratios:
            k = kind_of(r).name
            out[k] = out.get(k, 0) + 1
        return out

    def weight_bytes_by_kind(self) -> dict[str, int]:
        """Per layer kind: the bytes of ONE layer (they are identical within a kind)."""
        out: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            k = layer.kind.name
            if k not in out:
                out[k] = resident_bytes(layer) + self.attn_norms[i].numel() * 2
        return out

    def total_weight_bytes(self) -> int:
        return sum(resident_bytes(layer) for layer in self.layers) + sum(
            w.numel() * w.element_size() for w in self.attn_norms
        )

    @torch.no_grad()
    def run(self, h: torch.Tensor, metas: dict, caches: list, layer_ids=None) -> torch.Tensor:
        """One step: ``metas[ratio]`` is the StepMetadata of each layer kind, ``caches[i]`` the
        LayerCaches of layer i. Returns the new residual stream (a new tensor)."""
        eps = self.cfg.rms_norm_eps
        ids = range(len(self.layers)) if layer_ids is None else layer_ids
        for i in ids:
            layer = self.layers[i]
            a = ops.rms_norm(h, self.attn_norms[i], eps)
            h = h + layer(a, metas[layer.ratio], caches[i])
        return h


def build_network(
    cfg: DSV4Config,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    layout: ParallelLayout = ParallelLayout(),
) -> DSV4Network:
    """The whole network of ``shipped(cfg)`` (mHC, MoE with FP4 experts, FP8 shared expert, head;
    no MTP), random weights in the checkpoint formats loaded through the loader, layer by layer
    (``layout``: this rank's shard of it; every rank draws the same whole tensors)."""
    cfg = shipped(cfg)
    with torch.device(device):
        net = DSV4Network(
            cfg,
            lambda i, r: DSV4Attention(
                cfg,
                i,
                dtype=torch.bfloat16,
                max_positions=max_positions,
                device=device,
                layout=layout,
                prefix=f"layers.{i}.attn",
            ),
            dtype=torch.bfloat16,
            device=device,
            layout=layout,
        )
    d = hf_dict_of(cfg)
    top = [
        s for s in tensor_specs(dict(d, num_hidden_layers=0, compress_ratios=[]), include_mtp=False)
    ]

    def tensors():
        yield from random_tensors(top, "fp8", seed, device)
        for i in range(cfg.num_layers):
            yield from random_tensors(layer_specs(d, i), "fp8", seed, device)

    load_weights(net, tensors(), cfg)
    return net.requires_grad_(False)


__all__ = ["AttentionStack", "SHIPPED", "build_layer", "build_network", "resident_bytes", "shipped"]
