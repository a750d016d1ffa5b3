# SPDX-License-Identifier: Apache-2.0
"""The Triton ``indexer_topk`` op: the score pass of ``indexer`` (step 1), then the selection of
k = min(topk, n_max) entries per token (step 2, ``tuning.IndexerTuning``): the radix select over the score rows
(``topk.radix_topk``, bounded to each token's visible entries) or ``torch.topk`` then
``indexer.compact_selected``."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops import api, tuning
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.indexer.score import _MAX_SCORE_ELEMS, compact_selected, indexer_scores
from vllm_dsv4_hw.ops.triton.indexer.topk import radix_topk


@register_op(api.INDEXER_TOPK, "triton")
def indexer_topk(
    q, weights, key_cache, key_fmt, block_table, token_req, token_pos, topk, ratio=4, q_scales=None
):
    """Triton scoring kernel + selection (radix select or ``torch.topk``: ``IndexerTuning``).

    Returns [T, topk] int32: the top min(topk, visible) entry indices first (in no particular
    order), -1 after.
    No host synchronization: the score buffer spans the whole block table (n_max entries). With
    ``IndexerTuning.bounded`` the radix selection is bounded per row to the token's visible entries
    (on the device), so neither kernel writes or reads the scores of the blocks past them (under a
    1M model length the table spans 4,096 pages whatever the context); ``torch.topk`` reads every
    column: full stores.
    """
    t = q.shape[0]
    dev = q.device
    e = key_fmt.entries_per_page
    n_max = block_table.shape[1] * e
    k = min(topk, n_max)
    # both selections write every slot of [0, k): a fill only for the columns past the table
    if k == topk > 0:
        out = torch.empty(t, topk, dtype=torch.int32, device=dev)
    else:
        out = torch.full((t, topk), -1, dtype=torch.int32, device=dev)
    if t == 0 or topk <= 0 or n_max == 0:
        return out
    chosen = tuning.current().indexer
    chunk = max(1, _MAX_SCORE_ELEMS // n_max)
    for c0 in range(0, t, chunk):
        sl = slice(c0, min(t, c0 + chunk))
        dst = out[sl]
        radix = chosen.radix(dst.shape[0], n_max)
        bounded = radix and chosen.bounded
        scores = indexer_scores(
            q[sl],
            weights[sl],
            key_cache,
            key_fmt,
            block_table,
            token_req[sl],
            token_pos[sl],
            ratio,
            n_max=n_max,
            skip_tail=bounded,
            q_scales=None if q_scales is None else q_scales[sl],
        )
        if radix:
            bound = (
                dict(row_pos=token_pos[sl], row_req=token_req[sl], ratio=ratio) if bounded else {}
            )
            radix_topk(scores, k, dst, **bound)
            continue
        # unsorted (the contract's order is a set's, and sorting costs time; evidence:
        # docs/tuning.md, torch.topk fallback), then one launch puts the selected entries first
        # and -1 after, as int32
        vals, idx = torch.topk(scores, k, dim=-1, largest=True, sorted=False)
        compact_selected(vals, idx, dst)
    return out
