# SPDX-License-Identifier: Apache-2.0
"""One DeepSeek V4 attention layer (spec section 2), built only from the dispatched ops.

``DSV4Attention(cfg, layer_id)`` holds the official parameters of ``layers.N.attn``::

    wq_a [q_lora, hidden]   q_norm [q_lora]   wq_b [H*512, q_lora]   (wq_a | wkv: one GEMM)
    wkv [512, hidden]       kv_norm [512]     attn_sink [H] (fp32)
    wo_a [G*o_lora, H*512/G]                  wo_b [hidden, G*o_lora]
    compressor.{wkv [coff*512, hidden], wgate [coff*512, hidden], ape [ratio, coff*512], norm [512]}
    indexer.{wq_b [64*128, q_lora], weights_proj [64, hidden],
             compressor.{wkv [256, hidden], wgate [256, hidden], ape [4, 256], norm [128]}}

The linears are vLLM layers whose method (``quant.linear``) keeps the checkpoint's format: FP8
block weights (``<name>.weight`` e4m3 + ``<name>.scale`` ue8m0) where the checkpoint quantizes
them, float weights elsewhere. Each compressor's ``wkv`` and ``wgate`` are one merged GEMM with fp32
output (``compressor.wkv_wgate``, loaded from the two checkpoint tensors); ``ape``, the sink and the
compressor norm are fp32 (the compressor pools in fp32); the rest has the layer's dtype.

``forward(x [T, hidden], meta, caches)`` runs one step of a varlen batch (prefill chunks and decode
tokens mixed) over paged caches:

1. branch 0 (c4a), part 1: indexer compressor step (state rows, completed keys into the indexer
   cache); head weights w = (W_w x) * 128^-0.5 * 64^-0.5
2. branch 1 (c4a, c128a): main compressor step (state rows, completed entries into ``caches.comp``)
3. main: q_r = RMSNorm_w(W_qa x); kv = RMSNorm_w(W_kv x)       (``qkv_rms_norm``)
   branch 0, part 2 (after q_r): q^I = RoPE(W_qb^I q_r); top-k entry indices -> compressed-cache
   slots
4. main: q = RoPE(RMSNorm(W_qb q_r) per head); kv = RoPE(kv) inserted into the window cache
   (``qnorm_rope_kv_insert``)
5. join; sparse attention over window + compressed candidates with the sink, scale 512^-0.5
6. inverse RoPE on the output's rope dims at the query position (with ``act_quant_o``: fused with
   the FP8 activation quantization of the o-projection input); grouped o projection

The branches run on auxiliary streams where the device has them (inline on CPU). RoPE: ratio 0
layers use ``rope_theta`` without YaRN; ratio 4 / 128 layers use ``compress_rope_theta`` with YaRN,
one table for queries, window keys, compressed entries and the indexer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch import nn

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.caches import LayerCaches
from vllm_dsv4_hw.attention.indexer_query import e4m3_query
from vllm_dsv4_hw.attention.metadata import StepMetadata
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR, AttentionKind, kind_of
from vllm_dsv4_hw.ops.reference.rope import rope_tables_for
from vllm_dsv4_hw.parallel import ParallelLayout, shard_rows
from vllm_dsv4_hw.platform.streams import aux_streams
from vllm_dsv4_hw.quant.config import DSV4HwQuantConfig
from vllm_dsv4_hw.quant.linear import (
    column_linear,
    grouped_linear,
    mergeable,
    merged_linear,
    replicated_linear,
    row_linear,
)

__all__ = ["DSV4Attention", "DSV4Compressor", "DSV4Indexer", "RMSNormWeight", "running_step"]

BRANCH_INDEXER = 0
BRANCH_MAIN_COMPRESSOR = 1
BRANCH_INDEXER_COMPRESSOR = 2  # its own branch: only the score pass waits for it

# The step a network runs outside vLLM's engine (benchmarks, tests, standalone use): per-kind
# step metadata and per-layer caches, read by layers called as ``attn(x)``.
_STEP: contextvars.ContextVar = contextvars.ContextVar("dsv4_hw_step", default=None)


@contextlib.contextmanager
def running_step(metas: dict, caches):
    """Run a network's attention layers on ``metas[ratio]`` (StepMetadata per layer kind) and
    ``caches[layer_id]`` (LayerCaches per layer) without vLLM: ``with running_step(m, c): net(ids)``.
    Inside vLLM the layers read the engine's forward context instead (``engine/attention_layer.py``)."""
    token = _STEP.set((metas, caches))
    try:
        yield
    finally:
        _STEP.reset(token)


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight (``<name>.weight``); the norm itself is ``ops.rms_norm``."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)


class DSV4Compressor(nn.Module):
    """``compressor.{wkv, wgate, ape, norm}`` of a compressor of ``kind`` with output dim d."""

    def __init__(self, hidden: int, d: int, kind: AttentionKind, dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        self.kind = kind
        self.ratio = kind.ratio
        self.d = d
        width = kind.coff * d
        # The checkpoint ships both projections unquantized; one GEMM, fp32 out (pooling is fp32).
        self.wkv_wgate = merged_linear(hidden, {"wkv": width, "wgate": width},
                                       DSV4HwQuantConfig.dense(out_dtype=torch.float32),
                                       f"{prefix}.wkv_wgate", dtype)
        self.ape = nn.Parameter(torch.zeros(kind.ratio, width, dtype=torch.float32),
                                requires_grad=False)
        self.norm = RMSNormWeight(d, torch.float32)

    def step(self, x: torch.Tensor, positions: torch.Tensor, plan, state: torch.Tensor,
             cache: torch.Tensor, fmt, cos_sin: torch.Tensor, eps: float) -> None:
        """Write this step's state rows, store every entry completed in the step."""
        kv, score = self.wkv_wgate(x).split(self.kind.coff * self.d, dim=-1)
        ops.compressor_store(kv, score, positions, self.ape, state, plan.state_slots,
                             plan.group_rows, self.ratio, self.norm.weight, eps, cos_sin,
                             plan.group_entry_index, cache, plan.cache_slots, fmt)


class DSV4Indexer(nn.Module):
    """``indexer.{wq_b, weights_proj, compressor.*}`` (c4a layers)."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, quant_config,
                 prefix: str) -> None:
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = replicated_linear(cfg.q_lora_rank, self.n_heads * self.head_dim, quant_config,
                                      f"{prefix}.wq_b", dtype)
        self.weights_proj = replicated_linear(cfg.hidden_size, self.n_heads,
                                              DSV4HwQuantConfig.dense(),
                                              f"{prefix}.weights_proj", dtype)
        self.compressor = DSV4Compressor(cfg.hidden_size, self.head_dim, INDEXER_COMPRESSOR,
                                         dtype, f"{prefix}.compressor")
        # e4m3 q^I (``attention.indexer_query``): None follows the setting, True / False force it
        self.q_e4m3: bool | None = None
        # On the device, one element: weights_proj's bf16 output times it promotes to fp32 in one
        # launch (a cast then a scalar product were two on the indexer's branch), same bits.
        self.register_buffer("head_scale", torch.tensor([self.head_scale_value],
                                                        dtype=torch.float32), persistent=False)

    @property
    def head_scale_value(self) -> float:
        """The head weights' scale Di^-0.5 * Hi^-0.5."""
        return self.head_dim ** -0.5 * self.n_heads ** -0.5

    def query(self, q_r: torch.Tensor, positions: torch.Tensor,
              cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q^I = RoPE(W_qb^I q_r) [T, Hi, Di], and its per-(token, head) scales [T, Hi] where it
        is scored as e4m3 codes (``q_e4m3``; head dim 128: one FP8 group per head), else None."""
        t = q_r.shape[0]
        qi = self.wq_b(q_r).view(t, self.n_heads, self.head_dim)
        if self.head_dim == 128 and (self.q_e4m3 if self.q_e4m3 is not None
                                     else e4m3_query(qi.device)):
            codes, scales = ops.rope_fp8_quant(qi, positions, cos_sin)
            return codes, scales.view(t, self.n_heads)
        return ops.rope(qi, positions, cos_sin), None

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The per-head weights [T, Hi] fp32, scaled."""
        w = self.weights_proj(x)
        s = self.head_scale
        if (s.dtype == torch.float32 and s.device == w.device
                and w.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return w * s
        return w.float() * self.head_scale_value  # a float64 layer (tests), a moved buffer


@functools.lru_cache(maxsize=16)
def _shared_rope_table(cfg: DSV4Config, ratio: int, max_positions: int,
                       device: str) -> torch.Tensor:
    # Layers of one kind share one table (the YaRN table at 1M positions is 256 MiB).
    return rope_tables_for(cfg, ratio, max_positions, device)


class DSV4Attention(nn.Module):
    """One attention layer. ``quant_config``: the method of the linears the checkpoint quantizes
    (``quant.config.DSV4HwQuantConfig``; default: the formats ``cfg.weights`` declares);
    ``prefix`` names the layer in the checkpoint (``layers.N.attn``). ``layout`` (``parallel``):
    split over tensor-parallel ranks, this rank holds ``num_heads`` of the query heads (their
    ``wq_b`` rows and sinks) and the ``o_groups`` output groups they feed (``wo_a`` rows, ``wo_b``
    input, all-reduced); ``wq_a``, the KV vector, the compressors and the indexer are replicated,
    so the caches and the selected entries are the same on every rank."""

    def __init__(self, cfg: DSV4Config, layer_id: int | None = None, *, ratio: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None,
                 device: torch.device | str | None = None, act_quant_o: bool | None = None,
                 quant_config: DSV4HwQuantConfig | None = None, prefix: str = "",
                 layout: ParallelLayout = ParallelLayout()) -> None:
        super().__init__()
        if ratio is None:
            if layer_id is None:
                raise ValueError("DSV4Attention needs layer_id (ratio from cfg) or ratio")
            ratio = cfg.compress_ratios[layer_id]
        self.kind = kind_of(ratio)
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = ratio
        self.dtype = dtype
        # FP8 activation quantization of the o-projection input (as the official FP8 x FP8 wo_a
        # does): the fused inverse-RoPE + quantize op, its codes and scales straight into wo_a.
        # None: wherever wo_a quantizes its input anyway (W8A8 on this device); True: always
        # (a wo_a that cannot take codes multiplies their values).
        self.act_quant_o = act_quant_o
        self.layout = layout
        self.num_heads = layout.local_heads(cfg)
        self.head_dim = cfg.head_dim
        self.o_groups = layout.local_groups(cfg)
        self.o_lora_rank = cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        h, d, split = cfg.num_heads, cfg.head_dim, layout.sharded
        qc = quant_config if quant_config is not None else DSV4HwQuantConfig(cfg.weights)
        p = f"{prefix}." if prefix else ""

        with torch.device(device) if device is not None else contextlib.nullcontext():
            # wq_a and wkv read the same x: one GEMM (vLLM's fused_qkv_a_proj of DeepSeek V3)
            # where their rows split on the FP8 block, two otherwise
            self.qkv_sizes = (cfg.q_lora_rank, d)
            self.merged_qkv = mergeable(qc, self.qkv_sizes)
            if self.merged_qkv:
                self.wq_a_wkv = merged_linear(cfg.hidden_size, {"wq_a": cfg.q_lora_rank, "wkv": d},
                                              qc, p + "wq_a_wkv", dtype)
            else:
                self.wq_a = replicated_linear(cfg.hidden_size, cfg.q_lora_rank, qc, p + "wq_a",
                                              dtype)
                self.wkv = replicated_linear(cfg.hidden_size, d, qc, p + "wkv", dtype)
            self.q_norm = RMSNormWeight(cfg.q_lora_rank, dtype)
            self.wq_b = column_linear(cfg.q_lora_rank, h * d, qc, p + "wq_b", dtype, split)
            self.kv_norm = RMSNormWeight(d, dtype)
            self.wo_a = column_linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
                                      qc, p + "wo_a", dtype, split)
            self.wo_b = row_linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, qc,
                                   p + "wo_b", dtype, split)
            self.attn_sink = shard_rows(nn.Parameter(
                torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False), layout, h)
            self.compressor = (DSV4Compressor(cfg.hidden_size, d, self.kind, dtype,
                                              p + "compressor")
                               if self.kind.compressed else None)
            self.indexer = (DSV4Indexer(cfg, dtype, qc, p + "indexer")
                            if self.kind.has_indexer else None)

        n_pos = cfg.max_position_embeddings if max_positions is None else int(max_positions)
        # On the device the model is built on (vLLM builds it under a default-device context):
        # a table left on the host would be copied to the device on every call.
        dev = torch.device(device) if device is not None else torch.get_default_device()
        self.register_buffer("cos_sin", _shared_rope_table(cfg, ratio, n_pos, str(dev)),
                             persistent=False)

    # -- helpers --------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, meta: StepMetadata, caches: LayerCaches) -> None:
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"x must be [T, {self.cfg.hidden_size}], got {tuple(x.shape)}")
        if x.shape[0] != meta.num_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, the step metadata {meta.num_tokens}")
        if meta.ratio != self.ratio or caches.ratio != self.ratio:
            raise ValueError(f"layer of ratio {self.ratio} got metadata of ratio {meta.ratio} and "
                             f"caches of ratio {caches.ratio}")
        if meta.sliding_window != self.cfg.sliding_window:
            raise ValueError(f"metadata window {meta.sliding_window} != sliding_window "
                             f"{self.cfg.sliding_window}")

    # -- forward --------------------------------------------------------------------------------
    def _q_kv_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_qa x and W_kv x (column views of one merged GEMM's output where merged)."""
        if self.merged_qkv:
            return self.wq_a_wkv(x).split(self.qkv_sizes, dim=-1)
        return self.wq_a(x), self.wkv(x)

    @torch.no_grad()  # inference only: cache / state writes must not record autograd history
    def forward(self, x: torch.Tensor, meta: StepMetadata | None = None,
                caches: LayerCaches | None = None) -> torch.Tensor:
        if meta is None:
            step = _STEP.get()
            if step is None:
                raise RuntimeError("DSV4Attention called without step metadata: pass (meta, "
                                   "caches) or run inside attention.layer.running_step(...)")
            meta, caches = step[0][self.ratio], step[1][self.layer_id]
        self._check(x, meta, caches)
        t = x.shape[0]
        if t == 0:
            return x.new_zeros(0, self.cfg.hidden_size)
        h, d = self.num_heads, self.head_dim
        pos = meta.positions
        cos_sin = self.cos_sin

        # The branches fork before the q / kv projections: what needs only x (both compressors,
        # the indexer's head weights) overlaps the main stream's projections too; the indexer's
        # query half rejoins its branch once q_r exists, and waits for the indexer's compressor
        # (a branch of its own) only where it scores: at B=1 that compressor is as long as the
        # q projections, and was in series with the selection when it shared its branch.
        aux = aux_streams(x.device)
        comp_slots = meta.comp_slots  # c128a: every visible entry; c4a: from the indexer below
        # ``with aux``: the branches rejoin on the way out, also when a step raises: under CUDA-
        # graph capture an unjoined branch turns the real error into "capturing stream has
        # unjoined work" (the error of a 2026-12-04 H200 run, its cause hidden so).
        with aux:
            if self.kind.has_indexer:
                with aux.branch(BRANCH_INDEXER_COMPRESSOR, keep_alive=(x,)):
                    self._indexer_keys(x, meta, caches)
                with aux.branch(BRANCH_INDEXER, keep_alive=(x,)):
                    head_w = self.indexer.head_weights(x)
            if self.kind.compressed:
                with aux.branch(BRANCH_MAIN_COMPRESSOR, keep_alive=(x,)):
                    self.compressor.step(x, pos, meta.main_plan, caches.main_state, caches.comp,
                                         caches.comp_format, cos_sin, self.eps)

            # 1. q_r (also feeds the indexer) and the shared KV vector: both norms in one op.
            q_a, kv_a = self._q_kv_projections(x)
            q_r, kv = ops.qkv_rms_norm(q_a, self.q_norm.weight, kv_a, self.kv_norm.weight,
                                       self.eps)
            if self.kind.has_indexer:
                with aux.branch(BRANCH_INDEXER, keep_alive=(q_r, head_w),
                                after=(BRANCH_INDEXER_COMPRESSOR,)):
                    comp_slots = self._indexer_select(q_r, head_w, meta, caches)

            # 4. Main stream: per-head weightless RMSNorm + RoPE of q; RoPE of kv and its insert
            #    into the window cache (one fused op).
            q = ops.qnorm_rope_kv_insert(self.wq_b(q_r).view(t, h, d), kv, pos, cos_sin,
                                         self.eps, caches.window, meta.window_insert_slots,
                                         caches.main_format)

        # 5. One softmax over window + compressed candidates, with the sink.
        o = self._attend(q, meta, caches, comp_slots)
        # 6. Undo the rotation the values carried, then the grouped low-rank output.
        return self._output_projection(o, pos, x.dtype)

    def _output_projection(self, o: torch.Tensor, pos: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
        """Step 6: inverse RoPE (fused with the FP8 activation quantization under
        ``act_quant_o``), the per-group ``wo_a`` and ``wo_b``."""
        t, g = o.shape[0], self.o_groups
        if self._o_codes(o.device):
            o8, scales = ops.inv_rope_fp8_quant(o, pos, self.cos_sin)
            y = grouped_linear(self.wo_a, o8.view(t, g, -1), g, x_scales=scales.view(t, g, -1))
        else:
            o = ops.rope(o, pos, self.cos_sin, inverse=True)
            y = grouped_linear(self.wo_a, o.reshape(t, g, -1), g)
        return self.wo_b(y.reshape(t, g * self.o_lora_rank))

    def _o_codes(self, device: torch.device) -> bool:
        """Step 6 as one fused inverse RoPE + e4m3 quantization whose codes feed wo_a."""
        if self.act_quant_o is not None:
            return self.act_quant_o
        takes = getattr(self.wo_a.quant_method, "takes_e4m3_input", None)
        return takes is not None and takes(device)

    def _indexer_keys(self, x: torch.Tensor, meta: StepMetadata, caches: LayerCaches) -> None:
        """The indexer's compressor step (before the selection: an entry completed by this very
        token is scorable)."""
        idx = self.indexer
        idx.compressor.step(x, meta.positions, meta.indexer_plan, caches.indexer_state,
                            caches.indexer, caches.indexer_format, self.cos_sin, self.eps)

    def _indexer_select(self, q_r: torch.Tensor, w: torch.Tensor, meta: StepMetadata,
                        caches: LayerCaches) -> torch.Tensor:
        """The indexer's query half: q^I, the top-k entries, their compressed-cache slots."""
        idx = self.indexer
        pos = meta.positions
        qi, q_scales = idx.query(q_r, pos, self.cos_sin)
        top = ops.indexer_topk(qi, w, caches.indexer, caches.indexer_format,
                               _visible_pages(meta.block_tables.indexer, meta.max_visible_entries,
                                              meta.geometry.indexer_entries_per_page),
                               meta.token_req, pos, idx.topk, self.ratio, q_scales=q_scales)
        return ops.entry_slots(meta.block_tables.comp, meta.token_req, top,
                               meta.geometry.comp_entries_per_page)

    def _attend(self, q: torch.Tensor, meta: StepMetadata, caches: LayerCaches,
                comp_slots: torch.Tensor | None) -> torch.Tensor:
        comp = caches.comp if (self.kind.compressed and comp_slots is not None
                               and comp_slots.shape[-1] > 0) else None
        if comp is None:
            return ops.sparse_attention(q, caches.window, meta.window_slots, None, None,
                                        caches.main_format, self.attn_sink, self.scale)
        return ops.sparse_attention(q, caches.window, meta.window_slots, comp, comp_slots,
                                    caches.main_format, self.attn_sink, self.scale,
                                    comp_fmt=caches.comp_format)

    def extra_repr(self) -> str:
        return (f"kind={self.kind.name}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"o_groups={self.o_groups}, dtype={self.dtype}")


def _visible_pages(block_table: torch.Tensor, max_visible: int, per_page: int) -> torch.Tensor:
    """The block table's columns that hold a visible entry. vLLM's tables span the model length
    (1M tokens: 4,096 pages) whatever the context; the indexer scores and selects over every
    column it is given, so a short prefill would pay for the whole width."""
    return block_table[:, :min(block_table.shape[1], -(-max_visible // per_page))]
