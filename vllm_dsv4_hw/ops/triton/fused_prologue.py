# SPDX-License-Identifier: Apache-2.0
"""Triton ``qnorm_rope_kv_insert``: the query prologue and the window-KV insert of a layer in one
launch (horizontal fusion) for decode-sized calls. Rows ``[0, T*H)`` are (token, head) query rows:
weightless RMSNorm + RoPE, stored to q_out. Rows ``[T*H, T*H + T)`` are one token's KV row each:
RoPE, then quantize + write into the paged window cache. No program reads another's output. From
``SEPARATE_FROM_TOKENS`` tokens the two row kinds are two launches of the kernel, each specialized
to one kind.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.checks import check_fused_rope_args, check_qnorm_rope_kv_insert_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.rows import (
    grid_1d,
    is_f64,
    out_is_bf16,
    rope_pairs,
    to_math,
    to_out,
)
from vllm_dsv4_hw.ops.triton.kv_cache import (
    cache_aligned,
    check_insert_args,
    entry_layout,
    insert_entry,
)
from vllm_dsv4_hw.ops.triton.norm import rsqrt_m

# From this many tokens the query rows and the KV rows go to two launches of the kernel, each
# specialized to one row kind (the fused program carries the quantizing insert's code into every
# query row; evidence: docs/tuning.md, qnorm_rope_kv_insert's query-row launch).
SEPARATE_FROM_TOKENS = 256
# Warps of the query-row launch (the fused launch keeps 4 / 2): one warp per 512-wide row, the
# fastest (evidence: docs/tuning.md, qnorm_rope_kv_insert's query-row launch). The row's reduction
# order follows the warps: a fixed choice.
SEPARATE_Q_WARPS = 1


@triton.jit
def _q_row(
    row,
    q_ptr,
    pos_ptr,
    cs_ptr,
    qo_ptr,
    n_heads,
    q_tok_stride,
    q_head_stride,
    cs_stride,
    eps,
    offs,
    jr,
    jmask,
    NP: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    F64: tl.constexpr,
    Q_BF16: tl.constexpr,
):
    """Query row (token t, head h): weightless RMSNorm + RoPE. The row is read once, contiguously
    (vector loads), for the norm and the pass-through dims; only the R rope dims are re-read as
    (even, odd) pairs."""
    r = tl.cast(row, tl.int64)
    t = r // n_heads
    src = q_ptr + t * q_tok_stride + (r % n_heads) * q_head_stride
    x = to_math(tl.load(src + offs, mask=offs < 2 * NP, other=0.0), F64)
    rr = rsqrt_m(tl.sum(x * x, axis=0) / (2 * NP) + eps, F64)
    dst = qo_ptr + r * (2 * NP)
    tl.store(dst + offs, to_out(x * rr, Q_BF16), mask=offs < 2 * FIRST_PAIR)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs = cs_ptr + pos * cs_stride
    c = to_math(tl.load(cs + jr, mask=jmask, other=1.0), F64)
    sn = to_math(tl.load(cs + HALF + jr, mask=jmask, other=0.0), F64)
    pe = 2 * (FIRST_PAIR + jr)
    xe = to_math(tl.load(src + pe, mask=jmask, other=0.0), F64) * rr
    xo = to_math(tl.load(src + pe + 1, mask=jmask, other=0.0), F64) * rr
    tl.store(dst + pe, to_out(xe * c - xo * sn, Q_BF16), mask=jmask)
    tl.store(dst + pe + 1, to_out(xo * c + xe * sn, Q_BF16), mask=jmask)


@triton.jit
def _kv_row(
    t,
    kv_ptr,
    pos_ptr,
    cs_ptr,
    cache_ptr,
    slots_ptr,
    kv_stride,
    cs_stride,
    page_stride,
    capacity,
    E,
    pidx,
    blk,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    F64: tl.constexpr,
):
    """KV row of token t: RoPE + quantize + window-cache insert."""
    t = tl.cast(t, tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        src = kv_ptr + t * kv_stride
        xe = to_math(tl.load(src + 2 * pidx), F64)
        xo = to_math(tl.load(src + 2 * pidx + 1), F64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        ye, yo = rope_pairs(xe, xo, cs_ptr + pos * cs_stride, pidx, FIRST_PAIR, HALF, False, F64)
        insert_entry(
            cache_ptr,
            slot,
            capacity,
            E,
            page_stride,
            ye.to(tl.float32),
            yo.to(tl.float32),
            pidx,
            blk,
            DATA_BYTES,
            SCALE_BYTES,
            FMT,
            ALIGNED,
        )


@triton.jit
def _qnorm_rope_kv_insert_kernel(
    q_ptr,
    kv_ptr,
    pos_ptr,
    cs_ptr,
    qo_ptr,
    cache_ptr,
    slots_ptr,
    n_tokens,
    n_heads,
    q_tok_stride,
    q_head_stride,
    kv_stride,
    cs_stride,
    eps,
    page_stride,
    capacity,
    E,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    NB: tl.constexpr,
    BP: tl.constexpr,
    NP: tl.constexpr,
    ALIGNED: tl.constexpr,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    F64: tl.constexpr,
    Q_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DO_Q: tl.constexpr,
    DO_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    blk = tl.arange(0, NB)
    pidx = blk[:, None] * BP + tl.arange(0, BP)[None, :]
    offs = tl.arange(0, BLOCK_D)
    jr = tl.arange(0, BLOCK_R)
    jmask = jr < HALF
    n_q = n_tokens * n_heads
    if DO_Q:
        if DO_KV:
            for row in range(pid, n_q + n_tokens, nprog):
                if row < n_q:
                    _q_row(
                        row,
                        q_ptr,
                        pos_ptr,
                        cs_ptr,
                        qo_ptr,
                        n_heads,
                        q_tok_stride,
                        q_head_stride,
                        cs_stride,
                        eps,
                        offs,
                        jr,
                        jmask,
                        NP,
                        FIRST_PAIR,
                        HALF,
                        F64,
                        Q_BF16,
                    )
                else:
                    _kv_row(
                        row - n_q,
                        kv_ptr,
                        pos_ptr,
                        cs_ptr,
                        cache_ptr,
                        slots_ptr,
                        kv_stride,
                        cs_stride,
                        page_stride,
                        capacity,
                        E,
                        pidx,
                        blk,
                        DATA_BYTES,
                        SCALE_BYTES,
                        FMT,
                        ALIGNED,
                        FIRST_PAIR,
                        HALF,
                        F64,
                    )
        else:
            for row in range(pid, n_q, nprog):
                _q_row(
                    row,
                    q_ptr,
                    pos_ptr,
                    cs_ptr,
                    qo_ptr,
                    n_heads,
                    q_tok_stride,
                    q_head_stride,
                    cs_stride,
                    eps,
                    offs,
                    jr,
                    jmask,
                    NP,
                    FIRST_PAIR,
                    HALF,
                    F64,
                    Q_BF16,
                )
    else:
        for tok in range(pid, n_tokens, nprog):
            _kv_row(
                tok,
                kv_ptr,
                pos_ptr,
                cs_ptr,
                cache_ptr,
                slots_ptr,
                kv_stride,
                cs_stride,
                page_stride,
                capacity,
                E,
                pidx,
                blk,
                DATA_BYTES,
                SCALE_BYTES,
                FMT,
                ALIGNED,
                FIRST_PAIR,
                HALF,
                F64,
            )


@register_op(QNORM_ROPE_KV_INSERT, "triton")
def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    fmt,
) -> torch.Tensor:
    check_qnorm_rope_kv_insert_args(q, kv, fmt)
    t, h, d = q.shape
    check_fused_rope_args("qnorm_rope_kv_insert", positions, cos_sin, t, d)
    r = cos_sin.shape[-1]
    code, nb, bp = entry_layout(fmt)
    slots = check_insert_args(window_cache, window_slots, t, fmt)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    cs = cos_sin.to(q.device)
    if cs.stride(-1) != 1:
        cs = cs.contiguous()
    pos = positions.to(q.device)
    args = (
        q,
        kv,
        pos,
        cs,
        q_out,
        window_cache,
        slots,
        t,
        h,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        cs.stride(0),
        float(eps),
        window_cache.stride(0),
        window_cache.shape[0] * fmt.entries_per_page,
        fmt.entries_per_page,
    )
    consts = dict(
        DATA_BYTES=fmt.data_bytes,
        SCALE_BYTES=fmt.scale_bytes,
        FMT=code,
        NB=nb,
        BP=bp,
        NP=d // 2,
        ALIGNED=cache_aligned(window_cache),
        FIRST_PAIR=(d - r) // 2,
        HALF=r // 2,
        F64=is_f64(q, kv),
        Q_BF16=out_is_bf16(q_out),
        BLOCK_D=next_pow2(d),
        BLOCK_R=next_pow2(max(r // 2, 1)),
        num_warps=4 if d >= 512 else 2,
    )
    if t < SEPARATE_FROM_TOKENS:  # one launch for both row kinds (decode: launch-bound)
        _qnorm_rope_kv_insert_kernel[grid_1d(t * h + t, q.device)](
            *args, DO_Q=True, DO_KV=True, **consts, **pdl_launch(q.device)
        )
    else:  # each launch compiled without the other row kind's code and registers
        _qnorm_rope_kv_insert_kernel[grid_1d(t * h, q.device)](
            *args,
            DO_Q=True,
            DO_KV=False,
            **dict(consts, num_warps=SEPARATE_Q_WARPS),
            **pdl_launch(q.device),
        )
        _qnorm_rope_kv_insert_kernel[grid_1d(t, q.device)](
            *args, DO_Q=False, DO_KV=True, **consts, **pdl_launch(q.device)
        )
    return q_out
