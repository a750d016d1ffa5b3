"""One DeepSeek V4 attention layer (spec section 2), built only from the dispatched ops.

``DSV4Attention(cfg, layer_id)`` holds the official parameters of ``layers.N.attn``::

    wq_a [q_lora, hidden]   q_norm [q_lora]   wq_b [H*512, q_lora]
    wkv [512, hidden]       kv_norm [512]     attn_sink [H] (fp32)
    wo_a [G*o_lora, H*512/G]                  wo_b [hidden, G*o_lora]
    compressor.{wkv [coff*512, hidden], wgate [coff*512, hidden], ape [ratio, coff*512], norm [512]}
    indexer.{wq_b [64*128, q_lora], weights_proj [64, hidden],
             compressor.{wkv [256, hidden], wgate [256, hidden], ape [4, 256], norm [128]}}

(the Linear weights as ``<name>.weight``, norms as ``<name>.weight``). Compressor weights, ``ape``
and the sink are fp32 (the compressor runs in fp32); the rest has the layer's dtype.

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

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.caches import LayerCaches
from vllm_dsv4_hw.attention.metadata import StepMetadata
from vllm_dsv4_hw.config import SUPPORTED_RATIOS, DSV4Config
from vllm_dsv4_hw.ops.reference.rope import rope_tables_for
from vllm_dsv4_hw.platform.streams import AuxStreams

__all__ = ["DSV4Attention", "DSV4Compressor", "DSV4Indexer", "RMSNormWeight",
           "init_dsv4_attention_"]

BRANCH_INDEXER = 0
BRANCH_MAIN_COMPRESSOR = 1


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight (``<name>.weight``); the norm itself is ``ops.rms_norm``."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))


def _linear(inp: int, out: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(inp, out, bias=False, dtype=dtype)


class DSV4Compressor(nn.Module):
    """``compressor.{wkv, wgate, ape, norm}`` of a ratio-``ratio`` compressor with output dim d."""

    def __init__(self, hidden: int, d: int, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.d = d
        self.coff = 2 if ratio == 4 else 1
        self.wkv = _linear(hidden, self.coff * d, torch.float32)
        self.wgate = _linear(hidden, self.coff * d, torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, self.coff * d, dtype=torch.float32))
        self.norm = RMSNormWeight(d, torch.float32)

    def step(self, x32: torch.Tensor, positions: torch.Tensor, plan, state: torch.Tensor,
             cache: torch.Tensor, fmt, cos_sin: torch.Tensor, eps: float) -> None:
        """Write this step's state rows, store every entry completed in the step."""
        kv = F.linear(x32, self.wkv.weight)
        score = F.linear(x32, self.wgate.weight)
        ops.compressor_store(kv, score, positions, self.ape, state, plan.state_slots,
                             plan.group_rows, self.ratio, self.norm.weight, eps, cos_sin,
                             plan.group_entry_index, cache, plan.cache_slots, fmt)


class DSV4Indexer(nn.Module):
    """``indexer.{wq_b, weights_proj, compressor.*}`` (c4a layers)."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads, dtype)
        self.compressor = DSV4Compressor(cfg.hidden_size, self.head_dim, 4)


@functools.lru_cache(maxsize=16)
def _shared_rope_table(cfg: DSV4Config, ratio: int, max_positions: int,
                       device: str) -> torch.Tensor:
    # Layers of one kind share one table (the YaRN table at 1M positions is 256 MiB).
    return rope_tables_for(cfg, ratio, max_positions, device)


def _entry_slots(block_table: torch.Tensor, token_req: torch.Tensor, idx: torch.Tensor,
                 per_page: int) -> torch.Tensor:
    """Cache slots of entry indices idx [T, K] (-1 stays -1) of each token's request. Same mapping
    as ``kv_cache.paged.logical_to_slot`` without its host-side validation (no device sync inside
    the forward; the indices come from ``indexer_topk`` and are visible entries)."""
    idx = idx.to(torch.int64)
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    pages = block_table.to(device=idx.device, dtype=torch.int64)[token_req[:, None],
                                                                  safe // per_page]
    slots = pages * per_page + safe % per_page
    return torch.where(valid & (pages >= 0), slots, torch.full_like(slots, -1))


class DSV4Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int | None = None, *, ratio: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None,
                 device: torch.device | str | None = None, act_quant_o: bool = False) -> None:
        super().__init__()
        if ratio is None:
            if layer_id is None:
                raise ValueError("DSV4Attention needs layer_id (ratio from cfg) or ratio")
            ratio = cfg.compress_ratios[layer_id]
        if ratio not in SUPPORTED_RATIOS:
            raise ValueError(f"compress ratio {ratio} is not one of {SUPPORTED_RATIOS}")
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = ratio
        self.dtype = dtype
        # FP8 activation quantization of the o-projection input (as in front of the checkpoint's
        # FP8 wo_a): uses the fused inverse-RoPE + quantize op, then feeds the dequantized values.
        self.act_quant_o = act_quant_o
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.o_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        h, d = cfg.num_heads, cfg.head_dim

        self.wq_a = _linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNormWeight(cfg.q_lora_rank, dtype)
        self.wq_b = _linear(cfg.q_lora_rank, h * d, dtype)
        self.wkv = _linear(cfg.hidden_size, d, dtype)
        self.kv_norm = RMSNormWeight(d, dtype)
        self.wo_a = _linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = DSV4Compressor(cfg.hidden_size, d, ratio) if ratio else None
        self.indexer = DSV4Indexer(cfg, dtype) if ratio == 4 else None

        n_pos = cfg.max_position_embeddings if max_positions is None else int(max_positions)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.register_buffer("cos_sin", _shared_rope_table(cfg, ratio, n_pos, str(dev)),
                             persistent=False)
        if device is not None:
            self.to(dev)
        self._aux: AuxStreams | None = None
        # Debugging / tests: keep the indexer's selected entry indices of the last step.
        self.capture_topk = False
        self.last_topk: torch.Tensor | None = None

    # -- helpers --------------------------------------------------------------------------------
    def _streams(self, device: torch.device) -> AuxStreams:
        if self._aux is None or self._aux.device != device:
            self._aux = AuxStreams(device, num_branches=2)
        return self._aux

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
    @torch.no_grad()  # inference only: cache / state writes must not record autograd history
    def forward(self, x: torch.Tensor, meta: StepMetadata, caches: LayerCaches) -> torch.Tensor:
        self._check(x, meta, caches)
        t = x.shape[0]
        if t == 0:
            return x.new_zeros(0, self.cfg.hidden_size)
        h, d = self.num_heads, self.head_dim
        pos = meta.positions
        cos_sin = self.cos_sin

        # The branches fork before the q / kv projections: what needs only x (both compressors,
        # the indexer's head weights) overlaps the main stream's projections too; the indexer's
        # query half rejoins its branch once q_r exists.
        aux = self._streams(x.device)
        x32 = x.float() if self.ratio else None
        comp_slots = meta.comp_slots  # c128a: every visible entry; c4a: from the indexer below
        if self.ratio == 4:
            with aux.branch(BRANCH_INDEXER, keep_alive=(x, x32)):
                head_w = self._indexer_keys_and_weights(x, x32, meta, caches)
        if self.ratio:
            with aux.branch(BRANCH_MAIN_COMPRESSOR, keep_alive=(x32,)):
                self.compressor.step(x32, pos, meta.main_plan, caches.main_state, caches.comp,
                                     caches.comp_format, cos_sin, self.eps)

        # 1. q_r (also feeds the indexer) and the shared KV vector: both norms in one op.
        q_r, kv = ops.qkv_rms_norm(self.wq_a(x), self.q_norm.weight, self.wkv(x),
                                   self.kv_norm.weight, self.eps)
        if self.ratio == 4:
            with aux.branch(BRANCH_INDEXER, keep_alive=(q_r, head_w)):
                comp_slots = self._indexer_select(q_r, head_w, meta, caches)

        # 4. Main stream: per-head weightless RMSNorm + RoPE of q; RoPE of kv and its insert
        #    into the window cache (one fused op).
        q = ops.qnorm_rope_kv_insert(self.wq_b(q_r).view(t, h, d), kv, pos, cos_sin, self.eps,
                                     caches.window, meta.window_insert_slots, caches.main_format)
        aux.join()

        # 5. One softmax over window + compressed candidates, with the sink.
        o = self._attend(q, meta, caches, comp_slots)
        # 6. Undo the rotation the values carried, then the grouped low-rank output.
        return self._output_projection(o, pos, x.dtype)

    def _output_projection(self, o: torch.Tensor, pos: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
        """Step 6: inverse RoPE (fused with the FP8 activation quantization under
        ``act_quant_o``) and the grouped low-rank output projection (a hook for quantized
        weights, e.g. benchmarks/stack/model.py)."""
        cos_sin = self.cos_sin
        if self.act_quant_o:
            o8, scales = ops.inv_rope_fp8_quant(o, pos, cos_sin)
            o = (o8.float() * scales.repeat_interleave(o8.shape[-1] // scales.shape[-1], -1))
            o = o.to(dtype)
        else:
            o = ops.rope(o, pos, cos_sin, inverse=True)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return ops.grouped_o_proj(o, wo_a, self.wo_b.weight)

    def _indexer_keys_and_weights(self, x: torch.Tensor, x32: torch.Tensor, meta: StepMetadata,
                                  caches: LayerCaches) -> torch.Tensor:
        """The indexer's half that needs only x: its compressor step (first, so that an entry
        completed by this very token is scorable) and the per-head weights [T, Hi] fp32."""
        idx = self.indexer
        idx.compressor.step(x32, meta.positions, meta.indexer_plan, caches.indexer_state,
                            caches.indexer, caches.indexer_format, self.cos_sin, self.eps)
        return idx.weights_proj(x).float() * (idx.head_dim ** -0.5 * idx.n_heads ** -0.5)

    def _indexer_select(self, q_r: torch.Tensor, w: torch.Tensor, meta: StepMetadata,
                        caches: LayerCaches) -> torch.Tensor:
        """The indexer's query half: q^I, the top-k entries, their compressed-cache slots."""
        idx = self.indexer
        pos = meta.positions
        t = q_r.shape[0]
        qi = idx.wq_b(q_r).view(t, idx.n_heads, idx.head_dim)
        qi = ops.rope(qi, pos, self.cos_sin)
        top = ops.indexer_topk(qi, w, caches.indexer, caches.indexer_format,
                               meta.block_tables.indexer, meta.token_req, pos, idx.topk, 4)
        if self.capture_topk:
            self.last_topk = top
        return _entry_slots(meta.block_tables.comp, meta.token_req, top,
                            meta.geometry.comp_entries_per_page)

    def _attend(self, q: torch.Tensor, meta: StepMetadata, caches: LayerCaches,
                comp_slots: torch.Tensor | None) -> torch.Tensor:
        comp = caches.comp if (self.ratio and comp_slots is not None
                               and comp_slots.shape[-1] > 0) else None
        if comp is None:
            return ops.sparse_attention(q, caches.window, meta.window_slots, None, None,
                                        caches.main_format, self.attn_sink, self.scale)
        return ops.sparse_attention(q, caches.window, meta.window_slots, comp, comp_slots,
                                    caches.main_format, self.attn_sink, self.scale,
                                    comp_fmt=caches.comp_format)

    def extra_repr(self) -> str:
        return (f"ratio={self.ratio}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"o_groups={self.o_groups}, dtype={self.dtype}")


def init_dsv4_attention_(layer: DSV4Attention, generator: torch.Generator | None = None,
                         std_scale: float = 1.0) -> DSV4Attention:
    """Random weights of a sensible scale (benchmarks, tests): N(0, 1/fan_in) matrices, norms
    around 1, ape and sink N(0, 1/4) / N(0, 1)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            shape = p.shape
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
            elif name.endswith("ape"):
                v = 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
            elif name == "attn_sink":
                v = torch.randn(shape, generator=generator, dtype=torch.float64)
            else:
                v = torch.randn(shape, generator=generator, dtype=torch.float64) \
                    * (std_scale / math.sqrt(shape[-1]))
            p.copy_(v.to(p.dtype))
    return layer
