# SPDX-License-Identifier: Apache-2.0
"""Triton ``fp8_block_linear`` with ``quantize_x``: W8A8, both dot operands e4m3 (capability
``fp8_dot``: CUDA sm_89+), the checkpoint's dynamic activation scheme.

    y[m, n] = sum_kb s[n // bn, kb] * sx[m, kb] * sum_{k in block kb} q[m, k] * e4m3(W[n, k])

with ``q`` / ``sx`` x's e4m3 codes and power-of-two scale per row and K block
(``ops.reference.fp8_linear.quantize_activations``): the [BM, BK] activation tile's row maxima,
the exact ``ceil(log2(amax / 448))`` from the bits (``quant.ceil_log2_div``), a power-of-two
multiply and the hardware cvt (round to nearest even, as the reference's ``e4m3_encode``); done
in the program on x as it lies (``PRE`` off: no second launch), or by ``_quantize_kernel`` in a
launch before (``PRE``: the codes then stream into the dots like the weight, which wins for wide
weights past 16 rows and for prefill). The weight tile goes from global memory to the tensor
cores as the checkpoint ships it, with no e4m3 decode in registers. Each K block's dot is scaled
and added to an fp32 accumulator, so the products of a block (exact in fp32) are summed in the
tensor core only within the block. Faster than the W8A16 kernel at every row count (evidence:
docs/tuning.md, W8A8 GEMM).

Tiles: up to ``WT_MAX_ROWS`` rows the weight tile is the dot's A operand (y^T = W x^T: its BN rows
fill Hopper's 64-row wgmma, x's few rows are the narrow N side); more rows take the x tile as A.
Split-K (``fp8_linear``'s rule, ``split_k``'s partials and last-split sum) and the row-chunked
launches are the W8A16 kernel's. Under the
Triton interpreter (CPU tensors) the same program runs with the integer codecs and an fp32
``ieee`` dot (``EMU``), so the CPU suite checks its tiling, masks and splits against the reference.
The K tile is the scale block: ``bk`` must be a power of two in [32, 256] (``supports``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.numerics import FP8_AMAX_FLOOR
from vllm_dsv4_hw.ops.reference.linear import Fp8LinearArgs
from vllm_dsv4_hw.ops.triton.common.launch import capabilities, cdiv, grid_limit, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import (
    pdl_launch,
    pdl_start,
    pdl_start_prefetching,
    weight_prefetch,
)
from vllm_dsv4_hw.ops.triton.common.quant import (
    ceil_log2_div,
    e4m3_bits_to_f32,
    f32_to_e4m3_bits,
    pow2_f32,
    ue8m0_to_f32,
)
from vllm_dsv4_hw.ops.triton.linear import block as w16
from vllm_dsv4_hw.ops.triton.linear import split_k as sk

WT_MAX_ROWS = 64
AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def _quantize_rows(x, EMU: tl.constexpr):
    """fp32 tile [R, BK] -> (its e4m3 codes as the dot's operand dtype, the rows' scales [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    e = ceil_log2_div(amax, 0x600000, 8)  # 448 = 1.75 * 2^8
    q = x * pow2_f32(-e)[:, None]  # |q| <= 448: exact, no saturation needed
    if EMU:
        q = e4m3_bits_to_f32(f32_to_e4m3_bits(q))
    else:
        q = q.to(tl.float8e4nv)
    return q, pow2_f32(e)


@triton.jit(do_not_specialize=["M", "n_mblk", "sos"])
def _w8a8_block_linear_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    red_ptr,
    cnt_ptr,
    M,
    N,
    K,
    KB,
    kb_per_split,
    n_nblk,
    n_mblk,
    sxg,
    sxm,
    sxsg,
    sxsm,
    swg,
    swn,
    ssg,
    ssn,
    sos,
    sog,
    som,
    SBN: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WT: tl.constexpr,
    EMU: tl.constexpr,
    PRE: tl.constexpr,
    XPF: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SERIAL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_BF16: tl.constexpr,
    PF_BYTES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    # PRE: x_ptr holds x's e4m3 codes and xs_ptr their scales (``_quantize_kernel``), loaded as
    # they lie (pipelined like the weight); else x itself, quantized here, its next K block's
    # tile loaded one iteration ahead when XPF (its latency hidden behind the dot)
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = pid % n_nblk  # column blocks fastest: neighbours share the activation tile
    pid_gm = pid // n_nblk
    g = (pid_gm // n_mblk).to(tl.int64)
    mb = pid_gm % n_mblk
    offs_m = mb * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kb0 = pid_s * kb_per_split
    w_rows = w_ptr + g * swg + offs_n.to(tl.int64) * swn
    # the weight's first bytes of this split ask L2 before the wait (rows past N: none)
    pdl_start_prefetching(PDL, PF_BYTES, w_rows + kb0 * BK, tl.where(n_ok, K - kb0 * BK, 0))
    x_rows = x_ptr + g * sxg + offs_m.to(tl.int64) * sxm
    s_base = s_ptr + g * ssg + (offs_n // SBN).to(tl.int64) * ssn  # each column's scale row
    if WT:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    lane = tl.arange(0, BK)
    xs_rows = xs_ptr + g * sxsg + offs_m.to(tl.int64) * sxsm
    k_end = tl.minimum(K, (kb0 + kb_per_split) * BK)  # this split's K range ends here
    if XPF and not PRE:
        xv_next = tl.load(
            x_rows[:, None] + (kb0 * BK + lane)[None, :],
            mask=m_ok[:, None] & ((kb0 * BK + lane) < K)[None, :],
            other=0.0,
        )
    for i in range(0, kb_per_split):
        kb = kb0 + i
        offs_k = kb * BK + lane
        # past K (or the last block of an uneven split) x loads as 0 and so does its e4m3 code;
        # the weight lanes there are left unloaded (any code times 0; NaN codes never ship)
        k_ok = offs_k < K
        if XPF and not PRE:
            xv = xv_next
            nk = offs_k + BK
            xv_next = tl.load(
                x_rows[:, None] + nk[None, :], mask=m_ok[:, None] & (nk < k_end)[None, :], other=0.0
            )
        else:
            xv = tl.load(
                x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
        wq = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :])
        if PRE:
            sx = tl.load(xs_rows + tl.minimum(kb, KB - 1), mask=m_ok, other=1.0)
        if EMU:
            if PRE:
                q = e4m3_bits_to_f32(xv)
            else:
                q, sx = _quantize_rows(w16.widen(xv), EMU)
            wt = e4m3_bits_to_f32(wq)
            if WT:
                part = tl.dot(wt, tl.trans(q), input_precision="ieee")
            else:
                part = tl.dot(q, tl.trans(wt), input_precision="ieee")
        else:
            if PRE:
                q = xv
            else:
                q, sx = _quantize_rows(xv.to(tl.float32), EMU)
            if WT:
                part = tl.dot(wq, tl.trans(q))
            else:
                part = tl.dot(q, tl.trans(wq))
        sw = ue8m0_to_f32(tl.load(s_base + tl.minimum(kb, KB - 1), mask=n_ok, other=127))
        if WT:
            acc += part * (sw[:, None] * sx[None, :])
        else:
            acc += part * (sx[:, None] * sw[None, :])
    if WT:
        acc = tl.trans(acc)
    rel = g * sog + offs_m.to(tl.int64)[:, None] * som + offs_n[None, :]
    sk.store_tile(
        out_ptr,
        red_ptr,
        cnt_ptr,
        pid,
        pid_s,
        rel,
        acc,
        m_ok[:, None] & n_ok[None, :],
        sos,
        OUT_BF16,
        SERIAL,
        SPLITS,
        RED_BF16,
    )


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    xs_ptr,
    R,
    K,
    KB,
    sx,
    sq,
    sxs,
    BR: tl.constexpr,
    BK: tl.constexpr,
    EMU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """x rows [R, K] -> e4m3 codes [R, K] and scales [R, KB] (``quantize_activations``): one
    program per BR rows and K block."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    offs_k = kb * BK + tl.arange(0, BK)
    ok = (rows < R)[:, None] & (offs_k < K)[None, :]
    r64 = rows.to(tl.int64)
    xv = tl.load(x_ptr + r64[:, None] * sx + offs_k[None, :], mask=ok, other=0.0)
    if EMU:
        amax = tl.maximum(tl.max(tl.abs(w16.widen(xv)), axis=1), AMAX_FLOOR)
        e = ceil_log2_div(amax, 0x600000, 8)
        q = f32_to_e4m3_bits(w16.widen(xv) * pow2_f32(-e)[:, None])
        scale = pow2_f32(e)
    else:
        q, scale = _quantize_rows(xv.to(tl.float32), EMU)
    tl.store(q_ptr + r64[:, None] * sq + offs_k[None, :], q, mask=ok)
    tl.store(xs_ptr + r64 * sxs + kb, scale, mask=rows < R)


def quantize(x2: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (codes [R, K] float8_e4m3fn (uint8 in the interpreter), scales [R, KB] fp32)."""
    r, k = x2.shape
    kb = cdiv(k, bk)
    interp = x2.device.type == "cpu"
    q = torch.empty(r, k, dtype=torch.uint8 if interp else torch.float8_e4m3fn, device=x2.device)
    xs = torch.empty(r, kb, dtype=torch.float32, device=x2.device)
    br = min(16, next_pow2(r))
    _quantize_kernel[(cdiv(r, br), kb)](
        x2,
        q,
        xs,
        r,
        k,
        kb,
        x2.stride(0),
        q.stride(0),
        xs.stride(0),
        BR=br,
        BK=bk,
        EMU=interp,
        num_warps=4,
        **pdl_launch(x2.device),
    )
    return q, xs


def supports(a: Fp8LinearArgs) -> bool:
    """This kernel takes the call: a 16- or 32-bit x, a power-of-two scale block of K in
    [32, 256] (the K tile, the smallest e4m3 dot K is 32) and a device with FP8 dots (or the
    interpreter)."""
    dev = a.x.device
    if a.x.dtype == torch.float64 or a.bk not in (32, 64, 128, 256):
        return False
    return dev.type == "cpu" or capabilities(dev).fp8_dot


def _tile(m: int, n: int, g: int, k: int) -> dict:
    """Launch tile by rows. Up to 16 rows: 64-column weight tiles, 3 stages, x quantized in
    the program with its next tile loaded ahead, ``fp8_linear``'s split-K. 17-64 rows: the
    weights that are wide (>= 16K columns in all) or wide and long (>= 4K columns, K >= 4096)
    take x quantized by a launch before, its codes then streaming like the weight, with
    128-column tiles, 4 stages and at most 4 splits; the others as up to 16 rows. Prefill: 64 x
    128 tiles, 4 warps, 4 stages, x quantized before. Each the best measured (evidence:
    docs/tuning.md, W8A8 GEMM)."""
    small = dict(
        block_m=max(16, next_pow2(m)),
        block_n=64,
        wt=True,
        num_warps=4,
        num_stages=3,
        pre=False,
        xpf=True,
        max_split=8,
    )
    if m <= 16:
        return small
    if m <= WT_MAX_ROWS:
        if n * g >= 16384 or (n * g >= 4096 and k >= 4096):
            return dict(small, block_n=128, num_stages=4, pre=True, xpf=False, max_split=4)
        return small
    return dict(
        block_m=64,
        block_n=128,
        wt=False,
        num_warps=4,
        num_stages=4,
        pre=True,
        xpf=False,
        max_split=8,
    )


def launch(
    a: Fp8LinearArgs,
    *,
    block_n: int | None = None,
    block_m: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    wt: bool | None = None,
    serial: bool | None = None,
    pre: bool | None = None,
    xpf: bool | None = None,
    x_scales: torch.Tensor | None = None,
    prefetch: int | None = None,
) -> torch.Tensor:
    """One W8A8 GEMM of checked arguments (``supports(a)``); ``x_scales [M, G, KB]``: ``a.x`` is
    already e4m3 codes with these scales (taken as they lie, no quantizing launch); the other
    keywords are launch knobs for benchmarks and tests (``prefetch``: bytes of each weight row
    asked of L2 before the PDL wait, ``pdl.weight_prefetch``'s setting by default)."""
    m, g, n, k = a.m, a.g, a.n, a.k
    dev = a.x.device
    shape = (m, g, n) if a.grouped else (m, n)
    if m == 0 or n == 0:
        return torch.empty(shape, dtype=a.out_dtype, device=dev)
    if k == 0:
        return torch.zeros(shape, dtype=a.out_dtype, device=dev)
    tile = _tile(m, n, g, k)
    bm = tile["block_m"] if block_m is None else block_m
    bn = tile["block_n"] if block_n is None else block_n
    wt = tile["wt"] if wt is None else wt
    num_warps = tile["num_warps"] if num_warps is None else num_warps
    num_stages = tile["num_stages"] if num_stages is None else num_stages
    pre = tile["pre"] if pre is None else pre
    pre = pre or x_scales is not None
    xpf = tile["xpf"] if xpf is None else xpf
    xv = a.x if a.x.stride(-1) == 1 else a.x.contiguous()
    wb = a.w if a.w.stride(-1) == 1 else a.w.contiguous()
    sc = a.s.contiguous()
    interp = dev.type == "cpu"
    if not interp:
        wb = wb.view(torch.float8_e4m3fn)  # the dot's operand dtype, loaded as it lies
    kb = cdiv(k, a.bk)
    n_mblk = cdiv(m, bm)
    n_nblk = cdiv(n, bn)
    base = n_nblk * g * n_mblk
    if split_k is None:
        split_k = min(tile["max_split"], w16.split_k_for(dev, k, kb, base, n_mblk))
    kps = cdiv(kb, max(1, min(split_k, kb)))
    split_k = cdiv(kb, kps)
    rows = w16.rows_per_launch(m, bm, base // n_mblk * split_k, grid_limit(dev))
    if rows < m:
        kw = dict(
            block_n=bn,
            block_m=bm,
            split_k=split_k,
            num_warps=num_warps,
            num_stages=num_stages,
            wt=wt,
            serial=serial,
            pre=pre,
            xpf=xpf,
            prefetch=prefetch,
        )
        return torch.cat(
            [
                launch(
                    a._replace(m=min(rows, m - r), x=a.x[r : r + rows]),
                    **kw,
                    x_scales=None if x_scales is None else x_scales[r : r + rows],
                )
                for r in range(0, m, rows)
            ]
        )
    if serial is None:
        serial = sk.SERIAL_SPLIT_K and n_mblk == 1 and bm <= sk.SERIAL_MAX_ROWS
    o = sk.SplitOutputs.make(a, split_k, torch.float32, serial, base)
    if x_scales is not None:  # the producer's codes: bytes in the interpreter, e4m3 on a GPU
        xv = xv.view(torch.uint8 if interp else torch.float8_e4m3fn)
        xs = x_scales if x_scales.stride(-1) == 1 else x_scales.contiguous()
    elif pre:
        q, xs = quantize(xv.reshape(m * g, k), a.bk)
        xv, xs = q.view(m, g, k), xs.view(m, g, kb)
    else:
        xs = sc  # never read
    _w8a8_block_linear_kernel[(base, split_k)](
        xv,
        xs,
        wb,
        sc,
        o.out_arg,
        o.red_arg,
        o.cnt_arg,
        m,
        n,
        k,
        kb,
        kps,
        n_nblk,
        n_mblk,
        xv.stride(1),
        xv.stride(0),
        xs.stride(-2),
        xs.stride(0),
        wb.stride(0),
        wb.stride(1),
        sc.stride(0),
        sc.stride(1),
        o.sos,
        o.out.stride(-2),
        o.out.stride(-3),
        SBN=a.bn,
        BM=bm,
        BN=bn,
        BK=a.bk,
        WT=wt,
        EMU=interp,
        PRE=pre,
        XPF=xpf,
        OUT_BF16=o.direct_bf16,
        SERIAL=o.serial,
        SPLITS=o.splits,
        RED_BF16=o.bf16_mode,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(dev),
        **weight_prefetch(dev, prefetch),
    )
    return o.finish(a)
