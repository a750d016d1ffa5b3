# SPDX-License-Identifier: Apache-2.0
"""npu ``sparse_attention``: vllm-ascend's npu_sparse_attn_sharedkv where it is loaded, else
npu_fused_infer_attention_score.

In a process where vllm-ascend loaded its operators, calls that fit ``npu_sparse_attn_sharedkv``
(bf16 / fp16, heads a multiple of 64, D 512, at most 128 window and 512 compressed rows per token)
go through it (``sas.py``); every other call takes the torch_npu path below.

sparse_attention, bf16 / fp16 queries: per chunk of tokens, the candidate rows (window slots, then
compressed slots, as the contract orders them) are dequantized once per distinct slot, the valid
ones compacted to the front of each token's list, and every token becomes one decode "batch" of
``npu_fused_infer_attention_score`` (input_layout BSND, Q_S 1, KV_N 1 with K = V = the 512-d
entries, ``actual_seq_lengths_kv`` = its valid count, ``softmax_lse_flag=True``). The sink is
applied afterwards from the returned log-sum-exp: o * sigmoid(lse - sink_h) equals the sink
softmax's extra denominator term (the operator's own ``learnable_sink`` needs D <= 128, and
npu_sparse_flash_attention takes no sinks on A2/A3 and fixes D = 512 + 64 rope). Heads are split
into groups of 64 (the operator's query/KV head ratio limit). fp32 / fp64 queries (no such attention
dtype on Ascend; the tests' exact paths) are served by the reference.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import SPARSE_ATTENTION
from vllm_dsv4_hw.ops.checks import check_sparse_attention_args
from vllm_dsv4_hw.ops.npu import sas
from vllm_dsv4_hw.ops.npu._vendor import call, npu_op
from vllm_dsv4_hw.ops.reference import sparse_attention as ref_sa
from vllm_dsv4_hw.ops.registry import register_op

_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FIA_MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64
FIA_MAX_D = 512
FIA_MAX_KV = 262144
# Upper bound on the gathered key elements of one token chunk (as the reference bounds its own).
_CHUNK_ELEMS = 1 << 24


def _fits_fia(q: torch.Tensor, n_cand: int) -> bool:
    return (
        q.dtype in _ATTN_DTYPES
        and q.dim() == 3
        and 0 < q.shape[-1] <= FIA_MAX_D
        and q.shape[-1] % 16 == 0
        and 0 < n_cand <= FIA_MAX_KV
    )


@register_op(SPARSE_ATTENTION, "npu")
@npu_op(SPARSE_ATTENTION, ref_sa.sparse_attention)
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
    n_cand = window_slots.shape[1] + (comp_slots.shape[1] if use_comp else 0)
    if t > 0 and sas.fits(q):
        ops = sas.operators()  # vllm-ascend's own DeepSeek V4 attention, where it is loaded
        if ops is not None:
            out = sas.sparse_attention(
                ops,
                q,
                window_cache,
                window_slots,
                comp_cache,
                comp_slots,
                fmt,
                comp_fmt,
                sink,
                scale,
                use_comp,
            )
            if out is not None:
                return out
    if not _fits_fia(q, n_cand) or t == 0:  # dtypes / sizes the operator does not take
        return ref_sa.sparse_attention(
            q,
            window_cache,
            window_slots,
            comp_cache,
            comp_slots,
            fmt,
            sink,
            scale,
            comp_fmt=comp_fmt,
        )
    dev = q.device
    out = torch.empty(t, h, d, dtype=q.dtype, device=dev)
    sinkf = sink.to(device=dev, dtype=torch.float32)
    chunk = max(1, _CHUNK_ELEMS // max(1, n_cand * d))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        ws = window_slots[s:e]
        w_rows, w_idx = ref_sa._unique_keys(window_cache, ws, fmt, d, dev)
        valid = ws.to(dev) >= 0
        idx = w_idx
        rows = w_rows
        if use_comp:
            cs = comp_slots[s:e]
            c_rows, c_idx = ref_sa._unique_keys(comp_cache, cs, comp_fmt, d, dev)
            rows = torch.cat([w_rows, c_rows])
            idx = torch.cat([w_idx, c_idx + w_rows.shape[0]], dim=1)
            valid = torch.cat([valid, cs.to(dev) >= 0], dim=1)
        # valid candidates first (stable: the contract's order), then the padding
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        idx = idx.gather(1, order)
        lens = valid.sum(dim=1)
        keys = rows.to(q.dtype)[idx]  # [c, N, D]
        key = keys.unsqueeze(2).contiguous()  # [B=c, KV_S=N, KV_N=1, D]
        seq_kv = lens.clamp(min=1).tolist()
        o_parts, lse_parts = [], []
        for h0 in range(0, h, FIA_MAX_GROUP):
            h1 = min(h, h0 + FIA_MAX_GROUP)
            query = q[s:e, h0:h1].unsqueeze(1).contiguous()  # [B, Q_S=1, N, D]
            o, lse = call(
                "npu_fused_infer_attention_score",
                query,
                key,
                key,
                actual_seq_lengths_kv=seq_kv,
                num_heads=h1 - h0,
                num_key_value_heads=1,
                scale=float(scale),
                input_layout="BSND",
                softmax_lse_flag=True,
            )
            o_parts.append(o.reshape(e - s, h1 - h0, d))
            lse_parts.append(lse.reshape(e - s, h1 - h0))
        o = torch.cat(o_parts, dim=1).float()
        lse = torch.cat(lse_parts, dim=1).float()
        # sink: softmax over candidates + sink = plain softmax * S / (S + e^sink), S = e^lse
        o = o * torch.sigmoid(lse - sinkf[None, :])[..., None]
        o = torch.where((lens > 0)[:, None, None], o, torch.zeros((), device=dev))
        out[s:e] = o.to(q.dtype)
    return out
