# SPDX-License-Identifier: Apache-2.0
"""Reference sparse attention: one softmax over window + compressed candidates, with a per-head sink.

For token t and head h with candidate keys k_s (window candidates first, then compressed ones,
concatenated without de-duplication; slot -1 = no candidate):

    o[t, h] = sum_s exp(l_s - m) k_s / (sum_s exp(l_s - m) + exp(sink_h - m)),  l_s = scale * q.k_s,

with m = max(max_s l_s, sink_h). K = V (shared KV, MQA). A token without any valid candidate gets 0.
Math in fp32 (float64 when q is float64); the result is cast to q's dtype.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache.paged import gather_rows
from vllm_dsv4_hw.ops.api import SPARSE_ATTENTION
from vllm_dsv4_hw.ops.checks import check_sparse_attention_args
from vllm_dsv4_hw.ops.registry import register_op

# Upper bound on the float elements of one token chunk's gathered keys / logits.
_CHUNK_ELEMS = 1 << 24


def _unique_keys(
    cache: torch.Tensor | None, slots: torch.Tensor, fmt, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize each distinct slot once: (rows [U, dim] fp32, index [*slots.shape] into rows).
    Slot -1 maps to a zero row (it is masked out anyway)."""
    if slots.numel() == 0 or cache is None:
        rows = torch.zeros(1, dim, dtype=torch.float32, device=device)
        return rows, torch.zeros(slots.shape, dtype=torch.long, device=device)
    uniq, inverse = torch.unique(
        slots.to(device=cache.device, dtype=torch.long), return_inverse=True
    )
    rows = gather_rows(cache, uniq, fmt)
    return rows.to(device), inverse.to(device)


@register_op(SPARSE_ATTENTION, "reference")
def sparse_attention(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    comp_cache: torch.Tensor | None,
    comp_slots: torch.Tensor | None,
    fmt,
    sink: torch.Tensor,
    scale: float,
    comp_fmt=None,
) -> torch.Tensor:
    comp_fmt = fmt if comp_fmt is None else comp_fmt
    t, h, d, use_comp = check_sparse_attention_args(
        q, window_slots, comp_cache, comp_slots, fmt, sink, comp_fmt
    )

    md = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    out = torch.zeros(t, h, d, dtype=md, device=dev)
    if t == 0:
        return out.to(q.dtype)

    # Distinct cache rows once per call (neighbouring tokens share most window rows); the
    # compressed rows go after the window rows in one key table.
    w_rows, w_idx = _unique_keys(window_cache, window_slots, fmt, d, dev)
    w_valid = window_slots.to(dev) >= 0
    if use_comp:
        c_rows, c_idx = _unique_keys(comp_cache, comp_slots, comp_fmt, d, dev)
        rows = torch.cat([w_rows, c_rows]).to(md)
        idx = torch.cat([w_idx, c_idx + w_rows.shape[0]], dim=1)
        valid = torch.cat([w_valid, comp_slots.to(dev) >= 0], dim=1)
    else:
        rows, idx, valid = w_rows.to(md), w_idx, w_valid

    n = idx.shape[1]
    qf = q.to(md)
    sinkf = sink.to(device=dev, dtype=md)
    chunk = max(1, _CHUNK_ELEMS // max(1, n * max(d, h)))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        keys = rows[idx[s:e]]  # [c, N, D]
        vmask = valid[s:e]  # [c, N]
        logits = torch.einsum("chd,cnd->chn", qf[s:e], keys) * scale
        logits = logits.masked_fill(~vmask[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1), sinkf[None, :])  # [c, H]
        any_valid = vmask.any(dim=-1)  # [c]
        # Rows without candidates (and -inf sinks) would give -inf - -inf: pin m to 0 there.
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m[..., None])  # masked -> 0
        denom = p.sum(dim=-1) + torch.exp(sinkf[None, :] - m)  # [c, H]
        o = torch.einsum("chn,cnd->chd", p, keys) / denom[..., None]
        out[s:e] = torch.where(any_valid[:, None, None], o, torch.zeros_like(o))
    return out.to(q.dtype)
