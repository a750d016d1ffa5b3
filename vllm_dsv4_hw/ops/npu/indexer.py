# SPDX-License-Identifier: Apache-2.0
"""npu ``indexer_topk``: bf16 queries over bf16 keys (Ascend's indexer format): ``npu_lightning_indexer`` with
query layout TND (every token its own batch) and key layout PA_BSND straight on the cache pages
(``[pages, 64, 1, 128]`` bf16: the bf16 page holds exactly that), the block-table row of the token's
request, and ``actual_seq_lengths_key`` = the entries visible to the token (``(pos + 1) // ratio``),
so rightDownCausal masking with one query per batch admits exactly the visible entries. Indices past
``min(topk, visible)`` are set to -1 afterwards. Other formats / dtypes: the reference.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import INDEXER_TOPK
from vllm_dsv4_hw.ops.npu._vendor import call, npu_op
from vllm_dsv4_hw.ops.reference import indexer as ref_indexer
from vllm_dsv4_hw.ops.registry import register_op

LI_MAX_HEADS = 64
LI_DIM = 128
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


def _fits_li(q, key_fmt, topk: int) -> bool:
    return (
        q.dtype == torch.bfloat16
        and q.dim() == 3
        and q.shape[-1] == LI_DIM
        and 0 < q.shape[1] <= LI_MAX_HEADS
        and getattr(key_fmt, "name", "") == "bf16"
        and key_fmt.dim == LI_DIM
        and key_fmt.entries_per_page % 16 == 0
        and key_fmt.entries_per_page <= 1024
        and topk in LI_SPARSE_COUNTS
    )


@register_op(INDEXER_TOPK, "npu")
@npu_op(INDEXER_TOPK, ref_indexer.indexer_topk)
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_fmt,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    topk: int,
    ratio: int = 4,
    q_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    if q_scales is not None:  # e4m3 codes: the vendor indexer takes bf16 q (exact from e4m3)
        q = ref_indexer.query_values(q, q_scales).to(torch.bfloat16)
    if not _fits_li(q, key_fmt, topk) or q.shape[0] == 0:
        return ref_indexer.indexer_topk(
            q, weights, key_cache, key_fmt, block_table, token_req, token_pos, topk, ratio
        )
    dev = q.device
    t = q.shape[0]
    e = key_fmt.entries_per_page
    data_v, _ = key_fmt.page_views(key_cache)  # [P, E, 256] uint8
    key = data_v.view(torch.bfloat16).unsqueeze(2)  # [P, E, 1, 128] bf16
    if not key.is_contiguous():  # padded pages (tests); a bf16 bucket page is exactly E entries
        key = key.contiguous()
    req = token_req.to(device=dev, dtype=torch.int64)
    pos = token_pos.to(device=dev, dtype=torch.int64)
    live = req >= 0
    visible = torch.where(
        live, torch.div(pos + 1, ratio, rounding_mode="floor").clamp(min=0), torch.zeros_like(pos)
    )
    bt = block_table.to(device=dev)
    nb = bt.shape[1]
    if bool((live & (req >= bt.shape[0])).any()):
        raise ValueError(f"indexer_topk: token_req rows must lie in [0, {bt.shape[0]})")
    rows = bt[req.clamp(min=0, max=bt.shape[0] - 1)].to(torch.int32)  # [T, nb]
    need = cdiv_t(visible, e)
    if bool((need > nb).any()):
        raise ValueError(
            f"indexer_topk: a token sees {int(visible.max())} entries, more than "
            f"block_table's {nb} pages x {e} entries hold"
        )
    col = torch.arange(nb, device=dev)[None, :]
    if bool(((col < need[:, None]) & (rows < 0)).any()):
        raise ValueError("indexer_topk: a visible entry lies in an unallocated page")
    qsl = torch.arange(1, t + 1, device=dev, dtype=torch.int32)
    idx, _ = call(
        "npu_lightning_indexer",
        q.contiguous(),
        key,
        weights.to(torch.float32).contiguous(),
        actual_seq_lengths_query=qsl,
        actual_seq_lengths_key=visible.to(torch.int32),
        block_table=rows,
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=int(topk),
        sparse_mode=3,
    )
    out = idx.reshape(t, topk).to(torch.int32)
    keep = torch.arange(topk, device=dev)[None, :] < visible.clamp(max=topk)[:, None]
    return torch.where(keep, out, torch.full_like(out, -1))


def cdiv_t(n: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(n + d - 1, d, rounding_mode="floor")
