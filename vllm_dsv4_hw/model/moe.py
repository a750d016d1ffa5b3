# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek V4 MoE feed-forward block: routing here, the experts' matmuls dispatched.

Parameters (official names under ``layers.N.ffn.``)::

    gate.weight [E, D]                  router projection (bf16 as shipped)
    gate.bias [E] (fp32)                correction bias, top-k layers only ("noaux_tc")
    gate.tid2eid [vocab, k] (int64)     token id -> expert ids, hash-routed layers only
    experts.{e}.w1/w2/w3.weight (+ .scale)  routed experts, stored stacked (``experts.w13``,
                                        ``experts.w2`` and their scales) in the checkpoint's format:
                                        FP4 e2m1 bytes + ue8m0 per-32 scales, or dense
    shared_experts.w1/w2/w3.weight (+ .scale)  the shared expert (intermediate = moe_inter *
                                        n_shared; vLLM linear layers, w1 | w3 merged)

Routing is the op ``moe_route`` (``ops/api.py``): ``s = sqrt(softplus(gate.weight x))`` (fp32);
top-k layers select the k experts with the largest ``s + bias`` (the bias only selects), hash
layers (the first ``num_hash_layers``) take ``tid2eid[token id]``; the weights are the selected
``s`` renormalised to sum 1 (``norm_topk_prob``), times ``routed_scaling_factor``.

Every expert (routed and shared) is a clamped SwiGLU: ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``
with ``L = swiglu_limit`` (the gate is clamped from above only, the up projection on both sides).
The output is ``sum_k weight_k * expert_k(x) + shared(x)``; the activation and the accumulation
run in fp32 (fp64 for fp64 modules). The routed experts are ``ops.moe_experts`` (the reference
dequantizes one expert at a time; the Triton kernel decodes FP4 in registers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.numerics import FP4_BLOCK
from vllm_dsv4_hw.parallel import ParallelLayout
from vllm_dsv4_hw.platform.streams import aux_streams
from vllm_dsv4_hw.quant.config import DSV4HwQuantConfig
from vllm_dsv4_hw.quant.linear import merged_linear, row_linear

__all__ = [
    "CheckpointSlice",
    "DSV4MoE",
    "MoEGate",
    "RoutedExperts",
    "SharedExpert",
    "moe_math_dtype",
]


# The shared expert's side stream: the attention's branches have rejoined before the MoE runs.
BRANCH_SHARED_EXPERT = 0


def moe_math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gate_weight_dtype(math_dtype: torch.dtype) -> torch.dtype:
    """The gate weight as shipped (bf16; fp64 in a float64 network): the router's math is fp32."""
    return torch.float64 if math_dtype == torch.float64 else torch.bfloat16


class MoEGate(nn.Module):
    """``gate.weight`` (+ ``gate.bias`` or ``gate.tid2eid``)."""

    def __init__(self, cfg: DSV4Config, hash_routed: bool, param_dtype: torch.dtype) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(
            torch.empty(e, cfg.hidden_size, dtype=_gate_weight_dtype(param_dtype)),
            requires_grad=False,
        )
        if hash_routed:
            self.bias = None
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64)
            )
        else:
            self.bias = nn.Parameter(torch.zeros(e, dtype=param_dtype), requires_grad=False)
            self.tid2eid = None


class CheckpointSlice(NamedTuple):
    """Where one checkpoint tensor (``name``, relative to the module; shape ``shape``) lands:
    ``tensor[src]`` into ``getattr(module, attr)[dest]``; ``attr`` None: another rank holds it."""

    name: str
    attr: str | None
    dest: tuple
    src: tuple
    shape: tuple


class RoutedExperts(nn.Module):
    """This rank's routed experts, stacked: ``w13 [E, 2I, *]`` (w1 rows, then w3 rows),
    ``w2 [E, D, *]``, for the ``E = len(layout.local_experts)`` experts and the ``I`` rows of
    their intermediate dimension that the layout gives this rank (``parallel``; one rank:
    all of them).

    FP4 (``fp4=True``, as the FP4 checkpoints ship them): ``w13`` uint8 ``[E, 2I, D/2]`` packed
    e2m1 codes + ``w13_scale`` float8_e8m0fnu ``[E, 2I, D/32]``, ``w2`` ``[E, D, I/2]`` +
    ``w2_scale`` ``[E, D, I/32]``; dense: ``w13 [E, 2I, D]`` and ``w2 [E, D, I]`` in ``dtype``.
    Loaded from the per-expert official tensors through :meth:`checkpoint_slices`."""

    def __init__(
        self,
        cfg: DSV4Config,
        dtype: torch.dtype,
        fp4: bool = False,
        layout: ParallelLayout = ParallelLayout(),
    ) -> None:
        super().__init__()
        d, full_i = cfg.hidden_size, cfg.moe_intermediate_size
        self.local_ids = layout.local_experts(cfg)
        self.expert_parallel = layout.ep_size > 1
        self.inter_rows = layout.expert_inter_slice(cfg)
        self.num_experts = cfg.n_routed_experts
        self.hidden = d
        self.full_inter = full_i
        e, i = len(self.local_ids), self.inter_rows.stop - self.inter_rows.start
        self.inter = i
        self.limit = cfg.swiglu_limit
        self.fp4 = fp4

        def param(*shape, dt):
            return nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)

        if fp4:
            if d % FP4_BLOCK or i % FP4_BLOCK:
                raise ValueError(
                    f"FP4 experts need hidden_size ({d}) and the intermediate rows "
                    f"per rank ({i}) to be multiples of {FP4_BLOCK}"
                )
            self.w13 = param(e, 2 * i, d // 2, dt=torch.uint8)
            self.w13_scale = param(e, 2 * i, d // FP4_BLOCK, dt=torch.float8_e8m0fnu)
            self.w2 = param(e, d, i // 2, dt=torch.uint8)
            self.w2_scale = param(e, d, i // FP4_BLOCK, dt=torch.float8_e8m0fnu)
        else:
            self.w13 = param(e, 2 * i, d, dt=dtype)
            self.w2 = param(e, d, i, dt=dtype)
            self.register_parameter("w13_scale", None)
            self.register_parameter("w2_scale", None)

    def checkpoint_slices(self) -> Iterator[CheckpointSlice]:
        """Every routed expert's checkpoint tensors and where this rank keeps them."""
        i, d, full_i = self.inter, self.hidden, self.full_inter
        rows = self.inter_rows
        kinds = ((".weight", "", 2 if self.fp4 else 1),)
        if self.fp4:
            kinds += ((".scale", "_scale", FP4_BLOCK),)
        for e in range(self.num_experts):
            local = e - self.local_ids.start if e in self.local_ids else None
            for suffix, attr, per in kinds:
                cols = slice(rows.start // per, rows.stop // per)
                w13_shape, w2_shape = (full_i, d // per), (d, full_i // per)
                w13, w2 = ("w13" + attr, "w2" + attr) if local is not None else (None, None)
                yield CheckpointSlice(
                    f"{e}.w1{suffix}", w13, (local, slice(0, i)), (rows,), w13_shape
                )
                yield CheckpointSlice(
                    f"{e}.w3{suffix}", w13, (local, slice(i, 2 * i)), (rows,), w13_shape
                )
                yield CheckpointSlice(
                    f"{e}.w2{suffix}", w2, (local,), (slice(None), cols), w2_shape
                )

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        idx: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) (+ add[t])`` over this rank's experts
        (and intermediate rows) -> [T, D] in the math dtype; a partial sum when the model is
        split."""
        if self.expert_parallel:  # global ids -> this rank's, -1 for the other ranks' experts
            local = idx - self.local_ids.start
            idx = torch.where(
                (local >= 0) & (local < len(self.local_ids)), local, torch.full_like(local, -1)
            )
        return ops.moe_experts(
            x, weights, idx, self.w13, self.w13_scale, self.w2, self.w2_scale, self.limit, add
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.local_ids.start}..{self.local_ids.stop - 1} of {self.num_experts}, "
            f"inter={self.inter} of {self.full_inter}, "
            f"format={'fp4' if self.fp4 else self.w13.dtype}"
        )


class SharedExpert(nn.Module):
    """``shared_experts.{w1, w2, w3}`` (a clamped SwiGLU MLP; w1 | w3 one merged GEMM; split
    over tensor-parallel ranks by the intermediate dimension: a partial sum per rank)."""

    def __init__(
        self,
        cfg: DSV4Config,
        dtype: torch.dtype,
        quant_config,
        prefix: str = "shared_experts",
        layout: ParallelLayout = ParallelLayout(),
    ) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        self.limit = cfg.swiglu_limit
        self.inter = i // layout.tp_size
        split = layout.sharded
        self.w13 = merged_linear(
            d, {"w1": i, "w3": i}, quant_config, f"{prefix}.w13", dtype, sharded=split
        )
        # Not reduced here: the MoE block reduces routed + shared partial sums once.
        self.w2 = row_linear(
            i, d, quant_config, f"{prefix}.w2", dtype, sharded=split, reduce_results=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, D] in the w2 projection's output dtype (x's): the MoE adds it to its fp32 routed
        sum, which promotes it exactly, so no cast of its own."""
        return self.w2(ops.swiglu(self.w13(x), self.limit).to(x.dtype))


class DSV4MoE(nn.Module):
    """``layers.N.ffn``: router, routed experts, shared expert. ``forward(x [T, D], input_ids [T])``
    (input_ids only matter for hash-routed layers) -> [T, D] in the math dtype (fp32; the layer's
    ``hc_post`` rounds it to the stream dtype). Split over ranks (``layout``), every rank routes
    every token (the router is replicated) and the ranks' partial sums are all-reduced once, in the
    math dtype, through vLLM's communicator."""

    def __init__(
        self,
        cfg: DSV4Config,
        layer_id: int,
        dtype: torch.dtype = torch.bfloat16,
        quant_config: DSV4HwQuantConfig | None = None,
        prefix: str = "",
        layout: ParallelLayout = ParallelLayout(),
    ) -> None:
        super().__init__()
        self.layout = layout
        qc = quant_config if quant_config is not None else DSV4HwQuantConfig(cfg.weights)
        self.layer_id = layer_id
        self.top_k = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.norm_topk_prob = cfg.norm_topk_prob
        self.hash_routed = layer_id < cfg.num_hash_layers
        self.gate = MoEGate(cfg, self.hash_routed, moe_math_dtype(dtype))
        self.experts = RoutedExperts(cfg, dtype, fp4=cfg.weights.fp4_experts, layout=layout)
        p = f"{prefix}." if prefix else ""
        self.shared_experts = (
            SharedExpert(cfg, dtype, qc, p + "shared_experts", layout)
            if cfg.n_shared_experts > 0
            else None
        )

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hash_ids = None
        if self.hash_routed:
            if input_ids is None:
                raise ValueError(f"layer {self.layer_id} is hash-routed: its MoE needs input_ids")
            if input_ids.shape != x.shape[:1]:
                raise ValueError(f"input_ids {tuple(input_ids.shape)} must be [T={x.shape[0]}]")
            hash_ids = self.gate.tid2eid[input_ids.to(torch.int64)]
        return ops.moe_route(
            x,
            self.gate.weight,
            self.gate.bias,
            hash_ids,
            self.top_k,
            self.norm_topk_prob,
            self.scaling,
        )

    @torch.no_grad()
    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shared = None
        with aux_streams(x.device) as aux:  # the branch rejoins on the way out, also on errors
            if self.shared_experts is not None:  # beside the router
                with aux.branch(BRANCH_SHARED_EXPERT, keep_alive=(x,)):
                    shared = self.shared_experts(x)
            weights, idx = self.route(x, input_ids)
        # the routed experts add the shared output to their slot sum (no add kernel of its own)
        out = self.experts(x, weights, idx, shared)
        if self.layout.sharded:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out = tensor_model_parallel_all_reduce(out)
        return out  # the math dtype: the layer's hc_post rounds it to the stream dtype

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_id}, hash_routed={self.hash_routed}, top_k={self.top_k}, "
            f"scaling={self.scaling}"
        )
