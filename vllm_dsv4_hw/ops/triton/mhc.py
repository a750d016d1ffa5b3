# SPDX-License-Identifier: Apache-2.0
"""Triton mHC: ``hc_pre``, ``hc_seam`` and ``hc_post`` (the contracts in ``ops/api.py``, the math
in ``ops/reference/mhc.py``) in at most two launches each.

* ``_hc_mix_partial_kernel``, grid (tokens, D / BD): each program takes BD dims of every stream of
  one token; for a seam it first rebuilds those dims of the new streams (``post_k y + sum_j
  comb[j, k] h_j``, rounded to the stream dtype and stored), then writes its share of the mix
  projection ``fn z`` and of ``sum z^2`` (z = the streams, flattened) to a partials buffer. The
  1.6 MB ``fn`` of V4-Flash is so read by many programs at once instead of streamed by one per
  token. The token's last program to finish (an arrival counter; ``common.counters``) sums the
  partials in a fixed order (no float atomics: the same bits whichever program is last) and takes
  the weightless norm, the pre / post / comb mixes and the Sinkhorn iterations of ``comb``.
* ``_hc_input_kernel``, one program per token: the sub-block input ``x = sum_j pre_j h_j`` rounded
  to the stream dtype and its RMSNorm, all of D held in registers.

Where no counters can be had (a stream first met under graph capture) the mixes take a launch of
their own (``_hc_mixes_kernel``), same bits. ``hc_post`` alone (the last sub-block of a layer) is
one elementwise launch. Streams in bf16 or fp32; fp64 streams (oracle tests) and calls of more
than ``FUSED_MAX_TOKENS`` tokens (prefill chunks, where one fused GEMM over all tokens reads
``fn`` once) run the reference composition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.api import HC_POST, HC_PRE, HC_SEAM
from vllm_dsv4_hw.ops.checks import check_hc_args, check_hc_post_args
from vllm_dsv4_hw.ops.reference import mhc as ref
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.counters import arrival_counters
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import round_to_bf16

# Above this many tokens the reference composition (one GEMM of all tokens against fn) runs.
FUSED_MAX_TOKENS = 64
# The partial pass by tokens in the call: (up to tokens, dims of every stream per program, warps).
# Few tokens get narrow slices, so that a token's fn read spreads over many programs, and one
# warp, so that the program taking the mixes runs the Sinkhorn iterations with warp shuffles
# alone (no barrier per step; evidence: docs/tuning.md, mHC).
PARTIAL_TILES = ((4, 32, 1), (16, 64, 2), (FUSED_MAX_TOKENS, 128, 4))
# Partial rows the mixes add per step (lane by lane, then across the lanes).
MIX_ROWS = 32
# The input pass holds a token's [hc, D] streams in registers: warps by their size, so that
# each thread keeps at most INPUT_ELEMS_PER_THREAD of them.
INPUT_ELEMS_PER_THREAD = 32


@triton.jit
def _rebuilt_streams(
    y_ptr,
    h_ptr,
    post_ptr,
    comb_ptr,
    t,
    offs_j,
    offs_d,
    HC: tl.constexpr,
    D: tl.constexpr,
    HAS_POST: tl.constexpr,
    ROUND_Y: tl.constexpr,
):
    """[HCP, BD] fp32: the streams' dims ``offs_d`` of token t, rebuilt by the post if any
    (``ROUND_Y``: an fp32 y rounded to the bf16 streams' grid first)."""
    mj = offs_j < HC
    md = offs_d < D
    m2 = mj[:, None] & md[None, :]
    hv = tl.load(h_ptr + t * HC * D + offs_j[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
    hv = hv.to(tl.float32)
    if HAS_POST:
        yv = tl.load(y_ptr + t * D + offs_d, mask=md, other=0.0).to(tl.float32)
        if ROUND_Y:
            yv = round_to_bf16(yv)
        pv = tl.load(post_ptr + t * HC + offs_j, mask=mj, other=0.0)
        acc = pv[:, None] * yv[None, :]
        for j in tl.static_range(HC):
            hj = tl.sum(tl.where(offs_j[:, None] == j, hv, 0.0), axis=0)  # [BD]
            cj = tl.load(comb_ptr + t * HC * HC + j * HC + offs_j, mask=mj, other=0.0)  # comb[j, :]
            acc += cj[:, None] * hj[None, :]
        return acc
    else:
        return hv


@triton.jit
def _mixes(
    part_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    t,
    iters,
    hc_eps,
    eps,
    HC: tl.constexpr,
    HCP: tl.constexpr,
    D: tl.constexpr,
    NMIX: tl.constexpr,
    MP: tl.constexpr,
    SC: tl.constexpr,
    N_SPLIT: tl.constexpr,
):
    """Token t's pre / post / comb mixes from its ``N_SPLIT`` partial rows (summed in a fixed
    order: SC rows at a time, lane by lane, then across the lanes; read from L2, where other
    programs wrote them, in one unrolled pass so that the loads wait on L2 once): the
    weightless norm, the sigmoids, and the Sinkhorn iterations of comb (an hc x hc tile in
    registers)."""
    offs_c = tl.arange(0, SC)
    offs_j = tl.arange(0, HCP)
    mj = offs_j < HC
    cidx = 2 * HC + offs_j[:, None] * HC + offs_j[None, :]  # [HCP, HCP]
    mc = mj[:, None] & mj[None, :]
    ssq_v = tl.zeros([SC], dtype=tl.float32)
    pre_v = tl.zeros([SC, HCP], dtype=tl.float32)
    post_v = tl.zeros([SC, HCP], dtype=tl.float32)
    comb_v = tl.zeros([SC, HCP, HCP], dtype=tl.float32)
    for c0 in tl.static_range(0, N_SPLIT, SC):
        ms = (c0 + offs_c) < N_SPLIT
        rows = part_ptr + (t * N_SPLIT + c0 + offs_c) * MP
        m2s = ms[:, None] & mj[None, :]
        ssq_v += tl.load(rows + NMIX, mask=ms, other=0.0, cache_modifier=".cg")
        pre_v += tl.load(rows[:, None] + offs_j[None, :], mask=m2s, other=0.0, cache_modifier=".cg")
        post_v += tl.load(
            rows[:, None] + HC + offs_j[None, :], mask=m2s, other=0.0, cache_modifier=".cg"
        )
        comb_v += tl.load(
            rows[:, None, None] + cidx[None, :, :],
            mask=ms[:, None, None] & mc[None, :, :],
            other=0.0,
            cache_modifier=".cg",
        )
    inv = tl.rsqrt(tl.sum(ssq_v, axis=0) / (HC * D) + eps)
    pre_l = tl.sum(pre_v, axis=0) * inv
    post_l = tl.sum(post_v, axis=0) * inv
    comb_l = tl.sum(comb_v, axis=0) * inv
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_l * s0 + tl.load(base_ptr + offs_j, mask=mj, other=0.0)) + hc_eps
    post = 2.0 * tl.sigmoid(post_l * s1 + tl.load(base_ptr + HC + offs_j, mask=mj, other=0.0))
    logits = comb_l * s2 + tl.load(base_ptr + cidx, mask=mc, other=0.0)
    # softmax over k (the last axis), + eps, then Sinkhorn: one column step, iters - 1 (row, column)
    logits = tl.where(mc, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    e = tl.where(mc, e, 0.0)
    m = tl.where(mc, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
    for _ in range(1, iters):
        m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
        m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
    tl.store(pre_ptr + t * HC + offs_j, pre, mask=mj)
    tl.store(post_ptr + t * HC + offs_j, post, mask=mj)
    tl.store(comb_ptr + t * HC * HC + offs_j[:, None] * HC + offs_j[None, :], m, mask=mc)


@triton.jit
def _hc_mix_partial_kernel(
    y_ptr,
    h_ptr,
    post_ptr,
    comb_ptr,
    h2_ptr,
    fn_ptr,
    part_ptr,
    cnt_ptr,
    scale_ptr,
    base_ptr,
    pre_out_ptr,
    post_out_ptr,
    comb_out_ptr,
    iters,
    hc_eps,
    eps,
    HC: tl.constexpr,
    HCP: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    NMIX: tl.constexpr,
    MP: tl.constexpr,
    SC: tl.constexpr,
    HAS_POST: tl.constexpr,
    BF16: tl.constexpr,
    ROUND_Y: tl.constexpr,
    LAST_MIXES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs_j = tl.arange(0, HCP)
    offs_d = s * BD + tl.arange(0, BD)
    offs_m = tl.arange(0, MP)
    mj = offs_j < HC
    md = offs_d < D
    z = _rebuilt_streams(
        y_ptr, h_ptr, post_ptr, comb_ptr, t, offs_j, offs_d, HC, D, HAS_POST, ROUND_Y
    )
    if HAS_POST:
        if BF16:
            z = round_to_bf16(z)
        m2 = mj[:, None] & md[None, :]
        tl.store(h2_ptr + t * HC * D + offs_j[:, None] * D + offs_d[None, :], z, mask=m2)
    ssq = tl.sum(tl.sum(z * z, axis=1), axis=0)
    acc = tl.zeros([MP], dtype=tl.float32)
    mm = offs_m < NMIX
    for k in tl.static_range(HC):
        zk = tl.sum(tl.where(offs_j[:, None] == k, z, 0.0), axis=0)  # [BD]
        fk = tl.load(
            fn_ptr + offs_m[:, None] * (HC * D) + k * D + offs_d[None, :],
            mask=mm[:, None] & md[None, :],
            other=0.0,
        )
        acc += tl.sum(fk * zk[None, :], axis=1)
    acc = tl.where(offs_m == NMIX, ssq, acc)
    n_split: tl.constexpr = (D + BD - 1) // BD  # the grid's second axis
    tl.store(part_ptr + (t * n_split + s) * MP + offs_m, acc)
    if LAST_MIXES:  # the token's last program to finish takes its mixes (counters left zeroed)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
        if done == n_split - 1:
            _mixes(
                part_ptr, scale_ptr, base_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, t,
                iters, hc_eps, eps, HC, HCP, D, NMIX, MP, SC, n_split,
            )  # fmt: skip
            tl.store(cnt_ptr + t, 0)


@triton.jit
def _hc_mixes_kernel(
    part_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    iters,
    hc_eps,
    eps,
    HC: tl.constexpr,
    HCP: tl.constexpr,
    D: tl.constexpr,
    NMIX: tl.constexpr,
    MP: tl.constexpr,
    SC: tl.constexpr,
    N_SPLIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The mixes as a launch of their own (where no arrival counters can be had)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    _mixes(
        part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t, iters, hc_eps, eps, HC,
        HCP, D, NMIX, MP, SC, N_SPLIT,
    )  # fmt: skip


@triton.jit
def _hc_input_kernel(
    pre_ptr,
    h2_ptr,
    w_ptr,
    x_ptr,
    eps,
    HC: tl.constexpr,
    HCP: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """x = sum_j pre_j h_j, rounded to the stream dtype, and its RMSNorm: all of D in registers
    (one load of the streams, one store; a loop over D would wait on L2 once per step)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, HCP)
    mj = offs_j < HC
    offs_d = tl.arange(0, BLOCK)
    md = offs_d < D
    pre = tl.load(pre_ptr + t * HC + offs_j, mask=mj, other=0.0)
    hv = tl.load(
        h2_ptr + t * HC * D + offs_j[:, None] * D + offs_d[None, :],
        mask=mj[:, None] & md[None, :],
        other=0.0,
    ).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    x = tl.sum(pre[:, None] * hv, axis=0)
    if BF16:
        x = round_to_bf16(x)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r * w
    if BF16:
        y = round_to_bf16(y)
    tl.store(x_ptr + t * D + offs_d, y, mask=md)


@triton.jit
def _hc_post_kernel(
    y_ptr,
    h_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    HC: tl.constexpr,
    HCP: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BF16: tl.constexpr,
    ROUND_Y: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, HCP)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    z = _rebuilt_streams(y_ptr, h_ptr, post_ptr, comb_ptr, t, offs_j, offs_d, HC, D, True, ROUND_Y)
    if BF16:
        z = round_to_bf16(z)
    m2 = (offs_j < HC)[:, None] & (offs_d < D)[None, :]
    tl.store(out_ptr + t * HC * D + offs_j[:, None] * D + offs_d[None, :], z, mask=m2)


def _partial_tile(tokens: int, d: int) -> tuple[int, int]:
    """(dims of every stream per program, warps) of the partial pass for ``tokens``."""
    bd, warps = next(((b, w) for limit, b, w in PARTIAL_TILES if tokens <= limit), (128, 4))
    return min(bd, next_pow2(d)), warps


def _input_warps(hcp: int, d: int) -> int:
    return min(16, max(4, hcp * next_pow2(d) // (32 * INPUT_ELEMS_PER_THREAD)))


def _fused(h: torch.Tensor) -> bool:
    return h.dtype in (torch.bfloat16, torch.float32) and h.shape[0] <= FUSED_MAX_TOKENS


def _seam(y, h, post, comb, fn, scale, base, norm_w, iters, hc_eps, eps):
    """The passes; ``y is None`` for a pre without a post. Returns (h2, x, post2, comb2)."""
    t, hc, d = check_hc_args(h, fn, scale, base, norm_w)
    has_post = y is not None
    h = h.contiguous()
    h2 = torch.empty_like(h) if has_post else h
    n_mix = (2 + hc) * hc
    mp = next_pow2(n_mix + 1)
    bd, warps = _partial_tile(t, d)
    n_split = cdiv(d, bd)
    f32 = dict(dtype=torch.float32, device=h.device)
    pre2 = torch.empty(t, hc, **f32)
    post2 = torch.empty(t, hc, **f32)
    comb2 = torch.empty(t, hc, hc, **f32)
    x = torch.empty(t, d, dtype=h.dtype, device=h.device)
    if t == 0:
        return h2, x, post2, comb2
    part = torch.empty(t, n_split, mp, **f32)
    counters = arrival_counters(h.device, t)
    hcp, bf16 = next_pow2(hc), h.dtype == torch.bfloat16
    sc = min(MIX_ROWS, next_pow2(n_split))
    scale, base = scale.float().contiguous(), base.float().contiguous()
    dims = dict(HC=hc, HCP=hcp, D=d, NMIX=n_mix, MP=mp, SC=sc)
    dummy = h  # never read without HAS_POST
    _hc_mix_partial_kernel[(t, n_split)](
        y.contiguous() if has_post else dummy,
        h,
        post.contiguous() if has_post else dummy,
        comb.contiguous() if has_post else dummy,
        h2,
        fn.float().contiguous(),
        part,
        part if counters is None else counters,
        scale,
        base,
        pre2,
        post2,
        comb2,
        iters,
        hc_eps,
        eps,
        **dims,
        BD=bd,
        HAS_POST=has_post,
        ROUND_Y=has_post and bf16 and y.dtype != torch.bfloat16,
        BF16=bf16,
        LAST_MIXES=counters is not None,
        num_warps=warps,
        **pdl_launch(h.device),
    )
    if counters is None:
        _hc_mixes_kernel[(t,)](
            part, scale, base, pre2, post2, comb2, iters, hc_eps, eps, **dims, N_SPLIT=n_split,
            num_warps=1, **pdl_launch(h.device),
        )  # fmt: skip
    _hc_input_kernel[(t,)](
        pre2,
        h2,
        norm_w.contiguous(),
        x,
        eps,
        HC=hc,
        HCP=hcp,
        D=d,
        BLOCK=next_pow2(d),
        BF16=bf16,
        num_warps=_input_warps(hcp, d),
        **pdl_launch(h.device),
    )
    return h2, x, post2, comb2


@register_op(HC_PRE, "triton")
def hc_pre(h, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps):
    if not _fused(h):
        return ref.hc_pre(h, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)
    _, x, post, comb = _seam(
        None, h, None, None, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps
    )
    return x, post, comb


@register_op(HC_SEAM, "triton")
def hc_seam(y, h, post, comb, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps):
    check_hc_post_args(y, h, post, comb)
    if not _fused(h) or post.dtype != torch.float32:
        return ref.hc_seam(y, h, post, comb, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)
    return _seam(y, h, post, comb, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)


@register_op(HC_POST, "triton")
def hc_post(y, h, post, comb):
    t, hc, d = check_hc_post_args(y, h, post, comb)
    if h.dtype not in (torch.bfloat16, torch.float32) or post.dtype != torch.float32:
        return ref.hc_post(y, h, post, comb)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    bd, _ = _partial_tile(t, d)
    _hc_post_kernel[(t, cdiv(d, bd))](
        y.contiguous(),
        h.contiguous(),
        post.contiguous(),
        comb.contiguous(),
        out,
        HC=hc,
        HCP=next_pow2(hc),
        D=d,
        BD=bd,
        BF16=h.dtype == torch.bfloat16,
        ROUND_Y=h.dtype == torch.bfloat16 and y.dtype != torch.bfloat16,
        **pdl_launch(h.device),
    )
    return out
