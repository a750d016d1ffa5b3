"""The DeepSeek V4 attention stack of a preset at real dimensions, random weights, FP8 where the
checkpoints are FP8.

Per layer (``layers.N.attn`` of the official checkpoint): ``wq_a``, ``wkv``, ``wq_b``, ``wo_a`` (per
output group), ``wo_b`` and ``indexer.wq_b`` are e4m3 with 128x128 ue8m0 block scales
(:mod:`benchmarks.stack.fp8`); ``compressor.{wkv,wgate}`` (fused into one bf16 GEMM with fp32 output,
as vLLM's ``fused_wkv_wgate``) and ``indexer.weights_proj`` are bf16 (unquantized in the checkpoint);
``ape``, ``attn_sink`` and the compressor norm are fp32; ``q_norm``, ``kv_norm`` and the layer's
``attn_norm`` bf16. The layer itself is :class:`vllm_dsv4_hw.attention.layer.DSV4Attention` (the
dispatched ops over paged caches); this module only swaps the projections for FP8 ones and
overrides the output-projection hook.

Between layers the stack keeps a residual stream ``h`` with a pre-norm: ``h = h + attn(RMSNorm(h))``.
MoE, the shared expert, mHC (hyper-connections) and the embedding / head are left out.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from benchmarks.stack import fp8
from benchmarks.stack.fp8 import FP8GroupedLinear, FP8Linear, mm_f32
from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.layer import DSV4Attention, DSV4Compressor, RMSNormWeight
from vllm_dsv4_hw.config import DSV4Config

KIND_NAMES = {0: "window", 4: "c4a", 128: "c128a"}


class BF16Compressor(DSV4Compressor):
    """``compressor.{wkv, wgate}`` as one bf16 [2*coff*d, hidden] weight, GEMM with fp32 output."""

    def __init__(self, hidden: int, d: int, ratio: int, device, generator) -> None:
        nn.Module.__init__(self)
        self.ratio = ratio
        self.d = d
        self.coff = 2 if ratio == 4 else 1
        w = torch.randn(2 * self.coff * d, hidden, device=device, generator=generator)
        self.wkv_wgate = nn.Parameter(w.div_(math.sqrt(hidden)).to(torch.bfloat16),
                                      requires_grad=False)
        self.ape = nn.Parameter(0.5 * torch.randn(ratio, self.coff * d, device=device,
                                                  generator=generator), requires_grad=False)
        # on the device: a CPU weight is copied every step (and breaks graph capture)
        self.norm = RMSNormWeight(d, torch.float32).to(device)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(d, device=device, generator=generator))

    def step(self, x32, positions, plan, state, cache, fmt, cos_sin, eps) -> None:
        kvs = mm_f32(x32, self.wkv_wgate)
        kv, score = kvs.split(self.coff * self.d, dim=-1)
        ops.compressor_store(kv, score, positions, self.ape, state, plan.state_slots,
                             plan.group_rows, self.ratio, self.norm.weight, eps, cos_sin,
                             plan.group_entry_index, cache, plan.cache_slots, fmt)


class FP8DSV4Attention(DSV4Attention):
    """DSV4Attention with the checkpoint's FP8 projections (random weights)."""

    def _output_projection(self, o: torch.Tensor, pos: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
        t = o.shape[0]
        o = ops.rope(o, pos, self.cos_sin, inverse=True)
        y = self.wo_a(o.reshape(t, self.o_groups, -1))           # [T, G, o_lora]
        return self.wo_b(y.reshape(t, self.o_groups * self.o_lora_rank))


def _normal_(p: torch.Tensor, generator, mean: float, std: float) -> None:
    with torch.no_grad():
        v = torch.randn(p.shape, device=p.device, generator=generator) * std + mean
        p.copy_(v.to(p.dtype))


def build_layer(cfg: DSV4Config, layer_id: int, *, device: torch.device, generator,
                max_positions: int, dtype=torch.bfloat16) -> FP8DSV4Attention:
    h, d = cfg.num_heads, cfg.head_dim
    with torch.device(device):
        layer = FP8DSV4Attention(cfg, layer_id, dtype=dtype, max_positions=max_positions,
                                 device=device)
    dev = device
    layer.wq_a = FP8Linear.random(cfg.q_lora_rank, cfg.hidden_size, dev, generator)
    layer.wkv = FP8Linear.random(d, cfg.hidden_size, dev, generator)
    layer.wq_b = FP8Linear.random(h * d, cfg.q_lora_rank, dev, generator)
    layer.wo_a = FP8GroupedLinear.random(cfg.o_groups, cfg.o_lora_rank, h * d // cfg.o_groups,
                                         dev, generator)
    layer.wo_b = FP8Linear.random(cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank, dev, generator)
    _normal_(layer.q_norm.weight, generator, 1.0, 0.1)
    _normal_(layer.kv_norm.weight, generator, 1.0, 0.1)
    _normal_(layer.attn_sink, generator, 0.0, 1.0)
    if layer.ratio:
        layer.compressor = BF16Compressor(cfg.hidden_size, d, layer.ratio, dev, generator)
    if layer.indexer is not None:
        idx = layer.indexer
        idx.wq_b = FP8Linear.random(idx.n_heads * idx.head_dim, cfg.q_lora_rank, dev, generator)
        _normal_(idx.weights_proj.weight, generator, 0.0, 1.0 / math.sqrt(cfg.hidden_size))
        idx.compressor = BF16Compressor(cfg.hidden_size, idx.head_dim, 4, dev, generator)
    layer.requires_grad_(False)
    return layer


def weight_bytes(module: nn.Module) -> int:
    """Bytes one decode step reads from this module's weights (FP8 values + their fp32 scales,
    bf16 / fp32 parameters); the RoPE table (a few rows per step) is not counted."""
    total = 0
    for m in module.modules():
        if isinstance(m, (FP8Linear, FP8GroupedLinear)):
            total += m.weight.numel() * m.weight.element_size()
            total += m.scale.numel() * m.scale.element_size()
    for _, p in module.named_parameters():
        total += p.numel() * p.element_size()
    return total


class AttentionStack(nn.Module):
    """The attention layers of a model (or of its first ``n`` layers) with their attn_norm
    weights; ``forward`` runs one step over the residual stream."""

    def __init__(self, cfg: DSV4Config, device: torch.device, max_positions: int,
                 seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers = nn.ModuleList(build_layer(cfg, i, device=device, generator=gen,
                                                max_positions=max_positions)
                                    for i in range(cfg.num_layers))
        self.attn_norms = nn.ParameterList()
        for _ in range(cfg.num_layers):
            w = nn.Parameter(torch.empty(cfg.hidden_size, dtype=torch.bfloat16, device=device),
                             requires_grad=False)
            _normal_(w, gen, 1.0, 0.1)
            self.attn_norms.append(w)
        self.ratios = tuple(cfg.compress_ratios)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.ratios:
            out[KIND_NAMES[r]] = out.get(KIND_NAMES[r], 0) + 1
        return out

    def weight_bytes_by_kind(self) -> dict[str, int]:
        """Per layer kind: the bytes of ONE layer (they are identical within a kind)."""
        out: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            k = KIND_NAMES[layer.ratio]
            if k not in out:
                out[k] = weight_bytes(layer) + self.attn_norms[i].numel() * 2
        return out

    def total_weight_bytes(self) -> int:
        return sum(weight_bytes(layer) for layer in self.layers) + \
            sum(w.numel() * w.element_size() for w in self.attn_norms)

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


__all__ = ["AttentionStack", "BF16Compressor", "FP8DSV4Attention", "KIND_NAMES", "build_layer",
           "weight_bytes", "fp8"]
