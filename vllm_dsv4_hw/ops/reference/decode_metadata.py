# SPDX-License-Identifier: Apache-2.0
"""Reference decode metadata: torch ops only, fixed shapes, no host synchronization.

Graph safe on every device (each output is a fresh tensor computed from the inputs on the device;
captured once, its values follow the inputs on replay). See ``ops.api.decode_metadata``.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops.api import DECODE_METADATA, DecodeLayout
from vllm_dsv4_hw.ops.checks import check_decode_metadata_tables
from vllm_dsv4_hw.ops.registry import register_op


def _pages(
    table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, per_page: int, null_page: int
) -> torch.Tensor:
    """Page id of logical index ``index`` (>= 0) of each row, -1 where absent."""
    col = (index // per_page).clamp(max=table.shape[1] - 1)
    page = table[rows, col].to(torch.int64)
    return torch.where(page > null_page, page, torch.full_like(page, -1))


def _slots(table, rows, index, per_page, null_page, stride=None, ok=None) -> torch.Tensor:
    """``page * stride + index % per_page`` (stride defaults to per_page); -1 where the index is
    negative, ``ok`` is False, or the page is absent."""
    valid = index >= 0 if ok is None else ok & (index >= 0)
    safe = torch.where(valid, index, torch.zeros_like(index))
    page = _pages(table, rows, safe, per_page, null_page)
    slot = page * (per_page if stride is None else stride) + safe % per_page
    return torch.where(valid & (page >= 0), slot, torch.full_like(slot, -1))


def _plan(
    out: dict,
    name: str,
    pos: torch.Tensor,
    rows: torch.Tensor,
    ratio: int,
    state_table,
    rpp: int,
    stride: int,
    cache_table,
    epp: int,
    null_page: int,
) -> None:
    kind = kind_of(ratio)
    width = kind.group_width
    out[f"{name}.state_slots"] = _slots(state_table, rows, pos, rpp, null_page, stride)
    completes = (pos >= 0) & (torch.remainder(pos + 1, ratio) == 0)
    mpos = pos[:, None] + torch.arange(width, device=pos.device) - (width - 1)
    out[f"{name}.group_rows"] = _slots(
        state_table, rows[:, None], mpos, rpp, null_page, stride, ok=completes[:, None]
    )
    entry = torch.where(
        completes, torch.div(pos + 1, ratio, rounding_mode="floor") - 1, torch.zeros_like(pos)
    )
    out[f"{name}.entry"] = entry
    out[f"{name}.cache_slots"] = _slots(cache_table, rows, entry, epp, null_page, ok=completes)


def _absent_as_minus_one(table: torch.Tensor, null_page: int) -> torch.Tensor:
    t = table.to(torch.int64)
    return torch.where(t > null_page, t, torch.full_like(t, -1))


@register_op(DECODE_METADATA, "reference")
def decode_metadata(
    seq_lens: torch.Tensor, tables: dict[str, torch.Tensor], layout: DecodeLayout
) -> dict[str, torch.Tensor]:
    kind = check_decode_metadata_tables(tables, layout.ratio)
    lay = layout
    pos = seq_lens.to(torch.int64) - 1
    b = pos.shape[0]
    rows = torch.arange(b, device=pos.device)
    out: dict[str, torch.Tensor] = {"positions": pos}
    wt = tables["window"]
    out["window_insert_slots"] = _slots(wt, rows, pos, lay.window_per_page, lay.null_page)
    offs = torch.arange(lay.sliding_window, device=pos.device) - (lay.sliding_window - 1)
    wpos = pos[:, None] + offs[None, :]
    out["window_slots"] = _slots(
        wt, rows[:, None], wpos, lay.window_per_page, lay.null_page, ok=(pos >= 0)[:, None]
    )
    if kind.compressed:
        _plan(
            out,
            "main",
            pos,
            rows,
            kind.ratio,
            tables["main_state"],
            lay.main_state_per_page,
            lay.main_state_stride,
            tables["comp"],
            lay.comp_per_page,
            lay.null_page,
        )
        out["comp_table"] = _absent_as_minus_one(tables["comp"], lay.null_page)
    if kind.has_indexer:
        _plan(
            out,
            "indexer",
            pos,
            rows,
            kind.ratio,
            tables["indexer_state"],
            lay.indexer_state_per_page,
            lay.indexer_state_stride,
            tables["indexer"],
            lay.indexer_per_page,
            lay.null_page,
        )
        out["indexer_table"] = _absent_as_minus_one(tables["indexer"], lay.null_page)
    if kind.attends_all_entries:
        k = lay.max_comp_entries
        idx = torch.arange(k, device=pos.device).expand(b, k)
        end = torch.div(pos + 1, kind.ratio, rounding_mode="floor")
        out["comp_slots"] = _slots(
            tables["comp"],
            rows[:, None],
            idx,
            lay.comp_per_page,
            lay.null_page,
            ok=idx < end[:, None],
        )
    return out
