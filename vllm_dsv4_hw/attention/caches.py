# SPDX-License-Identifier: Apache-2.0
"""The caches one DeepSeek V4 attention layer reads and writes; an allocator for tests/benchmarks.

Per layer (spec section 6; the page sizes follow ``kv_cache.specs`` where the formats are known):

* ``window``: main-format entries, one per position (sliding window 128, 64 positions per page);
* ``comp``: compressed main entries (ratio 4: 64, ratio 128: 2 entries per page);
* ``indexer``: indexer keys (ratio 4 only, 64 per page);
* ``main_state`` / ``indexer_state``: compressor state rows ``[kv | score]`` fp32, one per position,
  as a ``[pages * rows_per_page, 2*coff*d]`` float32 tensor (row slot = page * rows + offset).

The entry caches are uint8 ``[num_pages, page_bytes]`` tensors laid out by their entry format.
Block tables (shared by the layers of one compress ratio in a real engine) ride along for
convenience: tests build :class:`~vllm_dsv4_hw.attention.metadata.StepMetadata` from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from vllm_dsv4_hw.attention.metadata import BlockTables, PageGeometry
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import C4A, CACHE_FIELDS, INDEXER_COMPRESSOR, kind_of
from vllm_dsv4_hw.kv_cache.blocks import (
    ENTRIES_PER_BLOCK,
    INDEXER_ENTRIES_PER_BLOCK,
    WINDOW_POSITIONS_PER_PAGE,
    cdiv,
)
from vllm_dsv4_hw.kv_cache.buckets import KIND_BUCKET, bucket_page_bytes, rows_per_page
from vllm_dsv4_hw.kv_cache.formats import EntryFormat, make_format
from vllm_dsv4_hw.kv_cache.specs import FormatError, layer_cache_specs, state_row_bytes

__all__ = [
    "LayerCaches",
    "CACHE_KINDS",
    "page_geometry",
    "allocate_layer_caches",
    "positions_per_page",
    "pages_needed",
    "static_block_tables",
]

# The cache kinds of a layer (keys of num_pages / BlockTables fields).
CACHE_KINDS = CACHE_FIELDS


@dataclass
class LayerCaches:
    ratio: int
    main_format: EntryFormat  # window cache format
    window: torch.Tensor
    geometry: PageGeometry
    comp_format: EntryFormat | None = None  # same codec as main_format, comp pages
    comp: torch.Tensor | None = None
    indexer_format: EntryFormat | None = None
    indexer: torch.Tensor | None = None
    main_state: torch.Tensor | None = None  # [rows, 2*coff*head_dim] fp32
    indexer_state: torch.Tensor | None = None  # [rows, 2*2*index_head_dim] fp32
    block_tables: BlockTables | None = None

    @property
    def num_pages(self) -> dict[str, int]:
        g = self.geometry
        out = {"window": self.window.shape[0]}
        if self.comp is not None:
            out["comp"] = self.comp.shape[0]
            out["main_state"] = self.main_state.shape[0] // g.main_state_rows_per_page
        if self.indexer is not None:
            out["indexer"] = self.indexer.shape[0]
            out["indexer_state"] = self.indexer_state.shape[0] // g.indexer_state_rows_per_page
        return out


def page_geometry(
    cfg: DSV4Config,
    ratio: int,
    main_format: str,
    indexer_format: str,
    comp_entries_per_page: int | None = None,
) -> tuple[PageGeometry, dict[str, int]]:
    """(geometry, page bytes per kind) of a layer of compress ratio ``ratio``.

    Known formats take the bucketed page sizes of ``kv_cache.specs``; others (the exact ``fp32``
    test format) fold into buckets the same way from their entry sizes. ``comp_entries_per_page``
    overrides the compressed-cache page (default: 64 entries for c4a, 2 for c128a: one 256-position
    logical block per page).
    """
    kind = kind_of(ratio)
    # a window layer's (unused) compressor numbers are c4a's, as vLLM's layer defaults are
    shape = kind if kind.compressed else C4A
    main_e = make_format(main_format, "main", 64).entry_bytes
    idx_e = make_format(indexer_format, "indexer", 64).entry_bytes
    buckets = bucket_page_bytes(main_e, idx_e)
    # every cache field -> planner kind: the shape's own, c4a's for the indexer caches it lacks
    spec_kinds = C4A.cache_spec_kinds | shape.cache_spec_kinds
    page_bytes = {c: buckets[KIND_BUCKET[k]] for c, k in spec_kinds.items()}
    try:  # the planner's own numbers where it knows the formats
        specs = {
            s.kind: s
            for s in layer_cache_specs(cfg.with_layers((ratio,)), main_format, indexer_format)
        }
        for cache, spec_kind in kind.cache_spec_kinds.items():
            page_bytes[cache] = specs[spec_kind].page_bytes
    except FormatError:
        pass
    main_rows = rows_per_page(state_row_bytes(shape, cfg.head_dim), page_bytes["main_state"])
    idx_rows = rows_per_page(
        state_row_bytes(INDEXER_COMPRESSOR, cfg.index_head_dim), page_bytes["indexer_state"]
    )
    block_entries = ENTRIES_PER_BLOCK[shape.comp_spec_kind]
    if comp_entries_per_page is None:
        comp_entries_per_page = block_entries
    if kind.attends_all_entries and comp_entries_per_page != block_entries:
        page_bytes["comp"] = comp_entries_per_page * main_e
    geom = PageGeometry(
        window_positions_per_page=WINDOW_POSITIONS_PER_PAGE,
        comp_entries_per_page=comp_entries_per_page,
        indexer_entries_per_page=INDEXER_ENTRIES_PER_BLOCK,
        main_state_rows_per_page=main_rows,
        indexer_state_rows_per_page=idx_rows,
    )
    return geom, page_bytes


def allocate_layer_caches(
    cfg: DSV4Config,
    ratio: int,
    num_pages: int | Mapping[str, int],
    main_format: str = "fp8",
    indexer_format: str = "mxfp4",
    device: torch.device | str = "cpu",
    *,
    geometry: PageGeometry | None = None,
    comp_entries_per_page: int | None = None,
    block_tables: BlockTables | None = None,
) -> LayerCaches:
    """Zeroed caches of one layer: ``num_pages`` pages per kind (an int for every kind, or a
    mapping over :data:`CACHE_KINDS`). ``geometry`` overrides the page geometry (rows / entries per
    page); page bytes then become the natural size of that many entries."""
    kind = kind_of(ratio)
    geom, page_bytes = page_geometry(cfg, ratio, main_format, indexer_format, comp_entries_per_page)
    if geometry is not None:
        geom = geometry
        page_bytes = {}
    if isinstance(num_pages, int):
        num_pages = {k: num_pages for k in CACHE_KINDS}
    missing = [k for k in kind.cache_spec_kinds if k not in num_pages]
    if missing:
        raise ValueError(f"num_pages lacks {missing} for a ratio-{ratio} layer")

    g = geom
    main_fmt = make_format(main_format, "main", g.window_positions_per_page)
    caches = LayerCaches(
        ratio=ratio,
        main_format=main_fmt,
        geometry=g,
        block_tables=block_tables,
        window=main_fmt.new_cache(num_pages["window"], device, page_bytes.get("window")),
    )
    if kind.compressed:
        comp_fmt = make_format(main_format, "main", g.comp_entries_per_page)
        caches.comp_format = comp_fmt
        caches.comp = comp_fmt.new_cache(num_pages["comp"], device, page_bytes.get("comp"))
        caches.main_state = torch.zeros(
            num_pages["main_state"] * g.main_state_rows_per_page,
            kind.state_width(cfg.head_dim),
            dtype=torch.float32,
            device=device,
        )
    if kind.has_indexer:
        ifmt = make_format(indexer_format, "indexer", g.indexer_entries_per_page)
        caches.indexer_format = ifmt
        caches.indexer = ifmt.new_cache(num_pages["indexer"], device, page_bytes.get("indexer"))
        caches.indexer_state = torch.zeros(
            num_pages["indexer_state"] * g.indexer_state_rows_per_page,
            INDEXER_COMPRESSOR.state_width(cfg.index_head_dim),
            dtype=torch.float32,
            device=device,
        )
    return caches


def positions_per_page(geometry: PageGeometry, ratio: int) -> dict[str, int]:
    """Token positions one page of each kind covers."""
    g = geometry
    kind = kind_of(ratio)
    out = {"window": g.window_positions_per_page}
    if kind.compressed:
        out["comp"] = g.comp_entries_per_page * ratio
        out["main_state"] = g.main_state_rows_per_page
    if kind.has_indexer:
        out["indexer"] = g.indexer_entries_per_page * INDEXER_COMPRESSOR.ratio
        out["indexer_state"] = g.indexer_state_rows_per_page
    return out


def pages_needed(geometry: PageGeometry, ratio: int, seq_lens: Sequence[int]) -> dict[str, int]:
    """Pages per kind to hold every position of every sequence (no sliding-window release)."""
    ppp = positions_per_page(geometry, ratio)
    return {k: sum(cdiv(int(n), p) for n in seq_lens) for k, p in ppp.items()}


def static_block_tables(
    geometry: PageGeometry,
    ratio: int,
    seq_lens: Sequence[int],
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[BlockTables, dict[str, int]]:
    """Block tables giving every position of every sequence its own page (pages drawn from a
    shuffled pool when ``generator`` is given), and the page counts to allocate."""
    ppp = positions_per_page(geometry, ratio)
    counts = pages_needed(geometry, ratio, seq_lens)
    tables: dict[str, torch.Tensor] = {}
    for kind, per in ppp.items():
        blocks = [cdiv(int(n), per) for n in seq_lens]
        width = max([1] + blocks)
        total = counts[kind]
        order = (
            torch.randperm(total, generator=generator)
            if generator is not None
            else torch.arange(total)
        )
        bt = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
        start = 0
        for r, b in enumerate(blocks):
            bt[r, :b] = order[start : start + b].to(torch.int32)
            start += b
        tables[kind] = bt.to(device)
    counts = {k: max(1, v) for k, v in counts.items()}
    return BlockTables(**tables), counts
