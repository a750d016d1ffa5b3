# SPDX-License-Identifier: Apache-2.0
"""Reference lightning-indexer top-k (spec section 4).

Score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) over the entries s visible to token t
(``ratio*s + ratio - 1 <= pos_t``: an entry completed by token t itself is visible); the top
``min(topk, visible)`` entry indices in descending score, then -1. Keys are dequantized from the
paged cache per request through its block table (a loop over requests); scoring is vectorized over
tokens, heads and entries (chunked over tokens to bound memory), fp32 math.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import register_op

# Upper bound on the [tokens, heads, entries] fp32 score block materialized at once.
_MAX_BLOCK_ELEMS = 1 << 25


def indexer_head_weights(w_proj_out: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Head weights of the indexer: ``(W_w x) * head_dim^-0.5 * n_heads^-0.5`` as fp32 [T, Hi]."""
    if w_proj_out.shape[-1] != n_heads:
        raise ValueError(
            f"weights_proj output has {w_proj_out.shape[-1]} heads, expected {n_heads}"
        )
    return w_proj_out.to(torch.float32) * (head_dim**-0.5 * n_heads**-0.5)


def gather_keys(
    key_cache: torch.Tensor, key_fmt, block_table: torch.Tensor, req: int, num_entries: int
) -> torch.Tensor:
    """Dequantized keys of entries 0..num_entries-1 of request ``req`` -> [num_entries, dim]."""
    s = torch.arange(num_entries, device=key_cache.device, dtype=torch.int64)
    r = torch.full_like(s, req)
    slots = paged.logical_to_slot(block_table.to(key_cache.device), r, s, key_fmt.entries_per_page)
    if bool((slots < 0).any()):
        raise ValueError(f"indexer_topk: request {req} has a visible entry in an unallocated page")
    return paged.gather_rows(key_cache, slots, key_fmt)


def query_values(q: torch.Tensor, q_scales: torch.Tensor | None) -> torch.Tensor:
    """The query of the contract: q itself, or its e4m3 codes times ``q_scales`` [T, Hi] (exact
    in fp32: an e4m3 value times a power of two)."""
    if q_scales is None:
        return q
    if q.dtype != torch.float8_e4m3fn or q_scales.shape != q.shape[:2]:
        raise ValueError(
            f"indexer_topk: q_scales {tuple(q_scales.shape)} needs q as e4m3 codes "
            f"[T, Hi, Di] with q_scales [T, Hi]; got q {q.dtype} "
            f"{tuple(q.shape)} (rope_fp8_quant gives both)"
        )
    return q.to(torch.float32) * q_scales.to(device=q.device, dtype=torch.float32)[..., None]


def score_entries(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h w[t,h] * relu(q[t,h] . k[s]) -> [T, S] fp32 (q [T,H,D], weights [T,H], keys [S,D])."""
    logits = torch.einsum("thd,sd->ths", q.to(torch.float32), keys.to(torch.float32))
    return torch.einsum("ths,th->ts", torch.relu(logits), weights.to(torch.float32))


@register_op(api.INDEXER_TOPK, "reference")
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
    q = query_values(q, q_scales)
    device = q.device
    num_tokens, num_heads, _ = q.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    if num_tokens == 0 or topk <= 0:
        return out
    token_req = token_req.to(device=device, dtype=torch.int64)
    token_pos = token_pos.to(device=device, dtype=torch.int64)
    visible = torch.div(token_pos + 1, ratio, rounding_mode="floor").clamp(min=0)  # [T]
    valid = (token_req >= 0) & (visible > 0)
    if not bool(valid.any()):
        return out
    for r in torch.unique(token_req[valid]).tolist():
        toks = torch.nonzero(valid & (token_req == r)).squeeze(1)
        n = int(visible[toks].max().item())
        keys = gather_keys(key_cache, key_fmt, block_table, r, n)  # [n, D]
        entry_idx = torch.arange(n, device=device, dtype=torch.int64)
        chunk = max(1, _MAX_BLOCK_ELEMS // max(1, num_heads * n))
        for c0 in range(0, toks.numel(), chunk):
            tk = toks[c0 : c0 + chunk]
            scores = score_entries(q[tk], weights[tk], keys)  # [t, n]
            hidden = entry_idx[None, :] >= visible[tk][:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
            k = min(topk, n)
            vals, idx = torch.topk(scores, k, dim=-1, largest=True, sorted=True)
            idx = torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)
            out[tk, :k] = idx.to(torch.int32)
    return out
