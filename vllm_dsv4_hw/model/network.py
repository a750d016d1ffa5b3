# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek V4 network around attention, in plain PyTorch (no vLLM compiled ops, no CUDA).

``DSV4Network(cfg, make_attention)`` holds the official parameter names::

    embed.weight [V, D]
    layers.N.attn.*                     the caller's attention module (``make_attention(N, ratio)``)
    layers.N.attn_norm.weight, layers.N.ffn_norm.weight
    layers.N.hc_attn_{fn,base,scale}, layers.N.hc_ffn_{fn,base,scale}   (fp32)
    layers.N.ffn.*                      the MoE block (``moe.DSV4MoE``)
    norm.weight, hc_head_{fn,base,scale}, head.weight [V, D]

Forward of ``input_ids [T]`` (one step of any mix of requests; the attention module knows their
positions and caches from a context its owner sets before the call)::

    h = embed(ids) repeated over hc_mult streams                      [T, hc, D]
    per layer:  x, post, comb = hc_pre(h, hc_attn);  a = attn(RMSNorm_attn_norm(x))
                h = hc_post(a, h, post, comb)
                x, post, comb = hc_pre(h, hc_ffn);   f = ffn(RMSNorm_ffn_norm(x), ids)
                h = hc_post(f, h, post, comb)
                (as the ops hc_pre, hc_seam and hc_post, each pre with its RMSNorm; a layer's
                last post and the next layer's first pre are one hc_seam)
    hidden = RMSNorm_norm(hc_head(h))                                   [T, D]
    logits = head(hidden) (float32)                                     [T, V]

(see ``mhc`` and ``moe`` for the pieces). The RMSNorms are ``ops.rms_norm`` (fp32 math).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.config import DSV4Config, validate_hf_config
from vllm_dsv4_hw.model.mhc import hc_head, hc_math_dtype
from vllm_dsv4_hw.model.moe import DSV4MoE
from vllm_dsv4_hw.model.vocab import DSV4Embedding, DSV4Head
from vllm_dsv4_hw.parallel import ParallelLayout
from vllm_dsv4_hw.quant.config import DSV4HwQuantConfig

__all__ = [
    "Carry",
    "DSV4DecoderLayer",
    "DSV4Network",
    "MakeAttention",
    "RMSNormParam",
    "finish_carry",
]

# make_attention(layer_id, compress_ratio) -> module with forward(x [T, D]) -> [T, D]
MakeAttention = Callable[[int, int], nn.Module]


# A layer's MoE output with the post / comb mixes that fold it into the streams: (f [T, D] in the
# MoE's math dtype, post [T, hc], comb [T, hc, hc])
Carry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def finish_carry(h: torch.Tensor, carry: Carry) -> torch.Tensor:
    """The streams with a layer's pending MoE post applied (``ops.hc_post``)."""
    f, post, comb = carry
    return ops.hc_post(f, h, post, comb)


class RMSNormParam(nn.Module):
    """An RMSNorm weight (``<name>.weight``); the norm itself is ``ops.rms_norm``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def _hc_params(
    module: nn.Module, prefix: str, cfg: DSV4Config, n_mix: int, n_scale: int, dtype: torch.dtype
) -> None:
    hc, d = cfg.hc_mult, cfg.hidden_size
    module.register_parameter(
        prefix + "_fn", nn.Parameter(torch.empty(n_mix, hc * d, dtype=dtype), requires_grad=False)
    )
    module.register_parameter(
        prefix + "_base", nn.Parameter(torch.empty(n_mix, dtype=dtype), requires_grad=False)
    )
    module.register_parameter(
        prefix + "_scale", nn.Parameter(torch.empty(n_scale, dtype=dtype), requires_grad=False)
    )


class DSV4DecoderLayer(nn.Module):
    """``layers.N``: mHC around attention and around the MoE block."""

    def __init__(
        self,
        cfg: DSV4Config,
        layer_id: int,
        attn: nn.Module,
        dtype: torch.dtype,
        quant_config: DSV4HwQuantConfig | None = None,
        layout: ParallelLayout = ParallelLayout(),
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        self.hc_mult = cfg.hc_mult
        self.sinkhorn_iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.attn = attn
        self.attn_norm = RMSNormParam(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ffn = DSV4MoE(cfg, layer_id, dtype, quant_config, f"layers.{layer_id}.ffn", layout)
        self.ffn_norm = RMSNormParam(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        hc_dtype = hc_math_dtype(dtype)
        n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
        _hc_params(self, "hc_attn", cfg, n_mix, 3, hc_dtype)
        _hc_params(self, "hc_ffn", cfg, n_mix, 3, hc_dtype)

    def _mix(self, which: str) -> tuple:
        """The mix parameters of ``which`` ("hc_attn" / "hc_ffn") and its sub-block's norm."""
        norm = self.attn_norm if which == "hc_attn" else self.ffn_norm
        return (
            getattr(self, which + "_fn"),
            getattr(self, which + "_scale"),
            getattr(self, which + "_base"),
            norm.weight,
            self.sinkhorn_iters,
            self.hc_eps,
            self.norm_eps,
        )

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Streams ``h [T, hc, D]`` -> new streams (same shape and dtype): this layer alone."""
        return finish_carry(*self.forward_carried(h, input_ids, None))

    def forward_carried(
        self, h: torch.Tensor, input_ids: torch.Tensor | None, carry: Carry | None
    ) -> tuple[torch.Tensor, Carry]:
        """The layer with its MoE's post left to the next mHC op (``DSV4Network`` chains layers
        so: one seam between two layers instead of a post and a pre). ``carry``: the previous
        layer's ``(f, post, comb)``, not yet applied to ``h``. Returns ``(h, carry)`` likewise.
        Two mHC ops: attention's pre (the seam from the previous layer, with its RMSNorm) and the
        seam between attention and MoE."""
        if carry is None:
            x, post, comb = ops.hc_pre(h, *self._mix("hc_attn"))
        else:
            f, post, comb = carry
            h, x, post, comb = ops.hc_seam(f, h, post, comb, *self._mix("hc_attn"))
        a = self.attn(x)
        h, x, post, comb = ops.hc_seam(a, h, post, comb, *self._mix("hc_ffn"))
        return h, (self.ffn(x, input_ids), post, comb)

    def extra_repr(self) -> str:
        return f"layer={self.layer_id}, ratio={self.ratio}, hc_mult={self.hc_mult}"


class DSV4Network(nn.Module):
    """The whole DeepSeek V4 main model (no MTP layer) around caller-supplied attention modules.

    cfg: a checkpoint's config.json dict (validated by ``validate_hf_config``) or a DSV4Config.
    make_attention(layer_id, ratio) -> nn.Module owning the ``layers.N.attn.*`` parameters and
    mapping ``x [T, D]`` (``dtype``) to ``[T, D]``. ``dtype``: embeddings, norms, experts and head
    (the mHC mixes, the router weight and bias stay fp32, or fp64 for an fp64 network).
    ``quant_config``: the method of the linears the checkpoint quantizes (default: from
    ``cfg.weights``, the formats its config.json declares); routed experts follow ``cfg.weights``.
    ``layout``: this rank's share (``parallel``; default: vLLM's tensor-parallel state, no
    expert parallelism); ``make_attention`` must build its layers for the same layout.
    """

    def __init__(
        self,
        cfg: DSV4Config | dict,
        make_attention: MakeAttention,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        quant_config: DSV4HwQuantConfig | None = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        super().__init__()
        if isinstance(cfg, dict):
            cfg = validate_hf_config(cfg)
        if not isinstance(cfg, DSV4Config):
            raise TypeError(
                f"cfg must be a DSV4Config or a config.json dict, got {type(cfg).__name__}"
            )
        self.cfg = cfg
        self.dtype = dtype
        d, v = cfg.hidden_size, cfg.vocab_size
        if quant_config is None:
            quant_config = DSV4HwQuantConfig(cfg.weights)
        self.quant_config = quant_config
        self.layout = layout if layout is not None else ParallelLayout()
        self.layout.check_matches_vllm()
        self.embed = DSV4Embedding(v, d, dtype, self.layout.sharded)
        layers = []
        for i, ratio in enumerate(cfg.compress_ratios):
            attn = make_attention(i, ratio)
            if not isinstance(attn, nn.Module):
                raise TypeError(
                    f"make_attention({i}, {ratio}) returned {type(attn).__name__}, not an nn.Module"
                )
            layers.append(DSV4DecoderLayer(cfg, i, attn, dtype, quant_config, self.layout))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNormParam(d, cfg.rms_norm_eps, dtype)
        _hc_params(self, "hc_head", cfg, cfg.hc_mult, 1, hc_math_dtype(dtype))
        self.head = DSV4Head(v, d, dtype, self.layout.sharded)
        if device is not None:
            self.to(device)

    # -- forward ------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids [T]`` int64 -> final hidden states ``[T, D]`` (model dtype).

        ``inputs_embeds [T, D]`` replaces the embedding lookup (input_ids are still needed by the
        hash-routed MoE layers)."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T], got {tuple(input_ids.shape)}")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        carry = None
        for layer in self.layers:
            h, carry = layer.forward_carried(h, input_ids, carry)
        y = hc_head(
            finish_carry(h, carry),
            self.hc_head_fn,
            self.hc_head_scale,
            self.hc_head_base,
            hc_eps=self.cfg.hc_eps,
            norm_eps=self.cfg.rms_norm_eps,
        )
        return self.norm(y)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, D]`` -> ``[T, V]`` float32 logits (the whole vocabulary on every rank)."""
        return self.head.logits(hidden)

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Official checkpoint tensors -> parameters (see ``model.loader.load_weights``)."""
        from vllm_dsv4_hw.model.loader import load_weights

        return load_weights(self, weights, self.cfg)

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"layers={c.num_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"experts={c.n_routed_experts}x top{c.num_experts_per_tok}, dtype={self.dtype}"
        )
