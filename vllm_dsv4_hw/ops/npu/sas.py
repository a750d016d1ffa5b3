# SPDX-License-Identifier: Apache-2.0
"""npu ``sparse_attention`` through vllm-ascend's ``npu_sparse_attn_sharedkv`` (where it is loaded).

The operator (docs/npu-ops.md, "vllm-ascend operators") computes DeepSeek V4's attention: one
softmax over a sliding window of the shared-KV cache plus compressed entries, with per-head sinks
(fp32) in the denominator -- our contract's math. Its inputs are positional, though: the window is
the 128 positions ``t-127 .. t`` read through a block table, and a compressed index ``i`` counts
only while ``i < (t + 1) // cmp_ratio`` (``t`` = ``seqused_kv - 1`` for a one-token batch), while
our contract hands explicit physical slots. So, as the torch_npu attention path does, the valid
candidates of every token are gathered (decoded once per distinct slot) and compacted to the
front, and every token becomes one batch of the operator whose two "caches" are its own pages:

* window page ``[128, 1, D]`` holding its ``n_w <= 128`` window rows; ``seqused_kv = S`` with
  ``S = n_w`` when ``n_w < 128``, else ``S`` = a multiple of 128 with ``S // 4 >= n_c``, and every
  block-table column pointing at the token's page, so the operator's window is exactly those rows;
* compressed page ``[512, 1, D]`` holding its ``n_c <= 512`` compressed rows, ``cmp_sparse_indices``
  = ``0 .. n_c - 1`` then -1 (the kernel stops at the first -1), ``cmp_ratio`` 4: the causal
  limit ``S // 4`` admits all of them (``n_c <= n_w // 4`` is required when ``n_w < 128``, which
  every real call satisfies: a position t sees min(t + 1, 128) window rows and at most
  (t + 1) // 4 compressed entries).

A call whose tokens cannot all be expressed that way (more than 128 valid window rows, more than
512 compressed ones, compressed rows without window rows, or ``n_c > n_w // 4`` below a full
window), or whose shapes the operator does not take (heads not a multiple of 64 -- it takes
exactly 64 query heads, so heads go in groups of 64 --, D != 512, fp32 / fp64 queries), returns
None and the caller uses the torch_npu path. Tokens without any candidate get zeros and are left
out of the call. The operator's lse output is documented as invalid, so none is used.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.npu._vendor import call_fn, vllm_ascend_op
from vllm_dsv4_hw.ops.reference import sparse_attention as ref_sa

OPERATOR = "npu_sparse_attn_sharedkv"
METADATA = "npu_sparse_attn_sharedkv_metadata"
SAS_HEADS = 64  # N1 supports only 64
SAS_DIM = 512
SAS_WINDOW = 128  # ori_win_left 127, ori_win_right 0 (the only supported values)
SAS_TOPK = 512  # K2 supports only 512
SAS_RATIO = 4
_CHUNK_ELEMS = 1 << 24


def operators():
    """(attention, metadata) callables when this process has vllm-ascend's ops, else None."""
    fn, meta = vllm_ascend_op(OPERATOR), vllm_ascend_op(METADATA)
    return (fn, meta) if fn is not None and meta is not None else None


def fits(q: torch.Tensor) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.dim() == 3
        and q.shape[1] % SAS_HEADS == 0
        and q.shape[2] == SAS_DIM
    )


def seq_lengths(n_w: torch.Tensor, n_c: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token ``seqused_kv`` that makes the operator read exactly the gathered rows, or None
    when some token cannot be expressed (see the module docstring)."""
    if bool((n_w > SAS_WINDOW).any()):
        return None
    if n_c is None:
        return n_w
    full = n_w == SAS_WINDOW
    ok = (n_c <= SAS_TOPK) & (full | (n_c <= n_w // SAS_RATIO)) & ((n_w > 0) | (n_c == 0))
    if not bool(ok.all()):
        return None
    need = torch.clamp(SAS_RATIO * n_c, min=SAS_WINDOW)
    return torch.where(full, (need + SAS_WINDOW - 1) // SAS_WINDOW * SAS_WINDOW, n_w)


def _compact(cache, slots, fmt, d, dev, width, dtype):
    """The valid rows of every token, first, in a page of ``width`` rows -> ([c, width, 1, D])."""
    rows, idx = ref_sa._unique_keys(cache, slots, fmt, d, dev)
    valid = slots.to(dev) >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    keys = rows.to(dtype)[idx.gather(1, order)][:, :width]  # only invalid rows are cut
    page = torch.zeros(keys.shape[0], width, d, dtype=dtype, device=dev)
    page[:, : keys.shape[1]] = keys
    return page.unsqueeze(2)


def sparse_attention(
    ops, q, window_cache, window_slots, comp_cache, comp_slots, fmt, comp_fmt, sink, scale, use_comp
) -> torch.Tensor | None:
    """The contract's result through the operator, or None where the call does not fit it."""
    fn, meta_fn = ops
    t, h, d = q.shape
    dev = q.device
    n_w_all = (window_slots >= 0).sum(dim=1).to(torch.int64)
    n_c_all = (comp_slots >= 0).sum(dim=1).to(torch.int64) if use_comp else None
    lengths_all = seq_lengths(n_w_all, n_c_all)
    if lengths_all is None:
        return None
    out = torch.zeros(t, h, d, dtype=q.dtype, device=dev)
    sinkf = sink.to(device=dev, dtype=torch.float32)
    per_token = (SAS_WINDOW + (SAS_TOPK if use_comp else 0)) * d
    chunk = max(1, _CHUNK_ELEMS // per_token)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        live = (n_w_all[s:e] > 0).nonzero().flatten()  # the rest have no candidate: zeros
        if live.numel() == 0:
            continue
        c = live.numel()
        lengths = lengths_all[s:e][live].to(device=dev, dtype=torch.int32)
        ori_kv = _compact(window_cache, window_slots[s:e][live], fmt, d, dev, SAS_WINDOW, q.dtype)
        max_len = int(lengths.max())
        cols = max(1, -(-max_len // SAS_WINDOW))
        own = torch.arange(c, device=dev, dtype=torch.int32)[:, None]
        kwargs = dict(
            ori_kv=ori_kv,
            ori_block_table=own.expand(c, cols).contiguous(),
            cu_seqlens_q=torch.arange(c + 1, device=dev, dtype=torch.int32),
            seqused_kv=lengths,
            softmax_scale=float(scale),
            cmp_ratio=1,
            ori_mask_mode=4,
            ori_win_left=SAS_WINDOW - 1,
            ori_win_right=0,
            layout_q="TND",
            layout_kv="PA_ND",
        )
        if use_comp:
            n_c = n_c_all[s:e][live].to(dev)
            ar = torch.arange(SAS_TOPK, device=dev)
            kwargs.update(
                cmp_kv=_compact(
                    comp_cache, comp_slots[s:e][live], comp_fmt, d, dev, SAS_TOPK, q.dtype
                ),
                cmp_block_table=own.contiguous(),
                cmp_ratio=SAS_RATIO,
                cmp_mask_mode=3,
                cmp_sparse_indices=torch.where(ar[None, :] < n_c[:, None], ar[None, :], -1)
                .to(torch.int32)
                .unsqueeze(1)
                .contiguous(),
            )
        metadata = call_fn(
            METADATA,
            meta_fn,
            num_heads_q=SAS_HEADS,
            num_heads_kv=1,
            head_dim=d,
            cu_seqlens_q=kwargs["cu_seqlens_q"],
            seqused_kv=lengths,
            batch_size=c,
            max_seqlen_q=1,
            max_seqlen_kv=max_len,
            cmp_topk=SAS_TOPK if use_comp else 0,
            cmp_ratio=SAS_RATIO if use_comp else 1,
            ori_mask_mode=4,
            cmp_mask_mode=3,
            ori_win_left=SAS_WINDOW - 1,
            ori_win_right=0,
            layout_q="TND",
            layout_kv="PA_ND",
            has_ori_kv=True,
            has_cmp_kv=bool(use_comp),
            device=str(dev),
        )
        parts = []
        for h0 in range(0, h, SAS_HEADS):
            o, _ = call_fn(
                OPERATOR,
                fn,
                q[s:e][live, h0 : h0 + SAS_HEADS].contiguous(),
                sinks=sinkf[h0 : h0 + SAS_HEADS].contiguous(),
                metadata=metadata,
                return_softmax_lse=False,
                **kwargs,
            )
            parts.append(o.reshape(c, SAS_HEADS, d))
        out[s + live] = torch.cat(parts, dim=1).to(q.dtype)
    return out
