"""npu ``sparse_attention`` (vllm-ascend's npu_sparse_attn_sharedkv where it is loaded, else
npu_fused_infer_attention_score) and ``indexer_topk`` (npu_lightning_indexer).

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

indexer_topk, bf16 queries over bf16 keys (Ascend's indexer format): ``npu_lightning_indexer`` with
query layout TND (every token its own batch) and key layout PA_BSND straight on the cache pages
(``[pages, 64, 1, 128]`` bf16: the bf16 page holds exactly that), the block-table row of the token's
request, and ``actual_seq_lengths_key`` = the entries visible to the token (``(pos + 1) // ratio``),
so rightDownCausal masking with one query per batch admits exactly the visible entries. Indices past
``min(topk, visible)`` are set to -1 afterwards. Other formats / dtypes: the reference.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import INDEXER_TOPK, SPARSE_ATTENTION
from vllm_dsv4_hw.ops.checks import check_sparse_attention_args
from vllm_dsv4_hw.ops.npu import sas
from vllm_dsv4_hw.ops.npu._vendor import call, npu_op
from vllm_dsv4_hw.ops.reference import indexer as ref_indexer
from vllm_dsv4_hw.ops.reference import sparse_attention as ref_sa
from vllm_dsv4_hw.ops.registry import register_op

_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FIA_MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64
FIA_MAX_D = 512
FIA_MAX_KV = 262144
# Upper bound on the gathered key elements of one token chunk (as the reference bounds its own).
_CHUNK_ELEMS = 1 << 24

LI_MAX_HEADS = 64
LI_DIM = 128
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


def _fits_fia(q: torch.Tensor, n_cand: int) -> bool:
    return q.dtype in _ATTN_DTYPES and q.dim() == 3 and 0 < q.shape[-1] <= FIA_MAX_D \
        and q.shape[-1] % 16 == 0 and 0 < n_cand <= FIA_MAX_KV


@register_op(SPARSE_ATTENTION, "npu")
@npu_op(SPARSE_ATTENTION, ref_sa.sparse_attention)
def sparse_attention(q: torch.Tensor, window_cache: torch.Tensor, window_slots: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None,
                     fmt, sink: torch.Tensor, scale: float, comp_fmt=None) -> torch.Tensor:
    comp_fmt = fmt if comp_fmt is None else comp_fmt
    t, h, d, use_comp = check_sparse_attention_args(q, window_slots, comp_cache, comp_slots, fmt,
                                                    sink, comp_fmt)
    n_cand = window_slots.shape[1] + (comp_slots.shape[1] if use_comp else 0)
    if t > 0 and sas.fits(q):
        ops = sas.operators()  # vllm-ascend's own DeepSeek V4 attention, where it is loaded
        if ops is not None:
            out = sas.sparse_attention(ops, q, window_cache, window_slots, comp_cache, comp_slots,
                                       fmt, comp_fmt, sink, scale, use_comp)
            if out is not None:
                return out
    if not _fits_fia(q, n_cand) or t == 0:  # dtypes / sizes the operator does not take
        return ref_sa.sparse_attention(q, window_cache, window_slots, comp_cache, comp_slots, fmt,
                                       sink, scale, comp_fmt=comp_fmt)
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
            o, lse = call("npu_fused_infer_attention_score", query, key, key,
                          actual_seq_lengths_kv=seq_kv, num_heads=h1 - h0, num_key_value_heads=1,
                          scale=float(scale), input_layout="BSND", softmax_lse_flag=True)
            o_parts.append(o.reshape(e - s, h1 - h0, d))
            lse_parts.append(lse.reshape(e - s, h1 - h0))
        o = torch.cat(o_parts, dim=1).float()
        lse = torch.cat(lse_parts, dim=1).float()
        # sink: softmax over candidates + sink = plain softmax * S / (S + e^sink), S = e^lse
        o = o * torch.sigmoid(lse - sinkf[None, :])[..., None]
        o = torch.where((lens > 0)[:, None, None], o, torch.zeros((), device=dev))
        out[s:e] = o.to(q.dtype)
    return out


def _fits_li(q, key_fmt, topk: int) -> bool:
    return (q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[-1] == LI_DIM
            and 0 < q.shape[1] <= LI_MAX_HEADS and getattr(key_fmt, "name", "") == "bf16"
            and key_fmt.dim == LI_DIM and key_fmt.entries_per_page % 16 == 0
            and key_fmt.entries_per_page <= 1024 and topk in LI_SPARSE_COUNTS)


@register_op(INDEXER_TOPK, "npu")
@npu_op(INDEXER_TOPK, ref_indexer.indexer_topk)
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_fmt,
                 block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                 topk: int, ratio: int = 4, q_scales: torch.Tensor | None = None) -> torch.Tensor:
    if q_scales is not None:  # e4m3 codes: the vendor indexer takes bf16 q (exact from e4m3)
        q = ref_indexer.query_values(q, q_scales).to(torch.bfloat16)
    if not _fits_li(q, key_fmt, topk) or q.shape[0] == 0:
        return ref_indexer.indexer_topk(q, weights, key_cache, key_fmt, block_table, token_req,
                                        token_pos, topk, ratio)
    dev = q.device
    t = q.shape[0]
    e = key_fmt.entries_per_page
    data_v, _ = key_fmt.page_views(key_cache)                 # [P, E, 256] uint8
    key = data_v.view(torch.bfloat16).unsqueeze(2)            # [P, E, 1, 128] bf16
    if not key.is_contiguous():  # padded pages (tests); a bf16 bucket page is exactly E entries
        key = key.contiguous()
    req = token_req.to(device=dev, dtype=torch.int64)
    pos = token_pos.to(device=dev, dtype=torch.int64)
    live = req >= 0
    visible = torch.where(live, torch.div(pos + 1, ratio, rounding_mode="floor").clamp(min=0),
                          torch.zeros_like(pos))
    bt = block_table.to(device=dev)
    nb = bt.shape[1]
    if bool((live & ((req >= bt.shape[0]))).any()):
        raise ValueError(f"indexer_topk: token_req rows must lie in [0, {bt.shape[0]})")
    rows = bt[req.clamp(min=0, max=bt.shape[0] - 1)].to(torch.int32)  # [T, nb]
    need = cdiv_t(visible, e)
    if bool((need > nb).any()):
        raise ValueError(f"indexer_topk: a token sees {int(visible.max())} entries, more than "
                         f"block_table's {nb} pages x {e} entries hold")
    col = torch.arange(nb, device=dev)[None, :]
    if bool(((col < need[:, None]) & (rows < 0)).any()):
        raise ValueError("indexer_topk: a visible entry lies in an unallocated page")
    qsl = torch.arange(1, t + 1, device=dev, dtype=torch.int32)
    idx, _ = call("npu_lightning_indexer", q.contiguous(), key,
                  weights.to(torch.float32).contiguous(), actual_seq_lengths_query=qsl,
                  actual_seq_lengths_key=visible.to(torch.int32), block_table=rows,
                  layout_query="TND", layout_key="PA_BSND", sparse_count=int(topk), sparse_mode=3)
    out = idx.reshape(t, topk).to(torch.int32)
    keep = torch.arange(topk, device=dev)[None, :] < visible.clamp(max=topk)[:, None]
    return torch.where(keep, out, torch.full_like(out, -1))


def cdiv_t(n: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(n + d - 1, d, rounding_mode="floor")
