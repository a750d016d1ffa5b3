"""Triton ``entry_slots``: the indexer's selected entry indices [T, K] to paged-cache slots in one
launch (the torch form is ~14 elementwise / gather launches per c4a layer at decode, on the
indexer branch's critical path). Program = one token row x ``BLOCK`` indices."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.pdl import pdl_launch, pdl_start


@triton.jit
def _entry_slots_kernel(bt_ptr, req_ptr, idx_ptr, out_ptr, k, n_cols, stride_bt, stride_idx,
                        stride_out, PER_PAGE: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    i = tl.load(idx_ptr + t * stride_idx + offs, mask=m, other=-1).to(tl.int64)
    col = i // PER_PAGE
    ok = (i >= 0) & (col < n_cols)
    req = tl.load(req_ptr + t).to(tl.int64)
    page = tl.load(bt_ptr + req * stride_bt + col, mask=m & ok, other=-1).to(tl.int64)
    slot = tl.where(ok & (page >= 0), page * PER_PAGE + i % PER_PAGE, -1)
    tl.store(out_ptr + t * stride_out + offs, slot, mask=m)


@register_op(api.ENTRY_SLOTS, "triton")
def entry_slots(block_table: torch.Tensor, token_req: torch.Tensor, idx: torch.Tensor,
                per_page: int) -> torch.Tensor:
    t, k = idx.shape
    dev = idx.device
    out = torch.empty(t, k, dtype=torch.int64, device=dev)
    if t == 0 or k == 0:
        return out
    bt = block_table if block_table.device == dev else block_table.to(dev)
    bt = bt if bt.stride(-1) == 1 else bt.contiguous()
    req = token_req if token_req.device == dev else token_req.to(dev)
    block = min(1024, next_pow2(k))
    _entry_slots_kernel[(t, cdiv(k, block))](
        bt, req, idx, out, k, bt.shape[1], bt.stride(0), idx.stride(0), out.stride(0),
        PER_PAGE=per_page, BLOCK=block, num_warps=4, **pdl_launch(dev))
    return out
