# SPDX-License-Identifier: Apache-2.0
"""Reference compressor ops: ``compressor_pool`` and ``compressor_store`` (spec section 3).

State rows are fp32 ``[kv (coff*d) | score (coff*d)]`` per position in a paged sliding-window cache
(see ``attention.compressor_plan``). A step writes the new tokens' rows (the score row already
includes ``ape[pos % ratio]``), then pools each completed group from its member rows:

* ratio 4 (coff 2): 8 rows; rows 0..3 (previous group) contribute channels ``[0, d)``, rows 4..7
  (the group) channels ``[d, 2d)``; per channel a softmax over the 8 scores weights the kv values.
* ratio 128 (coff 1): a per-channel softmax over the group's 128 rows.

Absent rows (slot -1: positions before 0) count as kv 0, score -inf. Vectorized over tokens and
groups; any float input dtype, fp32 math.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import register_op


def write_state_rows(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    ape: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    ratio: int,
) -> None:
    """state[slot] = [kv | score + ape[pos % ratio]] (fp32) for every token with slot >= 0."""
    width = kv.shape[-1]
    if state.shape[-1] != 2 * width:
        raise ValueError(f"state rows are {state.shape[-1]} wide, expected 2*{width}")
    if kv.shape[0] == 0:
        return
    pos = positions.to(device=kv.device, dtype=torch.int64)
    ape_rows = ape.to(device=kv.device, dtype=torch.float32)[torch.remainder(pos, ratio)]
    rows = torch.cat([kv.to(torch.float32), score.to(torch.float32) + ape_rows], dim=-1)
    slots = state_slots.to(device=kv.device, dtype=torch.int64)
    valid = slots >= 0
    if bool(valid.all()):
        state[slots] = rows.to(state.dtype)
    else:
        state[slots[valid]] = rows[valid].to(state.dtype)


def pool_groups(state: torch.Tensor, group_rows: torch.Tensor, ratio: int, d: int) -> torch.Tensor:
    """Pool every group from its member rows in ``state`` -> [G, d] fp32."""
    kind = kind_of(ratio)
    coff, width = kind.coff, kind.group_width
    g = group_rows.shape[0]
    if group_rows.dim() != 2 or group_rows.shape[1] != width:
        raise ValueError(
            f"group_rows must be [G, {width}] for ratio {ratio}, got {tuple(group_rows.shape)}"
        )
    if g == 0:
        return torch.zeros(0, d, dtype=torch.float32, device=state.device)
    slots = group_rows.to(device=state.device, dtype=torch.int64)
    present = (slots >= 0)[..., None]  # [G, W, 1]
    rows = state[slots.clamp(min=0)].to(torch.float32)  # [G, W, 2*coff*d]
    kv_rows = rows[..., : coff * d].reshape(g, width, coff, d)
    sc_rows = rows[..., coff * d :].reshape(g, width, coff, d)
    # member row j takes channel block j // ratio (coff 2: previous group -> [0,d), own -> [d,2d))
    block = torch.arange(width, device=state.device) // ratio  # [W] in [0, coff)
    idx = block.view(1, width, 1, 1).expand(g, width, 1, d)
    kv_sel = kv_rows.gather(2, idx).squeeze(2)  # [G, W, d]
    sc_sel = sc_rows.gather(2, idx).squeeze(2)
    kv_sel = torch.where(present, kv_sel, torch.zeros((), dtype=torch.float32, device=state.device))
    sc_sel = torch.where(
        present, sc_sel, torch.full((), float("-inf"), dtype=torch.float32, device=state.device)
    )
    weights = torch.softmax(sc_sel, dim=1)
    return (weights * kv_sel).sum(dim=1)


@register_op(api.COMPRESSOR_POOL, "reference")
def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    ape: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    group_rows: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    coff = kind_of(ratio).coff
    if kv.shape[-1] % coff:
        raise ValueError(f"kv width {kv.shape[-1]} is not a multiple of coff={coff}")
    d = kv.shape[-1] // coff
    if ape.shape != (ratio, coff * d):
        raise ValueError(f"ape must be [{ratio}, {coff * d}], got {tuple(ape.shape)}")
    write_state_rows(kv, score, positions, ape, state, state_slots, ratio)
    return pool_groups(state, group_rows, ratio, d)


def _insert(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    from vllm_dsv4_hw.kv_cache import paged

    paged.insert(cache, slots, x, fmt)


@register_op(api.COMPRESSOR_STORE, "reference")
def compressor_store(
    kv,
    score,
    positions,
    ape,
    state,
    state_slots,
    group_rows,
    ratio,
    norm_weight,
    eps,
    cos_sin,
    group_entry_index,
    cache,
    cache_slots,
    fmt,
) -> None:
    entries = compressor_pool(kv, score, positions, ape, state, state_slots, group_rows, ratio)
    if entries.shape[0] == 0:
        return
    entries = api.rms_norm(entries, norm_weight, eps)
    rope_pos = group_entry_index.to(device=entries.device, dtype=torch.int64) * ratio
    entries = api.rope(entries, rope_pos, cos_sin)
    _insert(cache, cache_slots.to(device=entries.device, dtype=torch.int64), entries, fmt)
