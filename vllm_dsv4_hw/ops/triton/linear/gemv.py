# SPDX-License-Identifier: Apache-2.0
"""Triton ``fp8_block_linear`` (``quantize_x`` or ``x_scales``) for a few rows (decode): a GEMV.

    y[n] = sum_kb s[n // bn, kb] * sx[kb] * sum_{k in block kb} q[k] * e4m3(W[n, k])

the W8A8 products of ``fp8_dot_linear`` (x's e4m3 codes and power-of-two scale per 128-column
block, quantized in the program by its ``_quantize_rows``, or a producer's codes as given),
without tensor cores: a program loads a [BN, BK] tile of weight bytes as plain vector loads,
converts them in registers (the hardware cvt; the integer decode under the interpreter) once
for all its rows (up to ``MAX_ROWS``; a launch specialized on the row count), multiplies by each
row's codes and sums each 128-column block with FMAs (exact products; fp32 sums in the
program's order, so the bits differ from the tensor-core kernel's, deterministically; a row's
bits do not depend on the other rows), scales the block sums and accumulates over its K range.
Split-K as the tile kernels do it (``split_k``: partials summed in split order by each tile's
last split), for grids too small to fill the device.

Why: at one row the tile kernel's wgmma tiles hold a 16-row x tile for 1 live row and its grid
leaves most of each SM's warp slots empty, so a plain GEMV is faster on every projection
(evidence: docs/tuning.md, FP8 GEMV).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops import tuning
from vllm_dsv4_hw.ops.reference.linear import Fp8LinearArgs
from vllm_dsv4_hw.ops.triton.common.launch import capabilities, cdiv, sm_count
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start_prefetching, weight_prefetch
from vllm_dsv4_hw.ops.triton.common.quant import e4m3_bits_to_f32, ue8m0_to_f32
from vllm_dsv4_hw.ops.triton.linear import split_k as sk
from vllm_dsv4_hw.ops.triton.linear.block import widen
from vllm_dsv4_hw.ops.triton.linear.w8a8 import _quantize_rows

# The most rows a launch takes when forced (``fp8_block_linear(gemv=True)``; each row a copy of
# the row loop in the compiled kernel).
LIMIT_ROWS = 8
# Tiles: 16 weight rows a program for wide or deep weights, else 8; 1,024 columns a step for
# narrow weights of 4K <= K < 8K, else 512; split-K only where the tiles leave SMs short.
# The rule reads the shape only: x given as codes sums in the order of x quantized here (the
# same bits, ``fp8_block_linear``'s contract). Evidence: docs/tuning.md, "FP8 GEMV".
TILE = {
    "block_k": 512,
    "long_k": 4096,
    "narrow_n": 8192,
    "block_k_long": 1024,
    "wide_n": 16384,
    "deep_k": 8192,
    "block_n_wide": 16,
    "block_n": 8,
    "num_warps": 4,
    "num_stages": 3,
    "split_below_per_sm": 4,
    "programs_per_sm": 12,
    "max_split": 4,
    "min_split_steps": 3,
}


def tile(n_out: int, k: int) -> tuple[int, int]:
    """(weight rows, weight columns) a program takes a step, for ``n_out`` outputs (N x G) over
    ``k`` columns (``TILE``'s rule)."""
    wide = n_out >= TILE["wide_n"] or k >= TILE["deep_k"]
    long = not wide and n_out <= TILE["narrow_n"] and k >= TILE["long_k"]
    return (
        TILE["block_n_wide"] if wide else TILE["block_n"],
        TILE["block_k_long"] if long else TILE["block_k"],
    )


@triton.jit
def _x_codes(x_ptr, xs_ptr, k0, K, KB, EMU: tl.constexpr, CODES: tl.constexpr, BK: tl.constexpr):
    """One row's columns ``k0 + [0, BK)`` as W8A8 operands: (codes as fp32 [BK/128, 128],
    scales [BK/128]); quantized per 128-column block by the W8A8 kernel's own
    ``_quantize_rows`` (each block a row), or with CODES read as the producer left them (e4m3
    bytes at ``x_ptr``, fp32 scales at ``xs_ptr``). Columns past K: code 0."""
    cols = k0 + tl.arange(0, BK)
    if CODES:
        qb = tl.load(x_ptr + cols, mask=cols < K, other=0)
        qb = tl.reshape(qb, (BK // 128, 128))
        if EMU:
            q = e4m3_bits_to_f32(qb)
        else:
            q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        kb = k0 // 128 + tl.arange(0, BK // 128)
        return q, tl.load(xs_ptr + kb, mask=kb < KB, other=0.0)
    xv = widen(tl.load(x_ptr + cols, mask=cols < K, other=0.0))
    q, sx = _quantize_rows(tl.reshape(xv, (BK // 128, 128)), EMU)
    return q.to(tl.float32), sx


@triton.jit
def _w_tile(w_rows, r_ok, k0, k_hi, BK: tl.constexpr):
    """The weight bytes [BN, BK] of columns k0 + [0, BK) (0 past this split's end ``k_hi``)."""
    cols = k0 + tl.arange(0, BK)
    return tl.load(
        w_rows[:, None] + cols[None, :], mask=r_ok[:, None] & (cols < k_hi)[None, :], other=0
    )


@triton.jit(do_not_specialize=["sos"])
def _gemv_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    red_ptr,
    cnt_ptr,
    N,
    K,
    KB,
    k_per_split,
    n_nblk,
    sxm,
    sxg,
    sxsm,
    sxsg,
    swg,
    swn,
    ssg,
    ssn,
    sos,
    som,
    sog,
    SBN: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    M: tl.constexpr,
    RP: tl.constexpr,
    CODES: tl.constexpr,
    EMU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SERIAL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_BF16: tl.constexpr,
    PF_BYTES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    # M rows (RP: M's power of two), each multiplied with the tile's weight bytes converted
    # once; a row's sums are those of a one-row launch (the same ops in the same order).
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_n = pid % n_nblk
    g = (pid // n_nblk).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    r_ok = rows < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + g * swg + rows.to(tl.int64) * swn
    # the weight's first bytes of this split ask L2 before the wait (rows past N: none)
    pdl_start_prefetching(PDL, PF_BYTES, w_rows + k_lo, tl.where(r_ok, K - k_lo, 0))
    s_rows = s_ptr + g * ssg + (rows // SBN).to(tl.int64) * ssn
    xm = tl.arange(0, RP)
    acc = tl.zeros([RP, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        wq = _w_tile(w_rows, r_ok, k0, k_hi, BK)
        if EMU:
            wf = e4m3_bits_to_f32(wq)
        else:
            wf = wq.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        kb = tl.minimum(k0 // 128 + tl.arange(0, BK // 128), KB - 1)  # past K: w = 0, any scale
        wf = tl.reshape(wf, (BN, BK // 128, 128))
        sw = ue8m0_to_f32(tl.load(s_rows[:, None] + kb[None, :], mask=r_ok[:, None], other=127))
        for r in tl.static_range(M):
            q, sx = _x_codes(
                x_ptr + r * sxm + g * sxg, xs_ptr + r * sxsm + g * sxsg, k0, K, KB, EMU, CODES, BK
            )
            blk = tl.sum(wf * q[None, :, :], axis=2)
            part = tl.sum(blk * sw * sx[None, :], axis=1)
            acc = tl.where(xm[:, None] == r, acc + part[None, :], acc)
    rel = g * sog + xm[:, None].to(tl.int64) * som + rows[None, :]
    sk.store_tile(
        out_ptr,
        red_ptr,
        cnt_ptr,
        pid,
        pid_s,
        rel,
        acc,
        (xm < M)[:, None] & r_ok[None, :],
        sos,
        OUT_BF16,
        SERIAL,
        SPLITS,
        RED_BF16,
    )


def takes(a: Fp8LinearArgs, max_rows: int | None = None, codes: bool = False) -> bool:
    """This kernel takes the call: 1 to ``LinearTuning.gemv_max_rows`` (or ``max_rows``) rows of a 16- or 32-bit
    x (``codes``: e4m3 codes with their scales), K blocks of 128 columns (the quantization block
    of the W8A8 products), on a CUDA device with FP8 dots (where ``fp8_block_linear`` quantizes x
    anyway) or the interpreter."""
    dev = a.x.device
    rows = tuning.current().linear.gemv_max_rows if max_rows is None else max_rows
    x_ok = codes or a.x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not 1 <= a.m <= min(rows, LIMIT_ROWS) or a.bk != 128 or not x_ok:
        return False
    if dev.type == "cpu":
        return True
    return dev.type == "cuda" and capabilities(dev).fp8_dot


def _split(n_tiles: int, k_steps: int, device: torch.device) -> int:
    """K splits where the tiles alone leave SMs short (fewer than ``split_below_per_sm`` a SM):
    enough for ~``programs_per_sm`` programs per SM, at most ``max_split`` and one BK step each;
    none over fewer than ``min_split_steps`` steps, none off CUDA."""
    if device.type != "cuda" or k_steps < TILE["min_split_steps"]:
        return 1
    sms = sm_count(device)
    if n_tiles >= TILE["split_below_per_sm"] * sms:
        return 1
    want = cdiv(TILE["programs_per_sm"] * sms, n_tiles)
    return max(1, min(want, TILE["max_split"], k_steps))


def launch(
    a: Fp8LinearArgs,
    *,
    x_scales: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    serial: bool | None = None,
    prefetch: int | None = None,
) -> torch.Tensor:
    """One GEMV of checked arguments (``takes(a)``); ``x_scales`` [M, G, ceil(K/128)]: ``a.x``
    holds e4m3 codes with these scales (a producer's quantization), read as they lie. The
    keywords after it are launch knobs for benchmarks and tests."""
    m, g, n, k = a.m, a.g, a.n, a.k
    dev = a.x.device
    shape = (m, g, n) if a.grouped else (m, n)
    if n == 0:
        return torch.empty(shape, dtype=a.out_dtype, device=dev)
    interp = dev.type == "cpu"
    rule_bn, rule_bk = tile(n * g, k)
    # the interpreter pays per program, not per element: wide row blocks there
    bn = block_n or (64 if interp else rule_bn)
    bk = block_k or rule_bk
    if bk % 128 or bk & (bk - 1):
        raise ValueError(f"fp8 GEMV: block_k must be a power of two multiple of 128, got {bk}")
    n_nblk = cdiv(n, bn)
    tiles = n_nblk * g
    steps = cdiv(k, bk)
    splits = _split(tiles, steps, dev) if split_k is None else max(1, min(split_k, steps))
    kps = cdiv(steps, splits) * bk
    splits = cdiv(k, kps)
    if serial is None:
        serial = sk.SERIAL_SPLIT_K
    o = sk.SplitOutputs.make(a, splits, torch.float32, serial, tiles)
    xv = a.x if a.x.stride(-1) == 1 else a.x.contiguous()
    if x_scales is not None:
        xv = xv.view(torch.uint8)
        xs = x_scales.contiguous()
    else:
        xs = xv  # not read
    wb = a.w if a.w.stride(-1) == 1 else a.w.contiguous()
    sc = a.s.contiguous()
    w8 = wb.view(torch.uint8)
    _gemv_kernel[(tiles, splits)](
        xv,
        xs,
        w8,
        sc,
        o.out_arg,
        o.red_arg,
        o.cnt_arg,
        n,
        k,
        cdiv(k, 128),
        kps,
        n_nblk,
        xv.stride(0),
        xv.stride(1),
        xs.stride(0),
        xs.stride(1),
        w8.stride(0),
        w8.stride(1),
        sc.stride(0),
        sc.stride(1),
        o.sos,
        o.out.stride(-3),
        o.out.stride(-2),
        SBN=a.bn,
        BN=bn,
        BK=bk,
        M=m,
        RP=triton.next_power_of_2(m),
        CODES=x_scales is not None,
        EMU=interp,
        OUT_BF16=o.direct_bf16,
        SERIAL=o.serial,
        SPLITS=o.splits,
        RED_BF16=o.bf16_mode,
        num_warps=num_warps or TILE["num_warps"],
        num_stages=num_stages or TILE["num_stages"],
        **pdl_launch(dev),
        **weight_prefetch(dev, prefetch),
    )
    return o.finish(a)
