# SPDX-License-Identifier: Apache-2.0
"""The torch_npu operators the npu backend uses, written in PyTorch from their public documentation.

Source of each definition: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/<name>.md`` (function
prototype, formula, parameter constraints). Every operator checks the documented constraints the
npu backend relies on (dtypes, ranks, layouts, contiguity) and raises ``RuntimeError`` like the
real operator would on a violation, so a composition that breaks a documented rule fails here too.
Internal math is fp32 (the documented output dtype is the input dtype); the hardware's rounding
is not modelled.
"""

from __future__ import annotations

import torch

from torch_npu import _control

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)


def _need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg} (torch_npu stub enforces the documented constraint)")


# -- npu_rms_norm ---------------------------------------------------------------------------------
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd): y = x / sqrt(mean(x^2) + eps) * gamma over gamma's dims (the last ones);
    rstd = 1 / sqrt(mean(x^2) + eps) as float32. x, gamma: float16/bfloat16/float32, same dtype."""
    op = "npu_rms_norm"
    _control.maybe_fail(op)
    _need(self.dtype in _FLOATS, op, f"x dtype {self.dtype} not in float16/bfloat16/float32")
    _need(gamma.dtype == self.dtype, op, f"gamma dtype {gamma.dtype} != x dtype {self.dtype}")
    _need(1 <= self.dim() <= 8, op, f"x must have 1-8 dims, got {self.dim()}")
    k = gamma.dim()
    _need(
        tuple(self.shape[self.dim() - k :]) == tuple(gamma.shape),
        op,
        f"gamma shape {tuple(gamma.shape)} must equal the last dims of x {tuple(self.shape)}",
    )
    dims = tuple(range(self.dim() - k, self.dim()))
    xf = self.float()
    rstd = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(self.dtype)
    return y, rstd


# -- npu_rotary_mul -------------------------------------------------------------------------------
def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None
) -> torch.Tensor:
    """output = input * r1 + rotate(input) * r2; rotate per ``rotary_mode`` ('half' or
    'interleave': pairs (2j, 2j+1) -> (-x_{2j+1}, x_{2j})). input 3-D or 4-D, float16/bfloat16/
    float32; r1/r2 broadcast to input (interleave: T1D / 1S1D / 11SD / S11D layouts); D even and
    < 896."""
    op = "npu_rotary_mul"
    _control.maybe_fail(op)
    _need(rotate is None, op, "the stub models rotary_mode only, not a rotate matrix")
    _need(input.dim() in (3, 4), op, f"input must be 3-D or 4-D, got {input.dim()}-D")
    _need(
        r1.dim() == input.dim() and r2.dim() == input.dim(),
        op,
        "r1 / r2 must have the rank of input",
    )
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _need(t.dtype in _FLOATS, op, f"{name} dtype {t.dtype} not in float16/bfloat16/float32")
    d = input.shape[-1]
    _need(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    _need(r1.shape == r2.shape and r1.shape[-1] == d, op, "r1 / r2 must be [..., D] of one shape")
    if rotary_mode == "interleave":
        # documented r1/r2 layouts: every broadcast dim of size 1 except one token dim
        non1 = [i for i in range(r1.dim() - 1) if r1.shape[i] != 1]
        _need(
            len(non1) <= 1,
            op,
            f"interleave mode takes r1/r2 as T1D / 1S1D / 11SD / S11D, got {tuple(r1.shape)}",
        )
        rot = _rotate_interleaved
    elif rotary_mode == "half":
        rot = _rotate_half
    else:
        raise RuntimeError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    xf = input.float()
    try:
        out = xf * r1.float() + rot(xf) * r2.float()
    except RuntimeError as exc:
        raise RuntimeError(
            f"{op}: r1/r2 {tuple(r1.shape)} do not broadcast to input {tuple(input.shape)}"
        ) from exc
    _need(out.shape == input.shape, op, "r1/r2 must broadcast to input, not enlarge it")
    return out.to(input.dtype)


# -- npu_scatter_nd_update(_) ----------------------------------------------------------------------
_SCATTER_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bool,
    torch.bfloat16,
    torch.int64,
    torch.int8,
)


def _scatter_check(op, input, indices, updates):
    _need(
        input.dtype in _SCATTER_DTYPES,
        op,
        f"input dtype {input.dtype} is not supported on "
        f"A2/A3 (float32, float16, bool, bfloat16, int64, "
        f"int8)",
    )
    _need(updates.dtype == input.dtype, op, f"updates dtype {updates.dtype} != input {input.dtype}")
    _need(indices.dtype in (torch.int32, torch.int64), op, f"indices dtype {indices.dtype}")
    _need(1 <= input.dim() <= 8, op, "input must have 1-8 dims")
    _need(indices.dim() >= 2, op, "indices must have at least 2 dims")
    a = indices.shape[-1]
    _need(a <= input.dim(), op, f"indices' last dim {a} exceeds input's rank {input.dim()}")
    want = tuple(indices.shape[:-1]) + tuple(input.shape[a:])
    _need(tuple(updates.shape) == want, op, f"updates must be {want}, got {tuple(updates.shape)}")
    idx = indices.long()
    if idx.numel():
        bound = torch.tensor(input.shape[:a], dtype=torch.long)
        _need(bool(((idx >= 0) & (idx < bound)).all()), op, "indices out of range (not supported)")
    return tuple(idx.reshape(-1, a).unbind(-1)), updates.reshape((-1,) + tuple(input.shape[a:]))


def npu_scatter_nd_update_(
    input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    """In place: input[indices[i]] = updates[i] (indices [..., a] address input's first a dims)."""
    op = "npu_scatter_nd_update_"
    _control.maybe_fail(op)
    idx, upd = _scatter_check(op, input, indices, updates)
    if upd.shape[0]:
        input[idx] = upd
    return input


def npu_scatter_nd_update(
    input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    op = "npu_scatter_nd_update"
    _control.maybe_fail(op)
    idx, upd = _scatter_check(op, input, indices, updates)
    out = input.clone()
    if upd.shape[0]:
        out[idx] = upd
    return out


# -- npu_fused_infer_attention_score (decode subset) -----------------------------------------------
def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    actual_seq_lengths_kv=None,
    num_heads=1,
    scale=1.0,
    input_layout="BSH",
    num_key_value_heads=0,
    softmax_lse_flag=False,
    sparse_mode=0,
    atten_mask=None,
    block_table=None,
    query_rope=None,
    key_rope=None,
    **unused,
):
    """softmax(scale * Q K^T) V per (batch, head), the first actual_seq_lengths_kv[b] keys of each
    batch; optional softmax_lse = log(sum exp(scale * q.k)) (max-shifted), float32.

    Modelled subset (what the npu backend uses): input_layout 'BSND', Q_S = 1 (decode), no mask,
    no page table, no rope split, no quantization; query/key/value float16 or bfloat16 of one dtype;
    num_heads / num_key_value_heads <= 64; D <= 512; KV_S <= 262144. Returns (attention_out
    [B, 1, N, D] in query's dtype, softmax_lse [B, N, 1, 1] float32 or a [1] zero tensor).
    """
    op = "npu_fused_infer_attention_score"
    _control.maybe_fail(op)
    extra = [
        k
        for k, v in unused.items()
        if v is not None and k not in ("pre_tokens", "next_tokens", "inner_precise")
    ]
    _need(not extra, op, f"the stub does not model {extra}")
    _need(input_layout == "BSND", op, "the stub models input_layout='BSND' only")
    _need(
        atten_mask is None and block_table is None and query_rope is None and key_rope is None,
        op,
        "the stub models the plain decode form only (no mask, page table or rope split)",
    )
    _need(
        query.dtype in _HALF and key.dtype == query.dtype and value.dtype == query.dtype,
        op,
        f"query/key/value must be float16 or bfloat16 of one dtype, got {query.dtype}, "
        f"{key.dtype}, {value.dtype}",
    )
    _need(
        query.dim() == 4 and key.dim() == 4 and value.shape == key.shape,
        op,
        "BSND tensors expected",
    )
    b, s, n, d = query.shape
    _need(s == 1, op, "the stub models Q_S = 1 (decode) only")
    _need(n == num_heads, op, f"num_heads {num_heads} != query N {n}")
    kv_n = num_key_value_heads or n
    _need(
        key.shape[2] == kv_n and n % kv_n == 0 and n // kv_n <= 64,
        op,
        f"num_heads / num_key_value_heads must be an integer <= 64 ({n} / {kv_n})",
    )
    _need(
        key.shape[0] == b and key.shape[3] == d and d <= 512, op, "key must be [B, KV_S, KV_N, D]"
    )
    kv_s = key.shape[1]
    _need(kv_s <= 262144, op, "KV_S must be <= 262144 for Q_S = 1")
    lens = (
        torch.full((b,), kv_s, dtype=torch.long)
        if actual_seq_lengths_kv is None
        else torch.as_tensor(list(actual_seq_lengths_kv), dtype=torch.long)
    )
    _need(lens.numel() in (1, b) or lens.numel() >= b, op, "actual_seq_lengths_kv length")
    lens = lens.expand(b) if lens.numel() == 1 else lens[:b]
    _need(bool(((lens >= 0) & (lens <= kv_s)).all()), op, "actual_seq_lengths_kv out of [0, KV_S]")
    group = n // kv_n
    q = query.float().reshape(b, kv_n, group, d)  # query head i uses KV head i // group
    k, v = key.float(), value.float()  # [B, S2, KV_N, D]
    logits = torch.einsum("bkgd,bskd->bkgs", q, k) * scale
    live = torch.arange(kv_s)[None, :] < lens[:, None]  # [B, S2]
    logits = logits.masked_fill(~live[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1).reshape(b, n)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a batch with no keys: all-zero output
    out = torch.einsum("bkgs,bskd->bkgd", p, v).to(query.dtype).reshape(b, 1, n, d)
    if softmax_lse_flag:
        return out, lse.reshape(b, n, 1, 1).float()
    return out, torch.zeros(1, dtype=torch.float32)


# -- npu_lightning_indexer (TND query, PA_BSND key subset) -----------------------------------------
_SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


def npu_lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=2**63 - 1,
    next_tokens=2**63 - 1,
    return_value=False,
):
    """Top-``sparse_count`` key indices per query token of
    score(t, j) = sum_h weights[t, h] * relu(q[t, h] . k[j]), over the keys the mask allows.

    Modelled subset: layout_query 'TND' (query [T, N1, 128], actual_seq_lengths_query = prefix
    sums), layout_key 'PA_BSND' (key [blocks, block_size, 1, 128], block_size a multiple of 16 up to
    1024, contiguous; block_table [B, max_blocks] int32; actual_seq_lengths_key = per-batch key
    counts). sparse_mode 3: query i of a batch with Lq queries and Lkv keys sees keys j <= Lkv - Lq
    + i; sparse_mode 0: all Lkv keys. Returns (indices [T, 1, sparse_count] int32, descending score,
    -1 where fewer keys are visible; values or an empty tensor).
    """
    op = "npu_lightning_indexer"
    _control.maybe_fail(op)
    _need(
        layout_query == "TND" and layout_key == "PA_BSND",
        op,
        "the stub models layout_query='TND' with layout_key='PA_BSND' only",
    )
    _need(
        query.dtype in _HALF and key.dtype == query.dtype,
        op,
        f"query/key must be float16 or bfloat16 of one dtype, got {query.dtype}, {key.dtype}",
    )
    _need(weights.dtype == torch.float32 or weights.dtype == query.dtype, op, "weights dtype")
    _need(
        query.dim() == 3 and query.shape[-1] == 128 and query.shape[1] <= 64,
        op,
        f"query must be [T, N1 <= 64, 128], got {tuple(query.shape)}",
    )
    _need(
        key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == 128,
        op,
        f"key must be [blocks, block_size, 1, 128], got {tuple(key.shape)}",
    )
    bs = key.shape[1]
    _need(bs % 16 == 0 and bs <= 1024, op, f"block_size must be a multiple of 16 <= 1024, got {bs}")
    _need(key.is_contiguous(), op, "key must be contiguous on A2/A3")
    _need(query.is_contiguous() and weights.is_contiguous(), op, "query/weights must be contiguous")
    _need(tuple(weights.shape) == tuple(query.shape[:2]), op, "weights must be [T, N1]")
    _need(sparse_count in _SPARSE_COUNTS, op, f"sparse_count {sparse_count} not supported")
    _need(sparse_mode in (0, 3), op, "sparse_mode must be 0 or 3")
    _need(
        block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2,
        op,
        "block_table must be a 2-D int32 tensor",
    )
    _need(
        actual_seq_lengths_query is not None and actual_seq_lengths_key is not None,
        op,
        "actual_seq_lengths_query / _key are required for TND / PA_BSND",
    )
    _need(not return_value, op, "return_value is training-only")
    qsl = torch.as_tensor(actual_seq_lengths_query).long()
    kl = torch.as_tensor(actual_seq_lengths_key).long()
    nb = qsl.numel()
    _need(nb > 0, op, "at least one batch")
    _need(
        kl.numel() == nb and block_table.shape[0] == nb,
        op,
        "one key length and block-table row per batch",
    )
    _need(
        bool((qsl[1:] >= qsl[:-1]).all()) and int(qsl[-1]) == query.shape[0],
        op,
        "actual_seq_lengths_query must be non-decreasing prefix sums ending at T",
    )
    _need(bool((block_table.shape[1] * bs >= kl).all()), op, "block_table too short for the keys")
    t_all = query.shape[0]
    out = torch.full((t_all, 1, sparse_count), -1, dtype=torch.int32)
    start = 0
    for b in range(nb):
        stop = int(qsl[b])
        lq, lkv = stop - start, int(kl[b])
        if lq > 0 and lkv > 0:
            j = torch.arange(lkv)
            blocks = block_table[b].long()[j // bs]
            _need(
                bool((blocks >= 0).all()) and bool((blocks < key.shape[0]).all()),
                op,
                "block id out of range",
            )
            k = key[blocks, j % bs, 0].float()  # [Lkv, 128]
            q = query[start:stop].float()  # [Lq, N1, 128]
            s = torch.einsum("thd,sd->ths", q, k).relu()
            score = torch.einsum("ths,th->ts", s, weights[start:stop].float())
            if sparse_mode == 3:
                i = torch.arange(lq)[:, None]
                score = score.masked_fill(j[None, :] > (lkv - lq) + i, float("-inf"))
            kk = min(sparse_count, lkv)
            vals, idx = torch.topk(score, kk, dim=-1)
            idx = torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)
            out[start:stop, 0, :kk] = idx.to(torch.int32)
        start = stop
    return out, torch.empty(0)
