# SPDX-License-Identifier: Apache-2.0
"""``torch.ops._C_ascend.npu_sparse_attn_sharedkv`` and its ``_metadata`` companion, in PyTorch.

Read from vllm-ascend ``csrc/attention/sparse_attn_sharedkv/README.md`` (parameters, constraints),
``op_host/sparse_attn_sharedkv_tiling.cpp`` (scene selection, required inputs),
``op_kernel/arch32/sparse_attn_sharedkv_scfa_*.h`` (how compressed indices are read and masked)
and the call in ``vllm_ascend/attention/dsa_v1.py``. What the stub computes, per query token:

* batches from ``cu_seqlens_q`` (TND); token i of batch b (q_len tokens) sits at position
  ``t = seqused_kv[b] - q_len + i``; ``t < 0`` gives a zero row;
* window (``ori_mask_mode`` 4, ``ori_win_left`` 127, ``ori_win_right`` 0): positions
  ``max(0, t - 127) .. t`` of ``ori_kv`` [blocks, block_size, 1, D] through ``ori_block_table``;
* compressed, scene "SCFA" (``cmp_sparse_indices`` [T, 1, 512] given): the token's indices up to
  the first negative one (the kernel stops there), each dropped unless ``< (t + 1) // cmp_ratio``
  (the kernel's causal limit), read from ``cmp_kv`` through ``cmp_block_table``; scene "CFA"
  (no indices): every entry ``0 .. (t + 1) // cmp_ratio - 1``; scene "SWA": no ``cmp_kv``;
* one softmax over all of them (K = V, shared KV), scaled by ``softmax_scale``, with the per-head
  ``sinks`` (fp32, required) as an extra denominator term ``exp(sink_h)``.

Enforced: q bf16/fp16 [T, 64, D] (N1 only 64), kv dtype = q dtype, KV_N 1, block sizes multiples of
16 up to 1024, int32 index tensors, ``metadata`` int32 [1024] required (and, in the stub, built by
the metadata op for the same heads / dim / batch / top-k / ratio / scene), the mask attributes at
their only supported values, ``return_softmax_lse`` False (the returned lse is documented as
invalid: NaN here), ``ori_sparse_indices`` not set (documented as ineffective), no empty tensors.
"""

from __future__ import annotations

import torch

from vllm_ascend_ops_stub._common import called, need

SCHEMA = (
    "(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, Tensor? ori_sparse_indices=None, "
    "Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, Tensor? cmp_block_table=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
    "Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, Tensor? metadata=None, "
    "float softmax_scale=0, int cmp_ratio=0, int ori_mask_mode=4, int cmp_mask_mode=3, "
    "int ori_win_left=128, int ori_win_right=0, str layout_q=\"BSND\", str layout_kv=\"PA_ND\", "
    "bool return_softmax_lse=False) -> (Tensor out, Tensor softmax_lse)"
)

METADATA_SCHEMA = (
    "(int num_heads_q, int num_heads_kv, int head_dim, Tensor? cu_seqlens_q=None, "
    "Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, "
    "Tensor? seqused_kv=None, int batch_size=0, int max_seqlen_q=0, int max_seqlen_kv=0, "
    "int ori_topk=0, int cmp_topk=0, int cmp_ratio=4, int ori_mask_mode=4, int cmp_mask_mode=3, "
    "int ori_win_left=128, int ori_win_right=0, str layout_q=\"BSND\", str layout_kv=\"PA_ND\", "
    "bool has_ori_kv=True, bool has_cmp_kv=True, str device=\"npu\") -> Tensor metadata"
)

N1 = 64
K2 = 512
METADATA_SIZE = 1024
_MAGIC = 0x5A5
_HALF = (torch.float16, torch.bfloat16)


def npu_sparse_attn_sharedkv_metadata(
    num_heads_q,
    num_heads_kv,
    head_dim,
    cu_seqlens_q=None,
    cu_seqlens_ori_kv=None,
    cu_seqlens_cmp_kv=None,
    seqused_q=None,
    seqused_kv=None,
    batch_size=0,
    max_seqlen_q=0,
    max_seqlen_kv=0,
    ori_topk=0,
    cmp_topk=0,
    cmp_ratio=4,
    ori_mask_mode=4,
    cmp_mask_mode=3,
    ori_win_left=128,
    ori_win_right=0,
    layout_q="BSND",
    layout_kv="PA_ND",
    has_ori_kv=True,
    has_cmp_kv=True,
    device="npu",
):
    """The split plan [1024] int32 the attention op needs. The real one is an AI-CPU operator whose
    content is private to the kernel; the stub records the parameters it was built for, so that
    the attention op can refuse a plan built for another call."""
    op = "npu_sparse_attn_sharedkv_metadata"
    called(op)
    need(has_ori_kv, op, "has_ori_kv must be True (ori_kv is required)")
    out = torch.zeros(METADATA_SIZE, dtype=torch.int32)
    out[:10] = torch.tensor(
        [
            _MAGIC,
            num_heads_q,
            num_heads_kv,
            head_dim,
            batch_size,
            cmp_topk,
            cmp_ratio if has_cmp_kv else 0,
            int(has_cmp_kv),
            ori_win_left,
            max_seqlen_kv,
        ],
        dtype=torch.int32,
    )
    return out


def _paged(kv, bt, b, idx, bs, op, name):
    blocks = idx // bs
    need(bool((blocks < bt.shape[1]).all()), op, f"{name}_block_table has too few columns")
    pages = bt[b, blocks].long()
    need(
        bool(((pages >= 0) & (pages < kv.shape[0])).all()),
        op,
        f"{name}_block_table points outside {name}_kv",
    )
    return kv[pages, idx % bs, 0].float()


def _check_kv(kv, q, op, name):
    need(
        kv.dim() == 4,
        op,
        f"{name}_kv must be PA_ND [blocks, block_size, 1, D], got {tuple(kv.shape)}",
    )
    need(kv.dtype == q.dtype, op, f"{name}_kv dtype {kv.dtype} != q dtype {q.dtype}")
    need(kv.shape[2] == 1, op, f"{name}_kv KV_N must be 1, got {kv.shape[2]}")
    need(kv.shape[3] == q.shape[2], op, f"{name}_kv D {kv.shape[3]} != q D {q.shape[2]}")
    bs = kv.shape[1]
    need(
        bs % 16 == 0 and 0 < bs <= 1024,
        op,
        f"{name} block_size must be a multiple of 16 up to 1024, got {bs}",
    )
    need(kv.numel() > 0, op, f"{name}_kv must not be empty")
    return bs


def _check_int32(t, op, name, dim):
    need(t is not None, op, f"{name} is required here")
    need(
        t.dtype == torch.int32 and t.dim() == dim,
        op,
        f"{name} must be int32 with {dim} dims, got {t.dtype} {tuple(t.shape)}",
    )
    need(t.numel() > 0, op, f"{name} must not be empty")


def npu_sparse_attn_sharedkv(
    q,
    ori_kv=None,
    cmp_kv=None,
    ori_sparse_indices=None,
    cmp_sparse_indices=None,
    ori_block_table=None,
    cmp_block_table=None,
    cu_seqlens_q=None,
    cu_seqlens_ori_kv=None,
    cu_seqlens_cmp_kv=None,
    seqused_q=None,
    seqused_kv=None,
    sinks=None,
    metadata=None,
    softmax_scale=0.0,
    cmp_ratio=0,
    ori_mask_mode=4,
    cmp_mask_mode=3,
    ori_win_left=128,
    ori_win_right=0,
    layout_q="BSND",
    layout_kv="PA_ND",
    return_softmax_lse=False,
):
    op = "npu_sparse_attn_sharedkv"
    called(op)
    need(layout_q == "TND", op, f"the stub models layout_q TND only, got {layout_q!r}")
    need(layout_kv == "PA_ND", op, f"layout_kv supports PA_ND only, got {layout_kv!r}")
    need(q.dtype in _HALF, op, f"q dtype {q.dtype} not in float16/bfloat16")
    need(q.dim() == 3 and q.shape[1] == N1, op, f"q must be TND [T, 64, D], got {tuple(q.shape)}")
    need(q.numel() > 0, op, "q must not be empty")
    need(ori_kv is not None, op, "ori_kv is required")
    need(
        ori_sparse_indices is None,
        op,
        "ori_sparse_indices is documented as ineffective; the stub refuses it",
    )
    need(ori_mask_mode == 4 and cmp_mask_mode == 3, op, "ori_mask_mode must be 4, cmp_mask_mode 3")
    need(
        ori_win_left == 127 and ori_win_right == 0,
        op,
        f"ori_win_left must be 127 and ori_win_right 0, got {ori_win_left} / {ori_win_right}",
    )
    need(not return_softmax_lse, op, "return_softmax_lse supports False only")
    obs = _check_kv(ori_kv, q, op, "ori")
    _check_int32(ori_block_table, op, "ori_block_table", 2)
    _check_int32(cu_seqlens_q, op, "cu_seqlens_q", 1)
    _check_int32(seqused_kv, op, "seqused_kv", 1)
    cu = cu_seqlens_q.long()
    nb = cu.numel() - 1
    need(
        int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()) and int(cu[-1]) == q.shape[0],
        op,
        "cu_seqlens_q must be prefix sums from 0 to T",
    )
    need(
        seqused_kv.numel() == nb and ori_block_table.shape[0] == nb,
        op,
        "seqused_kv and ori_block_table need one row per batch",
    )
    need(
        sinks is not None and sinks.dtype == torch.float32 and tuple(sinks.shape) == (N1,),
        op,
        "sinks (float32 [N1]) must be provided",
    )
    has_cmp = cmp_kv is not None
    need(
        cmp_sparse_indices is None or has_cmp,
        op,
        "when cmp_sparse_indices is given, cmp_kv cannot be None",
    )
    cbs = 0
    if has_cmp:
        need(cmp_ratio in (4, 128), op, f"cmp_ratio supports 4 or 128, got {cmp_ratio}")
        cbs = _check_kv(cmp_kv, q, op, "cmp")
        _check_int32(cmp_block_table, op, "cmp_block_table", 2)
        need(cmp_block_table.shape[0] == nb, op, "cmp_block_table needs one row per batch")
        if cmp_sparse_indices is not None:
            _check_int32(cmp_sparse_indices, op, "cmp_sparse_indices", 3)
            need(
                tuple(cmp_sparse_indices.shape) == (q.shape[0], 1, K2),
                op,
                f"cmp_sparse_indices must be [T, 1, {K2}], got {tuple(cmp_sparse_indices.shape)}",
            )
    need(
        metadata is not None
        and metadata.dtype == torch.int32
        and tuple(metadata.shape) == (METADATA_SIZE,),
        op,
        "metadata (int32 [1024], from npu_sparse_attn_sharedkv_metadata) must be provided",
    )
    topk = K2 if cmp_sparse_indices is not None else 0
    plan = [_MAGIC, N1, 1, q.shape[2], nb, topk, cmp_ratio if has_cmp else 0, int(has_cmp), 127]
    need(
        metadata[:9].tolist() == plan,
        op,
        f"metadata was built for another call ({metadata[:9].tolist()} vs {plan})",
    )
    need(
        int(seqused_kv.max()) <= int(metadata[9]),
        op,
        "seqused_kv exceeds the metadata's max_seqlen_kv",
    )

    out = torch.zeros(q.shape, dtype=torch.float32)
    sink = sinks.float()
    for b in range(nb):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        length = int(seqused_kv[b])
        need(length >= s1 - s0, op, "seqused_kv must cover the batch's query tokens")
        for i in range(s1 - s0):
            tok = s0 + i
            t = length - (s1 - s0) + i
            if t < 0:
                continue
            pos = torch.arange(max(0, t - 127), t + 1)
            keys = [_paged(ori_kv, ori_block_table, b, pos, obs, op, "ori")]
            if has_cmp:
                limit = (t + 1) // cmp_ratio
                if cmp_sparse_indices is not None:
                    ind = cmp_sparse_indices[tok, 0].long()
                    neg = (ind < 0).nonzero()
                    if neg.numel():
                        ind = ind[: int(neg[0])]
                    ind = ind[ind < limit]
                else:
                    ind = torch.arange(limit)
                if ind.numel():
                    keys.append(_paged(cmp_kv, cmp_block_table, b, ind, cbs, op, "cmp"))
            k = torch.cat(keys)  # [n, D], K = V
            s = (q[tok].float() @ k.t()) * float(softmax_scale)  # [N1, n]
            m = torch.maximum(s.amax(dim=-1), sink)
            p = torch.exp(s - m[:, None])
            den = p.sum(dim=-1) + torch.exp(sink - m)
            out[tok] = (p @ k) / den[:, None]
    lse = torch.full((q.shape[0], N1), float("nan"))
    return out.to(q.dtype), lse
