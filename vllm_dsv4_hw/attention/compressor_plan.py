# SPDX-License-Identifier: Apache-2.0
"""Slot plan for one compressor step over a varlen batch (the vLLM paged sliding-window design).

The compressor's rolling state is a paged cache of per-position fp32 rows ``[kv | score]``
(``2*coff*d`` floats), addressed through a block table like any KV cache: position ``p`` of request
``r`` lives at slot ``state_block_table[r, p // rows_per_page] * rows_per_page
+ p % rows_per_page``.

A step (``ops.compressor_pool`` / ``ops.compressor_store``) first writes every new token's row at
``state_slots``, then pools each group completed by a token of this step, reading its
``coff*ratio`` member rows at ``group_rows``. Entry ``i`` is completed by the token at position
``ratio*i + ratio - 1``; its members are positions ``ratio*i + ratio - coff*ratio .. ratio*i +
ratio - 1`` (oldest first); members before position 0 are absent (-1). Because every group reads
its members by position, chunked prefill and token-by-token decode give the entries of a one-shot
prefill.

This module only computes indices (int64, on the device of ``query_start_loc``): no Python loop
over tokens or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.kv_cache.paged import logical_to_slot

__all__ = ["CompressorPlan", "compressor_plan"]


@dataclass
class CompressorPlan:
    state_slots: torch.Tensor  # [T] int64: state row slot of every new token (-1: none)
    group_rows: torch.Tensor  # [G, coff*ratio] int64: member rows, oldest first (-1: absent)
    group_entry_index: torch.Tensor  # [G] int64: entry index i within its request
    group_req: torch.Tensor  # [G] int64: request of the group
    group_token: torch.Tensor  # [G] int64: batch index of the token completing the group
    cache_slots: torch.Tensor | None  # [G] int64: entry slot in the compressed KV cache (-1: none)
    # Conveniences for callers (not needed by the ops' slot logic):
    positions: torch.Tensor | None = None  # [T] int64: position of every new token
    token_req: torch.Tensor | None = None  # [T] int64: request of every new token

    @property
    def num_groups(self) -> int:
        return int(self.group_entry_index.numel())


def compressor_plan(
    query_start_loc: torch.Tensor,
    seq_start: torch.Tensor,
    state_block_table: torch.Tensor,
    rows_per_page: int,
    ratio: int,
    kv_block_table: torch.Tensor | None = None,
    entries_per_page: int = 64,
) -> CompressorPlan:
    """Plan one compressor step.

    query_start_loc [R+1]: token offsets of each request's new tokens in the batch.
    seq_start [R]: position of each request's first new token (tokens already processed).
    state_block_table [R, B]: pages of the compressor state cache (``rows_per_page`` rows each).
    kv_block_table [R, B2]: pages of the compressed KV cache (``entries_per_page`` entries each);
    when given, ``cache_slots`` holds the slot of every completed entry, else it is None.
    Groups are listed in batch order of their completing token. Slots follow
    ``kv_cache.paged.logical_to_slot``: a negative (unallocated) page gives -1, a position past a
    block table raises ValueError.
    """
    if ratio <= 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    device = query_start_loc.device
    qsl = query_start_loc.to(torch.int64)
    seq_start = seq_start.to(device=device, dtype=torch.int64)
    num_reqs = qsl.numel() - 1
    if seq_start.numel() != num_reqs:
        raise ValueError(f"seq_start has {seq_start.numel()} entries for {num_reqs} requests")
    query_lens = qsl[1:] - qsl[:-1]
    num_tokens = int(qsl[-1].item()) if num_reqs > 0 else 0
    width = kind_of(ratio).group_width

    token_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens
    )
    token_idx = torch.arange(num_tokens, device=device, dtype=torch.int64)
    positions = seq_start[token_req] + (token_idx - qsl[:-1][token_req])

    sbt = state_block_table.to(device)
    state_slots = logical_to_slot(sbt, token_req, positions, rows_per_page)

    completes = torch.remainder(positions + 1, ratio) == 0
    group_token = token_idx[completes]
    group_req = token_req[completes]
    group_pos = positions[completes]
    group_entry_index = torch.div(group_pos + 1, ratio, rounding_mode="floor") - 1

    offsets = torch.arange(width, device=device, dtype=torch.int64) - (width - 1)
    member_pos = group_pos[:, None] + offsets[None, :]  # [G, width], oldest first
    group_rows = logical_to_slot(sbt, group_req, member_pos, rows_per_page)

    cache_slots = None
    if kv_block_table is not None:
        cache_slots = logical_to_slot(
            kv_block_table.to(device), group_req, group_entry_index, entries_per_page
        )

    return CompressorPlan(
        state_slots=state_slots,
        group_rows=group_rows.reshape(-1, width),
        group_entry_index=group_entry_index,
        group_req=group_req,
        group_token=group_token,
        cache_slots=cache_slots,
        positions=positions,
        token_req=token_req,
    )
