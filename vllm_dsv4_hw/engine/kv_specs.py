# SPDX-License-Identifier: Apache-2.0
"""Our cache kinds as vLLM KV cache specs, so that vLLM's hybrid KV cache manager allocates them.

Each kind of :mod:`vllm_dsv4_hw.kv_cache.specs` becomes one vLLM spec per layer, with the same page
bytes, so vLLM's page-size grouping ends up with our (at most) three buckets:

========================== ================================ ====================================
kind                       vLLM spec                        block (positions) / states per page
========================== ================================ ====================================
c4a_kv, c128a_kv           ``MLAAttentionSpec``             256 positions, ``tokens_per_state``
                           (full attention)                 = ratio: 64 / 2 entries per page
indexer_kv                 ``MLAAttentionSpec``             256 positions, 64 keys per page
window_kv                  ``SlidingWindowMLASpec`` (128)   64 positions, one entry each
c4a / c128a / indexer      ``SlidingWindowMLASpec``         rows per page (4 / 8 / 2 for fp8 +
state                      (window = coff * ratio)          mxfp4), one fp32 row per position
========================== ================================ ====================================

vLLM packs the pages of all layers of a KV cache group block by block (block-outermost layout), so
one layer's consecutive pages are one pool block apart. A state page holds ``rows`` fp32 rows back to
back, then padding up to its bucket page (``page_size_padded``); its spec asks for a block stride
that is a multiple of the row size (``block_stride_alignment``), so the rows of every page are rows
of one strided ``[rows, width]`` matrix (``attention_layer.DSV4CacheLayer.pages``), which is what the
compressor ops take.

This module imports vLLM lazily (only :func:`vllm_spec` needs it), so planning code stays vLLM-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.specs import CATEGORY, CacheSpec, layer_cache_specs

__all__ = ["LayerKind", "layer_kinds", "vllm_spec", "STATE_KINDS"]

STATE_KINDS = tuple(k for k, c in CATEGORY.items() if c == "compressor_state")


@dataclass(frozen=True)
class LayerKind:
    """One cache of one attention layer: which kind, and its geometry in vLLM's terms."""

    kind: str  # a kv_cache.specs kind
    cache: str  # the LayerCaches field it fills: window, comp, indexer, main_state, ...
    spec: CacheSpec
    block_size: int  # positions per page (vLLM's block_size)
    entries_per_page: int
    entry_stride: int  # bytes between consecutive entries / rows of a page
    sliding_window: int | None

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS


def layer_kinds(
    cfg: DSV4Config, ratio: int, main_format: str, indexer_format: str
) -> list[LayerKind]:
    """The caches of a layer of compress ratio ``ratio``, in the order they register with vLLM
    (``AttentionKind.cache_spec_kinds``: window first)."""
    caches = kind_of(ratio).cache_spec_kinds
    specs = {
        s.kind: s
        for s in layer_cache_specs(
            cfg.with_layers((ratio or 4, 128, 0)), main_format, indexer_format
        )
    }
    out = []
    for cache, kind in caches.items():
        s = specs[kind]
        stride = s.entry_bytes
        out.append(
            LayerKind(
                kind=kind,
                cache=cache,
                spec=s,
                block_size=s.positions_per_page,
                entries_per_page=s.entries_per_page,
                entry_stride=stride,
                sliding_window=s.sliding_window,
            )
        )
    return out


def vllm_spec(lk: LayerKind):
    """The vLLM ``KVCacheSpec`` of one layer cache (imports vLLM)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    natural = lk.entries_per_page * lk.entry_stride
    common = dict(
        block_size=lk.block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        # head_size is informational here: our entry formats fix the bytes (state_content_bytes).
        head_size=512 if lk.kind != "indexer_kv" else 128,
        state_content_bytes=lk.entry_stride,
        page_size_padded=lk.page_bytes if lk.page_bytes != natural else None,
    )
    if lk.is_state:
        return SlidingWindowMLASpec(
            dtype=torch.float32,
            sliding_window=lk.sliding_window,
            cache_dtype_str="fp32_state",
            block_stride_alignment=lk.entry_stride,
            **common,
        )
    if lk.kind == "window_kv":
        return SlidingWindowMLASpec(
            dtype=torch.uint8,
            sliding_window=lk.sliding_window,
            cache_dtype_str=lk.spec.format,
            **common,
        )
    # Compressed main KV and indexer keys: full attention over 256-position logical blocks.
    assert lk.block_size == BLOCK_POSITIONS, lk
    return MLAAttentionSpec(
        dtype=torch.uint8,
        tokens_per_state=lk.spec.positions_per_entry,
        cache_dtype_str=f"{lk.kind}:{lk.spec.format}",
        **common,
    )
