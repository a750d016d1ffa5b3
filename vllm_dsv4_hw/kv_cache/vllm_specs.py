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

A state page holds ``rows`` rows spread evenly over the bucket page (row stride = page / rows), so
it needs no separate padding and the state cache is still a plain strided ``[rows, width]`` fp32
matrix (``row = page * rows + offset``). The spec's ``state_content_bytes`` is that stride.

This module imports vLLM lazily (only :func:`vllm_spec` needs it), so planning code stays vLLM-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.specs import CacheSpec, layer_cache_specs

__all__ = ["LayerKind", "layer_kinds", "vllm_spec", "STATE_KINDS"]

STATE_KINDS = ("c4a_state", "c128a_state", "indexer_state")
# Inside vLLM a compressor-state page is one row: vLLM packs the pages of a KV cache group's layers
# block by block, so consecutive pages of one layer are not adjacent and a page of several rows
# could not be addressed as rows of one ``[rows, width]`` matrix (what the compressor ops take).
VLLM_STATE_ROWS_PER_PAGE = 1


@dataclass(frozen=True)
class LayerKind:
    """One cache of one attention layer: which kind, and its geometry in vLLM's terms."""

    kind: str           # a kv_cache.specs kind
    cache: str          # the LayerCaches field it fills: window, comp, indexer, main_state, ...
    spec: CacheSpec
    block_size: int     # positions per page (vLLM's block_size)
    entries_per_page: int
    entry_stride: int   # bytes between consecutive entries / rows of a page
    sliding_window: int | None

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS


_CACHE_FIELD = {
    "window_kv": "window", "c4a_kv": "comp", "c128a_kv": "comp", "indexer_kv": "indexer",
    "c4a_state": "main_state", "c128a_state": "main_state", "indexer_state": "indexer_state",
}
_KINDS_FOR_RATIO = {
    0: ("window_kv",),
    4: ("window_kv", "c4a_kv", "indexer_kv", "c4a_state", "indexer_state"),
    128: ("window_kv", "c128a_kv", "c128a_state"),
}


def layer_kinds(cfg: DSV4Config, ratio: int, main_format: str, indexer_format: str,
                state_rows_per_page: int | None = None) -> list[LayerKind]:
    """The caches of a layer of compress ratio ``ratio`` (window first).

    ``state_rows_per_page`` overrides the rows of a compressor-state page (vLLM: 1, see
    :data:`VLLM_STATE_ROWS_PER_PAGE`); the page is then exactly that many rows.
    """
    if ratio not in _KINDS_FOR_RATIO:
        raise ValueError(f"compress ratio {ratio} is not one of (0, 4, 128)")
    specs = {s.kind: s for s in layer_cache_specs(cfg.with_layers((ratio or 4, 128, 0)),
                                                  main_format, indexer_format)}
    out = []
    for kind in _KINDS_FOR_RATIO[ratio]:
        s = specs[kind]
        if kind in STATE_KINDS and state_rows_per_page is not None:
            s = replace(s, entries_per_page=state_rows_per_page,
                        page_bytes=state_rows_per_page * s.entry_bytes)
        if kind in STATE_KINDS:
            stride = s.page_bytes // s.entries_per_page
            if s.page_bytes % s.entries_per_page or stride % 4 or stride < s.entry_bytes:
                raise ValueError(f"{kind}: a {s.page_bytes} B page cannot hold "
                                 f"{s.entries_per_page} fp32 rows of {s.entry_bytes} B evenly")
        else:
            stride = s.entry_bytes
        out.append(LayerKind(kind=kind, cache=_CACHE_FIELD[kind], spec=s,
                             block_size=s.positions_per_page,
                             entries_per_page=s.entries_per_page, entry_stride=stride,
                             sliding_window=s.sliding_window))
    return out


def vllm_spec(lk: LayerKind):
    """The vLLM ``KVCacheSpec`` of one layer cache (imports vLLM)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    common = dict(
        block_size=lk.block_size, num_kv_heads=1, max_tp_shards=1,
        # head_size is informational here: our entry formats fix the bytes (state_content_bytes).
        head_size=512 if lk.kind != "indexer_kv" else 128,
        state_content_bytes=lk.entry_stride,
    )
    if lk.is_state:
        return SlidingWindowMLASpec(dtype=torch.float32, sliding_window=lk.sliding_window,
                                    cache_dtype_str="fp32_state", **common)
    if lk.kind == "window_kv":
        return SlidingWindowMLASpec(dtype=torch.uint8, sliding_window=lk.sliding_window,
                                    cache_dtype_str=lk.spec.format, **common)
    # Compressed main KV and indexer keys: full attention over 256-position logical blocks.
    assert lk.block_size == BLOCK_POSITIONS, lk
    return MLAAttentionSpec(dtype=torch.uint8, tokens_per_state=lk.spec.positions_per_entry,
                            cache_dtype_str=f"{lk.kind}:{lk.spec.format}", **common)
