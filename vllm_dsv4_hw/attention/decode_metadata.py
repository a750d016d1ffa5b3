# SPDX-License-Identifier: Apache-2.0
"""Step metadata of a decode batch (one token per row) without host synchronization.

``build_step_metadata`` (``attention.metadata``) serves any varlen step: it validates pages on the
host and sizes its outputs by the data (completed groups, visible c128a entries), so it cannot be
captured in a device graph. A decode step has fixed shapes once

* every row carries one compressor group slot: a token that completes no entry gets member rows
  -1 and cache slot -1, which the compressor ops skip;
* the c128a candidate list has the fixed width ``max_comp_entries`` (every entry a position below
  the model length can see), -1 past each token's visible entries;
* padding rows (``seq_lens == 0``, as vLLM pads a batch to a captured size) get -1 everywhere.

:func:`decode_step_metadata` derives the whole :class:`StepMetadata` from ``seq_lens`` and the block
tables with device ops only (``ops.decode_metadata``; a Triton kernel set on GPUs), so the same call
runs eagerly and inside a captured graph. Its values equal the general builder's for the same step
(tested), with the plans padded to one group per row.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.compressor_plan import CompressorPlan
from vllm_dsv4_hw.attention.metadata import BlockTables, PageGeometry, StepMetadata
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops.api import DecodeLayout

__all__ = ["decode_layout", "decode_step_metadata"]


def decode_layout(
    ratio: int,
    geometry: PageGeometry,
    sliding_window: int,
    max_positions: int,
    null_page: int = -1,
    main_state_stride: int | None = None,
    indexer_state_stride: int | None = None,
) -> DecodeLayout:
    """The static part of a kind's decode metadata (built once per layer kind)."""
    g = geometry
    kind = kind_of(ratio)
    return DecodeLayout(
        ratio=ratio,
        sliding_window=sliding_window,
        window_per_page=g.window_positions_per_page,
        comp_per_page=g.comp_entries_per_page,
        indexer_per_page=g.indexer_entries_per_page,
        main_state_per_page=g.main_state_rows_per_page,
        main_state_stride=main_state_stride or g.main_state_rows_per_page,
        indexer_state_per_page=g.indexer_state_rows_per_page,
        indexer_state_stride=indexer_state_stride or g.indexer_state_rows_per_page,
        max_comp_entries=max_positions // ratio if kind.attends_all_entries else 0,
        null_page=null_page,
    )


def _plan(out: dict, name: str, rows: torch.Tensor, pos: torch.Tensor) -> CompressorPlan:
    return CompressorPlan(
        state_slots=out[f"{name}.state_slots"],
        group_rows=out[f"{name}.group_rows"],
        group_entry_index=out[f"{name}.entry"],
        group_req=rows,
        group_token=rows,
        cache_slots=out[f"{name}.cache_slots"],
        positions=pos,
        token_req=rows,
    )


def _entry_bound(kind, layout: DecodeLayout, tables: BlockTables) -> int:
    """A bound on the entries a row can see that needs no data: fixed shapes under graphs."""
    if kind.attends_all_entries:
        return layout.max_comp_entries
    if kind.has_indexer:
        return tables.indexer.shape[1] * layout.indexer_per_page
    return 0


def decode_step_metadata(
    seq_lens: torch.Tensor, block_tables: BlockTables, geometry: PageGeometry, layout: DecodeLayout
) -> StepMetadata:
    """Metadata of a decode step of ``seq_lens.shape[0]`` rows (see the module docstring)."""
    kind = kind_of(layout.ratio)
    tables = {c: getattr(block_tables, c) for c in kind.caches}
    out = ops.decode_metadata(seq_lens, tables, layout)
    pos = out["positions"]
    b = pos.shape[0]
    dev = pos.device
    rows = torch.arange(b, device=dev)
    lens = pos + 1
    main = _plan(out, "main", rows, pos) if kind.compressed else None
    idx = _plan(out, "indexer", rows, pos) if kind.has_indexer else None
    tables_out = BlockTables(
        window=block_tables.window,
        comp=out.get("comp_table"),
        indexer=out.get("indexer_table"),
        main_state=block_tables.main_state,
        indexer_state=block_tables.indexer_state,
    )
    end = (
        torch.div(lens.clamp(min=0), kind.ratio, rounding_mode="floor")
        if kind.compressed
        else torch.zeros_like(pos)
    )
    return StepMetadata(
        ratio=kind.ratio,
        sliding_window=layout.sliding_window,
        geometry=geometry,
        block_tables=tables_out,
        num_reqs=b,
        num_tokens=b,
        query_start_loc=torch.arange(b + 1, device=dev),
        seq_starts=pos,
        seq_lens=lens,
        positions=pos,
        token_req=rows,
        window_insert_slots=out["window_insert_slots"],
        window_slots=out["window_slots"],
        comp_entry_end=end,
        max_visible_entries=_entry_bound(kind, layout, tables_out),
        main_plan=main,
        indexer_plan=idx,
        comp_slots=out.get("comp_slots"),
    )
