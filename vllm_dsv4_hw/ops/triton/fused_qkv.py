"""Triton ``qnorm_rope_kv_insert``: the query prologue and the window-KV insert of a layer in one
launch (horizontal fusion). Programs ``[0, T*H)`` take one (token, head) query row each: weightless
RMSNorm + RoPE, stored to q_out. Programs ``[T*H, T*H + T)`` take one token's KV row each: RoPE,
then quantize + write into the paged window cache. No program reads another's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.checks import check_fused_rope_args, check_qnorm_rope_kv_insert_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common import grid_1d, is_f64, out_is_bf16, rope_pairs, to_math, to_out
from vllm_dsv4_hw.ops.triton.kv_insert import (
    cache_aligned,
    check_insert_args,
    entry_layout,
    insert_entry,
)
from vllm_dsv4_hw.ops.triton.norm import rsqrt_m


@triton.jit
def _qnorm_rope_kv_insert_kernel(
        q_ptr, kv_ptr, pos_ptr, cs_ptr, qo_ptr, cache_ptr, slots_ptr,
        n_tokens, n_heads, q_tok_stride, q_head_stride, kv_stride, cs_stride, eps,
        page_stride, capacity, E,
        DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr,
        NB: tl.constexpr, BP: tl.constexpr, NP: tl.constexpr, ALIGNED: tl.constexpr,
        FIRST_PAIR: tl.constexpr, HALF: tl.constexpr, F64: tl.constexpr, Q_BF16: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    blk = tl.arange(0, NB)
    pidx = blk[:, None] * BP + tl.arange(0, BP)[None, :]
    n_q = n_tokens * n_heads
    for row in range(pid, n_q + n_tokens, nprog):
        if row < n_q:
            # -- query row (token t, head h): weightless RMSNorm + RoPE -------------------------
            r = tl.cast(row, tl.int64)
            t = r // n_heads
            src = q_ptr + t * q_tok_stride + (r % n_heads) * q_head_stride
            xe = to_math(tl.load(src + 2 * pidx), F64)
            xo = to_math(tl.load(src + 2 * pidx + 1), F64)
            ss = tl.sum(tl.sum(xe * xe + xo * xo, axis=1), axis=0)
            rr = rsqrt_m(ss / (2 * NP) + eps, F64)
            pos = tl.load(pos_ptr + t).to(tl.int64)
            ye, yo = rope_pairs(xe * rr, xo * rr, cs_ptr + pos * cs_stride, pidx, FIRST_PAIR, HALF,
                                False, F64)
            dst = qo_ptr + r * (2 * NP)
            tl.store(dst + 2 * pidx, to_out(ye, Q_BF16))
            tl.store(dst + 2 * pidx + 1, to_out(yo, Q_BF16))
        else:
            # -- KV row of token t: RoPE + quantize + window-cache insert ----------------------
            t = tl.cast(row - n_q, tl.int64)
            slot = tl.load(slots_ptr + t).to(tl.int64)
            if slot >= 0:
                src = kv_ptr + t * kv_stride
                xe = to_math(tl.load(src + 2 * pidx), F64)
                xo = to_math(tl.load(src + 2 * pidx + 1), F64)
                pos = tl.load(pos_ptr + t).to(tl.int64)
                ye, yo = rope_pairs(xe, xo, cs_ptr + pos * cs_stride, pidx, FIRST_PAIR, HALF,
                                    False, F64)
                insert_entry(cache_ptr, slot, capacity, E, page_stride, ye.to(tl.float32),
                             yo.to(tl.float32), pidx, blk, DATA_BYTES, SCALE_BYTES, FMT, ALIGNED)


@register_op(QNORM_ROPE_KV_INSERT, "triton")
def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, eps: float, window_cache: torch.Tensor,
                         window_slots: torch.Tensor, fmt) -> torch.Tensor:
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
    n_progs = t * h + t
    _qnorm_rope_kv_insert_kernel[grid_1d(n_progs, q.device)](
        q, kv, pos, cs, q_out, window_cache, slots,
        t, h, q.stride(0), q.stride(1), kv.stride(0), cs.stride(0), float(eps),
        window_cache.stride(0), window_cache.shape[0] * fmt.entries_per_page, fmt.entries_per_page,
        DATA_BYTES=fmt.data_bytes, SCALE_BYTES=fmt.scale_bytes, FMT=code, NB=nb, BP=bp, NP=d // 2,
        ALIGNED=cache_aligned(window_cache), FIRST_PAIR=(d - r) // 2, HALF=r // 2,
        F64=is_f64(q, kv), Q_BF16=out_is_bf16(q_out), num_warps=4 if d >= 512 else 2)
    return q_out
