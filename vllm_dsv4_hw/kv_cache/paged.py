# SPDX-License-Identifier: Apache-2.0
"""Paged caches: logical entry index -> physical slot, and row insert / gather through an entry format.

A cache is a uint8 tensor ``[num_pages, page_bytes]`` laid out by an ``EntryFormat`` (data parts of a
page's E entries, then their scale parts, then padding). Slot ``s`` is entry ``s % E`` of page
``s // E``; slot -1 means "none" (skipped on insert, zeros on gather). Everything is vectorized.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat

__all__ = ["logical_to_slot", "encoded_rows", "insert_rows", "gather_rows", "insert", "gather"]


def _check_int(name: str, t: torch.Tensor) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.is_floating_point()
        or t.is_complex()
        or t.dtype == torch.bool
    ):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor, got {got}")


def logical_to_slot(
    block_table: torch.Tensor, req: torch.Tensor, index: torch.Tensor, entries_per_page: int
) -> torch.Tensor:
    """Physical slots of logical entries: ``block_table[req, index // E] * E + index % E``.

    block_table [R, B] int (page ids, negative = unallocated); req [N] request rows; index [N] or
    [N, ...] logical entry indices (req broadcasts over index's trailing dims). Returns int64 of
    index's shape with -1 where ``index < 0`` or the page id is negative. An index past the table
    (``index // E >= B``) or a request row outside ``[0, R)`` raises ValueError.
    """
    _check_int("block_table", block_table)
    _check_int("req", req)
    _check_int("index", index)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, B], got shape {tuple(block_table.shape)}")
    if entries_per_page <= 0:
        raise ValueError(f"entries_per_page must be > 0, got {entries_per_page}")
    if req.dim() != 1 or index.dim() < 1 or index.shape[0] != req.shape[0]:
        raise ValueError(
            f"req must be [N] and index [N, ...] with the same N, got "
            f"{tuple(req.shape)} and {tuple(index.shape)}"
        )
    e = entries_per_page
    device = block_table.device
    index = index.to(device=device, dtype=torch.int64)
    req = req.to(device=device, dtype=torch.int64).reshape(-1, *([1] * (index.dim() - 1)))
    req = req.expand_as(index)
    valid = index >= 0
    page_col = torch.where(valid, index // e, torch.zeros_like(index))
    if index.numel():
        r, b = block_table.shape
        if bool(((req < 0) | (req >= r)).any()):
            raise ValueError(f"req rows must lie in [0, {r}) (block_table has {r} rows)")
        if bool((page_col >= b).any()):
            raise ValueError(
                f"logical index {int(index[valid].max())} needs page column "
                f"{int(page_col.max())}, but block_table has {b} columns (E={e})"
            )
    pages = block_table.to(torch.int64)[req, page_col] if index.numel() else torch.zeros_like(index)
    slots = pages * e + index % e
    return torch.where(valid & (pages >= 0), slots, torch.full_like(slots, -1))


def _check_slots(slots: torch.Tensor, cache: torch.Tensor, fmt: EntryFormat) -> torch.Tensor:
    _check_int("slots", slots)
    slots = slots.to(device=cache.device, dtype=torch.int64)
    capacity = cache.shape[0] * fmt.entries_per_page
    if slots.numel() and bool(((slots < -1) | (slots >= capacity)).any()):
        bad = slots[(slots < -1) | (slots >= capacity)]
        raise ValueError(
            f"{fmt.name}: slots must be -1 or in [0, {capacity}) "
            f"({cache.shape[0]} pages x {fmt.entries_per_page}); got e.g. {int(bad[0])}"
        )
    return slots


def encoded_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: EntryFormat):
    """What an insert of ``x [N, fmt.dim]`` at ``slots`` writes, validated and encoded: (data page
    view [P, E, data_bytes], scale page view, slots, data, scales) of the rows with a slot (-1
    dropped); None when no row has one. Every backend's insert writes these bytes."""
    data_v, scale_v = fmt.page_views(cache)  # validates the cache
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(
            f"{fmt.name}: x must be [N, {fmt.dim}], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    slots = _check_slots(slots, cache, fmt)
    if slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"{fmt.name}: slots must be [N] with N = {x.shape[0]} rows of x, got "
            f"{tuple(slots.shape)}"
        )
    data, scales = fmt.quantize(x.to(cache.device))  # validates x
    keep = slots >= 0
    if not bool(keep.any()):
        return None
    if not bool(keep.all()):
        slots, data, scales = slots[keep], data[keep], scales[keep]
    return data_v, scale_v, slots, data, scales


def insert_rows(
    cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: EntryFormat
) -> None:
    """Quantize ``x [N, fmt.dim]`` with ``fmt`` and write row i at ``slots[i]`` (-1 skipped), in place.

    Only the entry's data bytes and scale bytes are written; neighbours and page padding are left
    untouched. Duplicate slots: one of the rows wins (unspecified which).
    """
    rows = encoded_rows(cache, slots, x, fmt)
    if rows is None:
        return
    data_v, scale_v, slots, data, scales = rows
    e = fmt.entries_per_page
    page, off = slots // e, slots % e
    data_v[page, off] = data
    if fmt.scale_bytes:
        scale_v[page, off] = scales


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: EntryFormat) -> torch.Tensor:
    """Dequantized rows at ``slots`` (any shape S) -> ``[*S, fmt.dim]`` float32; -1 gives zeros."""
    data_v, scale_v = fmt.page_views(cache)
    slots = _check_slots(slots, cache, fmt)
    out = torch.zeros(*slots.shape, fmt.dim, dtype=torch.float32, device=cache.device)
    keep = slots >= 0
    if not bool(keep.any()):
        return out
    s = slots[keep]
    e = fmt.entries_per_page
    page, off = s // e, s % e
    out[keep] = fmt.dequantize(data_v[page, off], scale_v[page, off])
    return out


# Short aliases (call sites use either).
insert = insert_rows
gather = gather_rows
