# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek V4 attention layer inside vLLM: cache layers vLLM allocates, and the forward op.

* :class:`DSV4CacheLayer` is one cache of one layer (window, compressed KV, indexer keys, or a
  compressor state) as vLLM sees it: an ``AttentionLayerBase`` with a KV cache spec
  (``engine/kv_specs.py``) and our backend (``attention_backend.py``). vLLM's hybrid manager
  allocates its pages and binds them here.
* :class:`VllmDSV4Attention` is :class:`~vllm_dsv4_hw.attention.layer.DSV4Attention` fed from
  vLLM's forward context: it turns the groups' block tables into one ``StepMetadata`` per
  step and set of KV cache groups (shared by the layers in the same groups, memoized on the
  forward context) and the bound pages into ``LayerCaches``. Decode steps derive it with device
  ops only (``attention.decode_metadata``), so vLLM can capture them in CUDA graphs; other steps
  use the general builder (host-validated, eager).
* ``torch.ops.dsv4_hw.attention`` is the opaque custom-op boundary around the layer (with a fake
  implementation), so that ``torch.compile`` traces the rest of the model and leaves attention
  alone.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from vllm_dsv4_hw.attention.caches import LayerCaches
from vllm_dsv4_hw.attention.decode_metadata import decode_layout, decode_step_metadata
from vllm_dsv4_hw.attention.layer import DSV4Attention
from vllm_dsv4_hw.attention.metadata import (
    BlockTables,
    PageGeometry,
    StepMetadata,
    build_step_metadata,
)
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.engine.attention_backend import DSV4CacheBackend, DSV4CacheMetadata
from vllm_dsv4_hw.engine.kv_specs import LayerKind, layer_kinds, vllm_spec
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.parallel import ParallelLayout

logger = init_logger(__name__)

__all__ = ["DSV4CacheLayer", "VllmDSV4Attention", "KVLayoutError"]


class KVLayoutError(RuntimeError):
    """vLLM handed a cache whose layout our kernels cannot address."""


class DSV4CacheLayer(nn.Module, AttentionLayerBase):
    """One cache (kind ``lk``) of one attention layer, registered with vLLM under ``prefix``."""

    def __init__(self, lk: LayerKind, prefix: str) -> None:
        super().__init__()
        self.lk = lk
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return vllm_spec(self.lk)

    def get_attn_backend(self):
        return DSV4CacheBackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(self):  # the attention layer reads the pages; nothing runs here
        raise RuntimeError("DSV4CacheLayer is storage only")

    @property
    def rows_per_block(self) -> int:
        """State caches: rows of the strided state matrix between one page and the next."""
        return self.kv_cache.stride(0) // self.kv_cache.shape[3]

    def pages(self) -> torch.Tensor:
        """Entry caches: uint8 ``[num_pages, page_bytes]``; states: fp32 ``[rows, width]``."""
        c = self.kv_cache
        lk = self.lk
        if c.dim() != 4 or c.shape[1] != 1 or c.shape[2] != lk.entries_per_page:
            raise KVLayoutError(
                f"{self.prefix}: vLLM bound a cache of shape {tuple(c.shape)}; "
                f"expected [blocks, 1, {lk.entries_per_page}, bytes] "
                f"({lk.kind}). Did vLLM change the block size of this group?"
            )
        nb, _, n, w = c.shape
        if c.stride(3) != 1 or c.stride(2) != w:
            raise KVLayoutError(
                f"{self.prefix}: entries of a page are not contiguous "
                f"(strides {c.stride()}); use a block-outermost KV cache layout"
            )
        if lk.is_state:
            # Page p's rows are rows p*K .. p*K + n-1 of a [rows, w] matrix, K = block stride / w
            # (the spec's block_stride_alignment makes it whole). Slots are remapped to match.
            if c.stride(0) % w:
                raise KVLayoutError(
                    f"{self.prefix}: block stride {c.stride(0)} is not a multiple "
                    f"of the state row ({w} floats)"
                )
            rows = (nb - 1) * self.rows_per_block + n if nb else 0
            return torch.as_strided(c, (rows, w), (w, 1))
        return torch.as_strided(c, (nb, n * w), (c.stride(0), 1))


def _geometry(kinds: dict[str, LayerKind]) -> PageGeometry:
    def per_page(cache: str, default: int) -> int:
        lk = kinds.get(cache)
        return lk.entries_per_page if lk is not None else default

    return PageGeometry(
        window_positions_per_page=kinds["window"].entries_per_page,
        comp_entries_per_page=per_page("comp", 64),
        indexer_entries_per_page=per_page("indexer", 64),
        main_state_rows_per_page=per_page("main_state", 4),
        indexer_state_rows_per_page=per_page("indexer_state", 2),
    )


# The forward context attribute holding this step's StepMetadata per set of KV cache groups.
_MEMO_ATTR = "dsv4_hw_step_metadata"
# Layers by prefix, for the custom op (it receives the name, not the module).
_LAYERS: dict[str, "VllmDSV4Attention"] = {}


class VllmDSV4Attention(DSV4Attention):
    def __init__(
        self,
        cfg: DSV4Config,
        layer_id: int,
        prefix: str,
        main_format: str,
        indexer_format: str,
        dtype: torch.dtype,
        max_positions: int,
        quant_config=None,
        layout: ParallelLayout = ParallelLayout(),
    ) -> None:
        super().__init__(
            cfg,
            layer_id,
            dtype=dtype,
            max_positions=max_positions,
            quant_config=quant_config,
            prefix=prefix,
            layout=layout,
        )
        self.max_positions = max_positions
        self._decode_layout = None
        self.prefix = prefix
        self.main_format_name = main_format
        self.indexer_format_name = indexer_format
        kinds = layer_kinds(cfg, self.ratio, main_format, indexer_format)
        self.kinds = {lk.cache: lk for lk in kinds}
        # Plain dict: the cache layers hold no weights and must stay out of the state dict.
        self.cache_layers = {lk.cache: DSV4CacheLayer(lk, f"{prefix}.{lk.kind}") for lk in kinds}
        self.geometry = _geometry(self.kinds)
        self._formats = {
            "main": make_format(main_format, "main", self.geometry.window_positions_per_page),
            "comp": (
                make_format(main_format, "main", self.geometry.comp_entries_per_page)
                if self.kind.compressed
                else None
            ),
            "indexer": (
                make_format(indexer_format, "indexer", self.geometry.indexer_entries_per_page)
                if self.kind.has_indexer
                else None
            ),
        }
        if prefix in _LAYERS:
            logger.debug("re-registering attention layer %s", prefix)
        _LAYERS[prefix] = self

    # -- metadata -----------------------------------------------------------------------------
    def _group_meta(self, attn_metadata: dict, cache: str) -> DSV4CacheMetadata:
        layer = self.cache_layers[cache]
        m = attn_metadata.get(layer.prefix)
        if m is None:
            raise RuntimeError(f"{layer.prefix}: no attention metadata in this step")
        if m.block_size != layer.lk.block_size:
            raise KVLayoutError(
                f"{layer.prefix}: vLLM runs this cache with {m.block_size} "
                f"positions per page, the layer expects {layer.lk.block_size}"
            )
        return m

    def _step_metadata(self, attn_metadata: dict):
        groups = {cache: self._group_meta(attn_metadata, cache) for cache in self.cache_layers}
        # vLLM may split one cache kind over several KV cache groups (each its own block table),
        # so layers share step metadata only when all their caches are in the same groups.
        key = (self.ratio, tuple(id(groups[c]) for c in sorted(groups)))
        fc = get_forward_context()
        memo = getattr(fc, _MEMO_ATTR, None)
        if memo is None or memo[0] is not attn_metadata:
            memo = (attn_metadata, {})
            setattr(fc, _MEMO_ATTR, memo)
        meta = memo[1].get(key)
        if meta is None:
            if all(m.decode for m in groups.values()):
                meta = self._decode_metadata(groups)
            else:
                meta = self._general_metadata(groups)
            memo[1][key] = meta
        return meta

    def _decode_metadata(self, groups: dict) -> StepMetadata:
        """Device ops over vLLM's persistent buffers only: capturable, replayed as is."""
        if self._decode_layout is None:
            self._decode_layout = decode_layout(
                self.ratio,
                self.geometry,
                self.cfg.sliding_window,
                self.max_positions,
                null_page=groups["window"].null_page,
                main_state_stride=self._state_stride("main_state"),
                indexer_state_stride=self._state_stride("indexer_state"),
            )
        tables = BlockTables(**{cache: m.block_table for cache, m in groups.items()})
        return decode_step_metadata(
            groups["window"].seq_lens, tables, self.geometry, self._decode_layout
        )

    def _state_stride(self, cache: str) -> int | None:
        layer = self.cache_layers.get(cache)
        return layer.rows_per_block if layer is not None else None

    def _general_metadata(self, groups: dict) -> StepMetadata:
        w = groups["window"]
        seq_starts, num_new = w.host_layout()
        tables = {}
        for cache, m in groups.items():
            bt = m.block_table.to(torch.int64)
            tables[cache] = torch.where(bt > m.null_page, bt, torch.full_like(bt, -1))
        meta = build_step_metadata(
            seq_starts,
            num_new,
            self.ratio,
            BlockTables(**tables),
            geometry=self.geometry,
            sliding_window=self.cfg.sliding_window,
        )
        self._remap_state_rows(meta)
        return meta

    def _remap_state_rows(self, meta) -> None:
        """Logical state rows (page * rows_per_page + offset) -> rows of the strided state matrix
        (page * rows_per_block + offset), see ``DSV4CacheLayer.pages``."""
        for plan, cache in ((meta.main_plan, "main_state"), (meta.indexer_plan, "indexer_state")):
            if plan is None:
                continue
            layer = self.cache_layers[cache]
            r, k = layer.lk.entries_per_page, layer.rows_per_block

            def remap(x: torch.Tensor) -> torch.Tensor:
                return torch.where(x >= 0, (x // r) * k + x % r, x)

            plan.state_slots = remap(plan.state_slots)
            plan.group_rows = remap(plan.group_rows)

    def _layer_caches(self) -> LayerCaches:
        pages = {cache: layer.pages() for cache, layer in self.cache_layers.items()}
        return LayerCaches(
            ratio=self.ratio,
            main_format=self._formats["main"],
            window=pages["window"],
            geometry=self.geometry,
            comp_format=self._formats["comp"],
            comp=pages.get("comp"),
            indexer_format=self._formats["indexer"],
            indexer=pages.get("indexer"),
            main_state=pages.get("main_state"),
            indexer_state=pages.get("indexer_state"),
        )

    # -- forward ------------------------------------------------------------------------------
    def run(self, x: torch.Tensor) -> torch.Tensor:
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            # Profiling / warm-up run without caches: attention contributes nothing.
            return torch.zeros_like(x)
        if isinstance(attn_metadata, list):  # micro-batched steps are not used on our platforms
            raise RuntimeError("DeepSeek V4 (dsv4-hw) does not support micro-batching (DBO)")
        meta = self._step_metadata(attn_metadata)
        t = meta.num_tokens
        out = super().forward(x[:t], meta, self._layer_caches())
        if t == x.shape[0]:
            return out
        padded = torch.zeros_like(x)
        padded[:t] = out
        return padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # what the decoder layer calls
        return torch.ops.dsv4_hw.attention(x, self.prefix)


@torch.library.custom_op("dsv4_hw::attention", mutates_args=())
def _attention_op(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return _LAYERS[layer_name].run(x)


@_attention_op.register_fake
def _(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(x)
