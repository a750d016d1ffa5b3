# SPDX-License-Identifier: Apache-2.0
"""Triton routed experts for batches (``grouped_experts``): a grouped GEMM over (token, slot)
pairs sorted by expert, FP4 e2m1 + ue8m0 weights decoded in registers (or dense weights), graph-safe.

Why it looks like this:

* **No host synchronization** (CUDA-graph capturable): the pairs are grouped with torch ops on the
  device (the vLLM fused-MoE ``moe_align_block_size`` idea, :func:`align_pairs`): sorted pair ids
  padded per expert to a multiple of BM, one expert id per block of BM, and the padded total in a
  device tensor. Grids are sized by the static bound ``P + min(E, P) * (BM - 1)`` pairs; programs
  past the padded total return at once, padding rows are masked.
* **Exact over the whole ue8m0 range**: the K loop runs one 32-element scale group per step; the
  group's fp32 partial dot (x times the bare e2m1 values, exact in bf16) is multiplied by its scale
  2^(b-127) before it is added, so bytes 0 (2^-127) and 254 (2^127) are exact while the result is
  representable (a dequantized ``6 * 2^127`` would overflow).
* **No nibble shuffles**: a byte holds elements 2j (low nibble) and 2j+1 (high); the group's dot is
  split into the even and the odd elements (x loaded with stride 2), two K=16 dots, so decoding
  needs no interleave (portable to triton-ascend and the interpreter).
* Kernel 1 (:func:`_moe_gate_up_kernel`): gate and up rows of the same columns in one program, the
  clamped SwiGLU fused, the activation stored in x's dtype at the pair's row of ``[P, I]``. Kernel 2
  (:func:`_moe_down_kernel`): ``w2`` over the activations times the pair's top-k weight, stored fp32
  at the pair's (token, slot) row of ``[T, k, D]``; the slots are then added in slot order
  (``ops.reference.moe.sum_slots``), so results do not depend on how tokens group by expert.
* Dots: bf16 operands with fp32 accumulation on GPUs when x is bf16 (FP4 values are exact in bf16);
  otherwise, and always under the interpreter (whose bf16 math is wrong), fp32 ``ieee`` dots. On
  that fp32 path bf16 tensors (x, the activation) move as uint16 bit patterns converted with integer
  ops (``BF16_BITS``): the interpreter's own bf16 conversions garble subnormals, which the ends of
  the ue8m0 range produce.

Launch parameters (:func:`launch_config`) are sensible defaults, **not tuned yet**.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.reference.moe import sum_slots, validate_moe_args
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, grid_limit
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import (
    bf16_bits_to_f32,
    e2m1_to_f32,
    f32_to_bf16_bits,
    ue8m0_to_f32,
)


# -- device-side grouping --------------------------------------------------------------------------
def align_pairs(topk_ids: torch.Tensor, n_exp: int, bm: int):
    """Group the P = T*k (token, slot) pairs by expert, padded per expert to a multiple of ``bm``,
    with torch ops only (no host sync, static shapes).

    Returns (``sorted_ids`` int32 [n_blocks*bm]: pair ids, expert by expert, in pair order within
    an expert (a stable sort), P at padding rows; ``block_expert`` int32 [n_blocks]; ``n_padded``
    int32 [1]: rows in use, a multiple of bm; ``n_blocks``: the static upper bound). Ids outside
    [0, E) (-1: the slot contributes nothing) are left out."""
    p = topk_ids.numel()
    dev = topk_ids.device
    n_blocks = cdiv(p + min(n_exp, p) * (bm - 1), bm)
    flat = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < n_exp), flat, n_exp)  # dropped pairs sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_exp + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_exp]
    padded = (counts + bm - 1) // bm * bm
    pad_end = torch.cumsum(padded, 0)
    key_sorted = key[order]
    ks = key_sorted.clamp(max=n_exp - 1)
    rank = torch.arange(p, device=dev) - (torch.cumsum(counts, 0) - counts)[ks]
    dump = n_blocks * bm  # one extra slot that absorbs the dropped pairs
    dest = torch.where(key_sorted < n_exp, (pad_end - padded)[ks] + rank, dump)
    sorted_ids = torch.full((dump + 1,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(n_blocks, device=dev)
    block_expert = torch.searchsorted(pad_end // bm, blocks, right=True).clamp(max=n_exp - 1)
    return (sorted_ids[:dump], block_expert.to(torch.int32), pad_end[-1:].to(torch.int32), n_blocks)


def launch_config(n_pairs: int, n_exp: int) -> dict:
    """BM by the mean pairs per expert (decode: 16), BN 64 (128 with BM 64), 4 warps, 2 stages.

    Defaults, not tuned yet: a first sweep found nothing faster except BN 128 at BM 64; the
    one-group-per-step K loop (two K=16 dots per 32 elements) bounds the speed (evidence:
    docs/tuning.md, Fused MoE launch)."""
    mean = n_pairs / max(n_exp, 1)
    bm = 16 if mean <= 16 else (32 if mean <= 64 else 64)
    return dict(BM=bm, BN=128 if bm == 64 else 64, num_warps=4, num_stages=2)


def _programs(t: int, k: int, n_exp: int, inter: int, d: int) -> int:
    """Programs of the larger of the two launches for ``t`` tokens (one per row block x tile)."""
    p = t * k
    cfg = launch_config(p, n_exp)
    bm, bn = cfg["BM"], cfg["BN"]
    return cdiv(p + min(n_exp, p) * (bm - 1), bm) * cdiv(max(inter, d), bn)


def _tokens_per_launch(t: int, k: int, n_exp: int, inter: int, d: int, limit: int) -> int:
    """Tokens one call may launch so that no grid exceeds ``limit`` programs: all of them unless
    the device's bound is small (halving keeps the count a power-of-two fraction of ``t``)."""
    tokens = t
    while tokens > 1 and _programs(tokens, k, n_exp, inter, d) > limit:
        tokens = (tokens + 1) // 2
    if _programs(tokens, k, n_exp, inter, d) > limit:
        raise ValueError(
            f"moe_experts (triton): one token needs {_programs(1, k, n_exp, inter, d)} "
            f"programs, over the device's grid bound {limit}"
        )
    return tokens


# -- kernels ---------------------------------------------------------------------------------------
# DOT_BF16 (constexpr): 1 = bf16 tensor-core dot, 0 = fp32 ``ieee`` dot, DOT_ROWS = (the
# interpreter) fp32 products summed over K for each row alone: the interpreter's dot is numpy's
# matmul, whose BLAS sums a row differently depending on the rows beside it, and a token's result
# must not depend on which tokens share its expert's tile (tests/ops/test_moe_experts.py)
DOT_ROWS = 2


@triton.jit
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    if DOT_BF16 == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT_BF16 == 2:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _load_x(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load x / activation values; ``BF16_BITS``: a bf16 tensor read as uint16 bits -> fp32."""
    if BF16_BITS:
        u = tl.load(ptrs.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
        return bf16_bits_to_f32(u)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _fp4_group_dot(
    xrow,
    w_ptr,
    s_ptr,
    rows,
    rmask,
    mmask,
    stride_wn,
    stride_sn,
    g,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """Scale group g of an FP4 weight: ``s[rows, g] * (x[:, 32g:32g+32] . w[rows, 32g:32g+32])``
    [BM, BN] fp32, as an even-element and an odd-element K=16 dot (no nibble interleave)."""
    j = tl.arange(0, 16)
    xp = xrow[:, None] + g * 32 + 2 * j[None, :]
    xe = _load_x(xp, mmask[:, None], BF16_BITS)
    xo = _load_x(xp + 1, mmask[:, None], BF16_BITS)
    b = tl.load(
        w_ptr + rows[None, :] * stride_wn + g * 16 + j[:, None], mask=rmask[None, :], other=0
    ).to(tl.int32)  # [16, BN] transposed
    part = _dot(xe, e2m1_to_f32(b & 0xF), tl.zeros((BM, BN), tl.float32), DOT_BF16)
    part = _dot(xo, e2m1_to_f32((b >> 4) & 0xF), part, DOT_BF16)
    sb = tl.load(s_ptr + rows * stride_sn + g, mask=rmask, other=127)
    return part * ue8m0_to_f32(sb)[None, :]


@triton.jit
def _dense_group_dot(
    xrow,
    w_ptr,
    rows,
    rmask,
    mmask,
    stride_wn,
    k0,
    K,
    acc,
    DOT_BF16: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """``acc + x[:, k0:k0+32] . w[rows, k0:k0+32]`` for a dense weight (K masked)."""
    kk = k0 + tl.arange(0, 32)
    kv = kk < K
    xv = _load_x(xrow[:, None] + kk[None, :], mmask[:, None] & kv[None, :], BF16_BITS)
    wv = tl.load(
        w_ptr + rows[None, :] * stride_wn + kk[:, None],
        mask=rmask[None, :] & kv[:, None],
        other=0.0,
    )
    return _dot(xv, wv, acc, DOT_BF16)


@triton.jit
def _silu(g):
    """``g * sigmoid(g)`` with exp of -|g| only (no overflow to inf for a very negative gate)."""
    z = tl.exp(-tl.abs(g))
    return g * tl.where(g >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def _block_rows(sorted_ptr, bexp_ptr, pid_m, n_pairs, BM: tl.constexpr):
    """(pair ids [BM], valid [BM], expert (int64)) of block ``pid_m``."""
    pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pair < n_pairs
    pair = tl.where(valid, pair, 0).to(tl.int64)
    return pair, valid, tl.load(bexp_ptr + pid_m).to(tl.int64)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    bexp_ptr,
    npad_ptr,
    act_ptr,
    limit,
    n_pairs,
    topk,
    D,
    I,
    n_tiles,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_at,
    FP4: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """act[pair, n] = swiglu(h[pair, n], h[pair, I + n]) with h = w13[e] x[pair // topk]."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BM >= tl.load(npad_ptr):
        return
    pair, mv, e = _block_rows(sorted_ptr, bexp_ptr, pid_m, n_pairs, BM)
    xrow = x_ptr + (pair // topk) * stride_xt
    n = pid_n * BN + tl.arange(0, BN)
    nv = n < I
    we = w_ptr + e * stride_we
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    if FP4:
        se = s_ptr + e * stride_se
        for g in range(0, D // 32):
            acc_g += _fp4_group_dot(
                xrow, we, se, n, nv, mv, stride_wn, stride_sn, g, BM, BN, DOT_BF16, BF16_BITS
            )
            acc_u += _fp4_group_dot(
                xrow, we, se, n + I, nv, mv, stride_wn, stride_sn, g, BM, BN, DOT_BF16, BF16_BITS
            )
    else:
        for k0 in range(0, D, 32):
            acc_g = _dense_group_dot(
                xrow, we, n, nv, mv, stride_wn, k0, D, acc_g, DOT_BF16, BF16_BITS
            )
            acc_u = _dense_group_dot(
                xrow, we, n + I, nv, mv, stride_wn, k0, D, acc_u, DOT_BF16, BF16_BITS
            )
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = _silu(acc_g) * acc_u
    aptr = act_ptr + pair[:, None] * stride_at + n[None, :]
    amask = mv[:, None] & nv[None, :]
    if ACT_BF16:  # stored as RNE bf16 bits: exact everywhere (the interpreter's cast truncates)
        tl.store(aptr.to(tl.pointer_type(tl.uint16)), f32_to_bf16_bits(act), mask=amask)
    else:
        tl.store(aptr, act, mask=amask)


@triton.jit
def _moe_down_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    bexp_ptr,
    npad_ptr,
    tw_ptr,
    out_ptr,
    n_pairs,
    D,
    I,
    n_tiles,
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[pair, n] = topk_weight[pair] * (w2[e] act[pair])[n] in fp32."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BM >= tl.load(npad_ptr):
        return
    pair, mv, e = _block_rows(sorted_ptr, bexp_ptr, pid_m, n_pairs, BM)
    arow = a_ptr + pair * stride_at
    n = pid_n * BN + tl.arange(0, BN)
    nv = n < D
    we = w_ptr + e * stride_we
    acc = tl.zeros((BM, BN), tl.float32)
    if FP4:
        se = s_ptr + e * stride_se
        for g in range(0, I // 32):
            acc += _fp4_group_dot(
                arow, we, se, n, nv, mv, stride_wn, stride_sn, g, BM, BN, DOT_BF16, BF16_BITS
            )
    else:
        for k0 in range(0, I, 32):
            acc = _dense_group_dot(arow, we, n, nv, mv, stride_wn, k0, I, acc, DOT_BF16, BF16_BITS)
    tw = tl.load(tw_ptr + pair, mask=mv, other=0.0)
    tl.store(
        out_ptr + pair[:, None] * stride_out + n[None, :],
        acc * tw[:, None],
        mask=mv[:, None] & nv[None, :],
    )


# -- host wrapper ----------------------------------------------------------------------------------
def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return _inner_contiguous(t if t.dtype == torch.uint8 else t.view(torch.uint8))


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """``ops.api.moe_experts`` for any batch (the package's ``moe_experts`` takes it above the
    GEMV's tokens); x bf16 or fp32 (float64 is the reference's). Ids outside [-1, E) are not
    checked (that would need a host sync): they contribute nothing here."""
    n_exp, inter, fp4 = validate_moe_args(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale)
    t, d = x.shape
    k = topk_ids.shape[1]
    tokens = _tokens_per_launch(t, k, n_exp, inter, d, grid_limit(x.device))
    if tokens < t:  # a grid over the device's bound (Ascend, long prefill): tokens are independent
        return torch.cat(
            [
                grouped_experts(
                    x[i : i + tokens],
                    topk_weights[i : i + tokens],
                    topk_ids[i : i + tokens],
                    w13,
                    w13_scale,
                    w2,
                    w2_scale,
                    swiglu_limit,
                )
                for i in range(0, t, tokens)
            ]
        )
    p = t * k
    buf = torch.zeros(t, k, d, dtype=torch.float32, device=x.device)
    if p == 0:
        return buf.sum(dim=1)
    cfg = launch_config(p, n_exp)
    bm, bn = cfg["BM"], cfg["BN"]
    sorted_ids, block_expert, n_padded, n_blocks = align_pairs(topk_ids, n_exp, bm)
    x = _inner_contiguous(x)
    if fp4:
        w13, w2 = _as_bytes(w13), _as_bytes(w2)
        s13, s2 = _as_bytes(w13_scale), _as_bytes(w2_scale)
    else:
        w13, w2 = _inner_contiguous(w13), _inner_contiguous(w2)
        s13, s2 = w13, w2  # unused (FP4=False)
    is_bf16 = x.dtype == torch.bfloat16
    bf16_ok = is_bf16 and x.device.type != "cpu"  # CPU tensors: the interpreter
    dot13 = bf16_ok and (fp4 or w13.dtype == torch.bfloat16)
    dot2 = bf16_ok and (fp4 or w2.dtype == torch.bfloat16)
    rows = DOT_ROWS if x.device.type == "cpu" else 0
    mode13, mode2 = int(dot13) or rows, int(dot2) or rows
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    has_limit = swiglu_limit is not None and swiglu_limit > 0
    tiles1 = cdiv(inter, bn)
    _moe_gate_up_kernel[(n_blocks * tiles1,)](
        x,
        w13,
        s13,
        sorted_ids,
        block_expert,
        n_padded,
        act,
        float(swiglu_limit) if has_limit else 0.0,
        p,
        k,
        d,
        inter,
        tiles1,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        act.stride(0),
        FP4=fp4,
        HAS_LIMIT=has_limit,
        DOT_BF16=mode13,
        BF16_BITS=is_bf16 and not dot13,
        ACT_BF16=is_bf16,
        BM=bm,
        BN=bn,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_launch(x.device),
    )
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    out = buf.view(p, d)
    tiles2 = cdiv(d, bn)
    _moe_down_kernel[(n_blocks * tiles2,)](
        act,
        w2,
        s2,
        sorted_ids,
        block_expert,
        n_padded,
        tw,
        out,
        p,
        d,
        inter,
        tiles2,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        out.stride(0),
        FP4=fp4,
        DOT_BF16=mode2,
        BF16_BITS=is_bf16 and not dot2,
        BM=bm,
        BN=bn,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_launch(x.device),
    )
    return sum_slots(buf)
