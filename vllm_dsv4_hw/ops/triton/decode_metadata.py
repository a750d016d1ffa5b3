# SPDX-License-Identifier: Apache-2.0
"""Triton decode metadata: a handful of launches instead of the reference's ~100 small torch ops
(each a few microseconds even inside a CUDA graph, per layer kind and step).

One program per row: the window kernel writes the insert slot and the W window slots, the plan
kernel one compressor's state slot, member rows, entry and cache slot, the c128a kernel a block of
candidate slots. Pages <= ``null_page`` are absent (-1 out). Same values as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops.api import DECODE_METADATA, DecodeLayout
from vllm_dsv4_hw.ops.checks import check_decode_metadata_tables
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start


@triton.jit
def _page(bt_ptr, row_off, col, ncols, mask, NULL: tl.constexpr):
    colc = tl.minimum(col, ncols - 1)
    pg = tl.load(bt_ptr + row_off + colc, mask=mask, other=NULL).to(tl.int64)
    return tl.where(pg > NULL, pg, -1)


@triton.jit
def _slot(
    bt_ptr, row_off, idx, ncols, ok, PER: tl.constexpr, STRIDE: tl.constexpr, NULL: tl.constexpr
):
    """Slot of logical index ``idx`` (position / entry) through one block-table row, ``PER`` per
    page: page * STRIDE + idx % PER; -1 where not ``ok`` or where the page is absent."""
    idxc = tl.where(ok, idx, 0)
    pg = _page(bt_ptr, row_off, idxc // PER, ncols, ok, NULL)
    return tl.where(ok & (pg >= 0), pg * STRIDE + idxc % PER, -1)


@triton.jit
def _window_kernel(
    len_ptr,
    bt_ptr,
    bt_stride,
    bt_cols,
    ins_ptr,
    win_ptr,
    PPP: tl.constexpr,
    W: tl.constexpr,
    NULL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(len_ptr + r).to(tl.int64) - 1
    tl.store(ins_ptr + r, _slot(bt_ptr, r * bt_stride, pos, bt_cols, pos >= 0, PPP, PPP, NULL))
    wp = pos - (W - 1) + tl.arange(0, W)
    tl.store(
        win_ptr + r * W + tl.arange(0, W),
        _slot(bt_ptr, r * bt_stride, wp, bt_cols, wp >= 0, PPP, PPP, NULL),
    )


@triton.jit
def _plan_kernel(
    len_ptr,
    sbt_ptr,
    sbt_stride,
    sbt_cols,
    cbt_ptr,
    cbt_stride,
    cbt_cols,
    state_ptr,
    rows_ptr,
    entry_ptr,
    cslot_ptr,
    RATIO: tl.constexpr,
    RPP: tl.constexpr,
    STRIDE: tl.constexpr,
    E: tl.constexpr,
    WIDTH: tl.constexpr,
    BW: tl.constexpr,
    NULL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(len_ptr + r).to(tl.int64) - 1
    ok = pos >= 0
    tl.store(state_ptr + r, _slot(sbt_ptr, r * sbt_stride, pos, sbt_cols, ok, RPP, STRIDE, NULL))
    completes = ok & (((pos + 1) % RATIO) == 0)
    k = tl.arange(0, BW)
    mp = pos - (WIDTH - 1) + k
    pos_v = pos + k * 0  # pos as a vector
    done_v = (pos_v >= 0) & (((pos_v + 1) % RATIO) == 0)  # `completes` as a vector
    okm = (k < WIDTH) & (mp >= 0) & done_v
    tl.store(
        rows_ptr + r * WIDTH + k,
        _slot(sbt_ptr, r * sbt_stride, mp, sbt_cols, okm, RPP, STRIDE, NULL),
        mask=k < WIDTH,
    )
    entry = tl.where(completes, (pos + 1) // RATIO - 1, 0)
    tl.store(entry_ptr + r, entry)
    tl.store(cslot_ptr + r, _slot(cbt_ptr, r * cbt_stride, entry, cbt_cols, completes, E, E, NULL))


@triton.jit
def _c128_kernel(
    len_ptr,
    bt_ptr,
    bt_stride,
    bt_cols,
    out_ptr,
    K,
    RATIO: tl.constexpr,
    E: tl.constexpr,
    BK: tl.constexpr,
    NULL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    end = tl.maximum(tl.load(len_ptr + r).to(tl.int64), 0) // RATIO
    k = blk * BK + tl.arange(0, BK)
    inside = k < K
    vis = inside & (k < end)
    tl.store(
        out_ptr + r * K + k, _slot(bt_ptr, r * bt_stride, k, bt_cols, vis, E, E, NULL), mask=inside
    )


def _table(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _plan(out, name, lens, ratio, state_table, rpp, stride, cache_table, epp, null):
    b = lens.shape[0]
    width = kind_of(ratio).group_width
    dev = lens.device
    state = torch.empty(b, dtype=torch.int64, device=dev)
    rows = torch.empty(b, width, dtype=torch.int64, device=dev)
    entry = torch.empty(b, dtype=torch.int64, device=dev)
    cslot = torch.empty(b, dtype=torch.int64, device=dev)
    sbt, cbt = _table(state_table), _table(cache_table)
    if b:
        _plan_kernel[(b,)](
            lens,
            sbt,
            sbt.stride(0),
            sbt.shape[1],
            cbt,
            cbt.stride(0),
            cbt.shape[1],
            state,
            rows,
            entry,
            cslot,
            RATIO=ratio,
            RPP=rpp,
            STRIDE=stride,
            E=epp,
            WIDTH=width,
            BW=next_pow2(width),
            NULL=null,
            **pdl_launch(dev),
        )
    out.update(
        {
            f"{name}.state_slots": state,
            f"{name}.group_rows": rows,
            f"{name}.entry": entry,
            f"{name}.cache_slots": cslot,
        }
    )


@register_op(DECODE_METADATA, "triton")
def decode_metadata(
    seq_lens: torch.Tensor, tables: dict[str, torch.Tensor], layout: DecodeLayout
) -> dict[str, torch.Tensor]:
    kind = check_decode_metadata_tables(tables, layout.ratio)
    lay = layout
    null = lay.null_page
    lens = seq_lens if seq_lens.stride(0) == 1 else seq_lens.contiguous()
    b = lens.shape[0]
    dev = lens.device
    w = lay.sliding_window
    out = {"positions": lens.to(torch.int64) - 1}
    ins = torch.empty(b, dtype=torch.int64, device=dev)
    win = torch.empty(b, w, dtype=torch.int64, device=dev)
    wt = _table(tables["window"])
    if b:
        _window_kernel[(b,)](
            lens,
            wt,
            wt.stride(0),
            wt.shape[1],
            ins,
            win,
            PPP=lay.window_per_page,
            W=w,
            NULL=null,
            **pdl_launch(dev),
        )
    out["window_insert_slots"], out["window_slots"] = ins, win
    if kind.compressed:
        _plan(
            out,
            "main",
            lens,
            kind.ratio,
            tables["main_state"],
            lay.main_state_per_page,
            lay.main_state_stride,
            tables["comp"],
            lay.comp_per_page,
            null,
        )
        ct = tables["comp"].to(torch.int64)
        out["comp_table"] = torch.where(ct > null, ct, torch.full_like(ct, -1))
    if kind.has_indexer:
        _plan(
            out,
            "indexer",
            lens,
            kind.ratio,
            tables["indexer_state"],
            lay.indexer_state_per_page,
            lay.indexer_state_stride,
            tables["indexer"],
            lay.indexer_per_page,
            null,
        )
        it = tables["indexer"].to(torch.int64)
        out["indexer_table"] = torch.where(it > null, it, torch.full_like(it, -1))
    if kind.attends_all_entries:
        k = lay.max_comp_entries
        comp = torch.empty(b, k, dtype=torch.int64, device=dev)
        ct = _table(tables["comp"])
        bk = 1024
        if b and k:
            _c128_kernel[(b, cdiv(k, bk))](
                lens,
                ct,
                ct.stride(0),
                ct.shape[1],
                comp,
                k,
                RATIO=kind.ratio,
                E=lay.comp_per_page,
                BK=bk,
                NULL=null,
                **pdl_launch(dev),
            )
        out["comp_slots"] = comp
    return out
