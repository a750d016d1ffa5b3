# SPDX-License-Identifier: Apache-2.0
"""Per-step attention metadata for one layer kind (compress ratio 0, 4 or 128) over a varlen batch.

A step processes ``num_new[r]`` new tokens of every request ``r`` (prefill chunks and decode tokens
mixed; 0 is allowed) after ``seq_starts[r]`` tokens already in the caches. Tokens are concatenated
request by request (``query_start_loc``). Everything here is index arithmetic, vectorized over
tokens (no Python loop over tokens or requests), computed once per step and layer kind and shared
by every layer of that kind:

* ``positions`` / ``token_req``: position and request of every new token;
* ``window_insert_slots`` [T]: where each token's KV goes in the window cache;
* ``window_slots`` [T, W]: the window candidates, positions ``t-W+1 .. t`` oldest first
  (W = ``sliding_window`` = 128), -1 where the position is < 0 (or its page was released);
* ``comp_entry_end`` [T]: compressed entries ``0 .. end-1`` are visible to the token
  (``end = (t + 1) // ratio``: entry i is visible iff ``ratio*i + ratio - 1 <= t``);
* ``main_plan`` / ``indexer_plan``: compressor plans (``attention.compressor_plan``) of the main
  compressor (ratio 4 and 128) and of the indexer's compressor (ratio 4 only);
* ``comp_slots`` [T, K] (ratio 128 only): cache slots of every visible compressed entry, -1 pad
  (c4a layers get theirs from the indexer's top-k at run time).

Slots follow ``page * per_page + offset`` through each cache kind's block table
(:class:`BlockTables`), with the page geometry of :class:`PageGeometry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_dsv4_hw.attention.compressor_plan import CompressorPlan, compressor_plan
from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR, kind_of
from vllm_dsv4_hw.kv_cache.paged import logical_to_slot

__all__ = ["PageGeometry", "BlockTables", "StepMetadata", "build_step_metadata"]


@dataclass(frozen=True)
class PageGeometry:
    """Entries (or positions / state rows) per page of each cache kind of one layer kind."""

    window_positions_per_page: int = 64  # window KV: one entry per position
    comp_entries_per_page: int = 64  # compressed KV: 64 (c4a), 2 (c128a) per logical block
    indexer_entries_per_page: int = 64  # indexer keys (c4a)
    main_state_rows_per_page: int = 4  # main compressor state rows (one per position)
    indexer_state_rows_per_page: int = 2  # indexer compressor state rows

    def __post_init__(self) -> None:
        for name in (
            "window_positions_per_page",
            "comp_entries_per_page",
            "indexer_entries_per_page",
            "main_state_rows_per_page",
            "indexer_state_rows_per_page",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PageGeometry.{name} must be a positive int, got {v!r}")


@dataclass
class BlockTables:
    """Block tables [R, B] (page ids, -1 = not allocated / released) of one layer kind's caches.

    Layers of the same compress ratio share them (vLLM's KV cache groups). ``comp``, ``main_state``
    are needed for ratio 4 and 128; ``indexer`` and ``indexer_state`` for ratio 4.
    """

    window: torch.Tensor
    comp: torch.Tensor | None = None
    indexer: torch.Tensor | None = None
    main_state: torch.Tensor | None = None
    indexer_state: torch.Tensor | None = None


@dataclass
class StepMetadata:
    ratio: int
    sliding_window: int
    geometry: PageGeometry
    block_tables: BlockTables
    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [R+1] int64
    seq_starts: torch.Tensor  # [R] int64: tokens cached before this step
    seq_lens: torch.Tensor  # [R] int64: tokens cached after this step
    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64
    window_insert_slots: torch.Tensor  # [T] int64
    window_slots: torch.Tensor  # [T, W] int64, oldest first, -1 pad
    comp_entry_end: torch.Tensor  # [T] int64: visible compressed entries are 0..end-1
    # >= max of comp_entry_end, known on the host (0 for ratio 0): the exact max for a varlen
    # step, the block table's bound for a decode step (fixed under graphs)
    max_visible_entries: int
    main_plan: CompressorPlan | None = None
    indexer_plan: CompressorPlan | None = None
    comp_slots: torch.Tensor | None = None  # [T, K] int64 (ratio 128), -1 pad

    @property
    def device(self) -> torch.device:
        return self.positions.device


def _as_long(x, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64).to(device=device).reshape(-1)


def _need(bt: torch.Tensor | None, what: str, ratio: int) -> torch.Tensor:
    if bt is None:
        raise ValueError(f"build_step_metadata: ratio {ratio} needs the {what} block table")
    if bt.dim() != 2:
        raise ValueError(
            f"build_step_metadata: {what} block table must be [R, B], got {tuple(bt.shape)}"
        )
    return bt


def build_step_metadata(
    seq_starts: torch.Tensor | Sequence[int],
    num_new: torch.Tensor | Sequence[int],
    ratio: int,
    block_tables: BlockTables,
    geometry: PageGeometry = PageGeometry(),
    sliding_window: int = 128,
    max_comp_entries: int | None = None,
) -> StepMetadata:
    """Metadata of one step for the layers of compress ratio ``ratio``.

    seq_starts [R]: tokens already cached per request; num_new [R]: new tokens of the step (>= 0).
    ``max_comp_entries`` fixes the width K of ``comp_slots`` (ratio 128; e.g. for CUDA graphs);
    by default K is the largest number of visible entries in the step. Tensors live on the device
    of ``block_tables.window``.
    """
    kind = kind_of(ratio)
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    wbt = _need(block_tables.window, "window", ratio)
    device = wbt.device
    seq_starts = _as_long(seq_starts, device)
    num_new = _as_long(num_new, device)
    if seq_starts.shape != num_new.shape:
        raise ValueError(
            f"seq_starts {tuple(seq_starts.shape)} and num_new {tuple(num_new.shape)} "
            f"must both be [R]"
        )
    if bool((seq_starts < 0).any()) or bool((num_new < 0).any()):
        raise ValueError("seq_starts and num_new must be >= 0")
    num_reqs = int(seq_starts.numel())
    if wbt.shape[0] < num_reqs:
        raise ValueError(f"window block table has {wbt.shape[0]} rows for {num_reqs} requests")
    g = geometry

    qsl = torch.zeros(num_reqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(num_new, 0, out=qsl[1:])
    num_tokens = int(qsl[-1].item()) if num_reqs else 0
    token_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), num_new, output_size=num_tokens
    )
    token_idx = torch.arange(num_tokens, device=device, dtype=torch.int64)
    positions = seq_starts[token_req] + (token_idx - qsl[:-1][token_req])

    wpp = g.window_positions_per_page
    window_insert_slots = logical_to_slot(wbt, token_req, positions, wpp)
    if num_tokens and bool((window_insert_slots < 0).any()):
        raise ValueError("build_step_metadata: a new token's window page is not allocated")
    offs = torch.arange(sliding_window, device=device, dtype=torch.int64) - (sliding_window - 1)
    win_pos = positions[:, None] + offs[None, :]  # [T, W], oldest first
    # Positions < 0 give -1 without touching the table; so do released pages (-1 entries).
    window_slots = logical_to_slot(wbt, token_req, win_pos, wpp)

    if not kind.compressed:
        comp_entry_end = torch.zeros_like(positions)
    else:
        comp_entry_end = torch.div(positions + 1, ratio, rounding_mode="floor")
    max_visible = int(comp_entry_end.max().item()) if num_tokens else 0

    main_plan = indexer_plan = comp_slots = None
    if kind.compressed:
        cbt = _need(block_tables.comp, "compressed KV", ratio)
        sbt = _need(block_tables.main_state, "main compressor state", ratio)
        main_plan = compressor_plan(
            qsl,
            seq_starts,
            sbt,
            g.main_state_rows_per_page,
            ratio,
            kv_block_table=cbt,
            entries_per_page=g.comp_entries_per_page,
        )
        _check_plan(main_plan, "main compressor")
    if kind.has_indexer:
        ibt = _need(block_tables.indexer, "indexer key", ratio)
        isbt = _need(block_tables.indexer_state, "indexer compressor state", ratio)
        indexer_plan = compressor_plan(
            qsl,
            seq_starts,
            isbt,
            g.indexer_state_rows_per_page,
            INDEXER_COMPRESSOR.ratio,
            kv_block_table=ibt,
            entries_per_page=g.indexer_entries_per_page,
        )
        _check_plan(indexer_plan, "indexer compressor")
    if kind.attends_all_entries:
        k = max_visible if max_comp_entries is None else int(max_comp_entries)
        if k < max_visible:
            raise ValueError(f"max_comp_entries={k} < {max_visible} entries visible in this step")
        idx = torch.arange(k, device=device, dtype=torch.int64).expand(num_tokens, k)
        idx = torch.where(idx < comp_entry_end[:, None], idx, torch.full_like(idx, -1))
        comp_slots = logical_to_slot(block_tables.comp, token_req, idx, g.comp_entries_per_page)
        if bool(((comp_slots < 0) & (idx >= 0)).any()):
            raise ValueError("build_step_metadata: a visible c128a entry's page is not allocated")

    return StepMetadata(
        ratio=ratio,
        sliding_window=sliding_window,
        geometry=g,
        block_tables=block_tables,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        query_start_loc=qsl,
        seq_starts=seq_starts,
        seq_lens=seq_starts + num_new,
        positions=positions,
        token_req=token_req,
        window_insert_slots=window_insert_slots,
        window_slots=window_slots,
        comp_entry_end=comp_entry_end,
        max_visible_entries=max_visible,
        main_plan=main_plan,
        indexer_plan=indexer_plan,
        comp_slots=comp_slots,
    )


def _check_plan(plan: CompressorPlan, what: str) -> None:
    """Fail loudly instead of silently dropping state rows or entries (unallocated pages)."""
    if plan.state_slots.numel() and bool((plan.state_slots < 0).any()):
        raise ValueError(f"build_step_metadata: a new token's {what} state page is not allocated")
    if (
        plan.cache_slots is not None
        and plan.cache_slots.numel()
        and bool((plan.cache_slots < 0).any())
    ):
        raise ValueError(
            f"build_step_metadata: a completed {what} entry's cache page is not allocated"
        )
    if plan.group_rows.numel():
        width = plan.group_rows.shape[1]
        group_pos = plan.positions[plan.group_token]
        member_pos = group_pos[:, None] + torch.arange(width, device=group_pos.device) - (width - 1)
        if bool(((plan.group_rows < 0) & (member_pos >= 0)).any()):
            raise ValueError(
                f"build_step_metadata: a {what} group needs a state row whose page "
                f"is not allocated (released too early?)"
            )
