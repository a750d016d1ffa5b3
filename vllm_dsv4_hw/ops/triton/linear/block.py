# SPDX-License-Identifier: Apache-2.0
"""Triton ``fp8_block_linear``: y = x @ dequant(W)^T with W in e4m3 and one ue8m0 scale byte per
``bn x bk`` block, read as the checkpoint ships them (1 byte per parameter, no dequantized copy).

    y[m, n] = sum_kb s[n // bn, kb] * sum_{k in block kb} x[m, k] * e4m3(W[n, k])

Grown from the W8A16 decode GEMM of ``benchmarks/stack/w8a16.py`` (its launch heuristics were
measured there and are kept; evidence: docs/tuning.md, FP8 GEMM column block). A program owns
``BM`` rows x ``BN`` output columns (of one group ``g`` of a grouped weight, the ``wo_a`` case) and
a contiguous range of K blocks. Per K block: one [BM, BK] activation tile, one [BN, BK] tile of
e4m3 bytes converted in registers to x's 16-bit dtype (exact: 3 mantissa bits), a tensor-core dot
with fp32 accumulation, multiplied by the block's scale (decoded from its byte: a power of two,
exact, so any byte 0..254 works as long as the result is representable) and accumulated. The K tile
is ``bk`` rounded up to a power of two >= 16 (extra lanes masked); ``bn`` only picks each column's
scale row, so any block works. fp32 x runs an fp32 ``ieee`` dot. Any M: the grid covers
ceil(M / BM) row tiles (BM <= 64; from 2048 rows of a weight with >= 1024 columns, where the
device's shared memory holds it, the ``PREFILL_TILE``: 128 x 256 with the block scale folded into
the converted weight tile, so the dot accumulates in place, ``FOLD``). Small grids get split-K
(partials [S, M, G, N] in the accumulator dtype, summed and cast inside the launch or by a second
one: ``split_k``); with more than one row tile, only while the grid does not fill the device
(partials cost S * M * N * 4 bytes). float64 x (the exact test path) takes rank-1 float64 updates
instead of a dot.

The e4m3 conversion follows the device's declared capabilities (``platform.device``): fp8 ->
hardware cvt; no fp8 (sm_80 / sm_86, where Triton rejects fp8e4nv; Ascend) -> the bit-exact integer
decode of ``quant.e4m3_bits_to_f32``. Under the Triton interpreter (CPU tensors) the integer decode
and an fp32 ``ieee`` dot are used (the interpreter's bf16 arithmetic is not exact), bf16 x is
widened from its bits (the interpreter's bf16 -> fp32 conversion flushes or garbles subnormals) and
bf16 results are rounded in fp32 first (its own fp32 -> bf16 conversion truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.reference.linear import Fp8LinearArgs
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, grid_limit, next_pow2, sm_count
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start_prefetching, weight_prefetch
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import (
    C_CVT_HW,
    C_CVT_PTX,
    e4m3_bits_to_16bit,
    e4m3_mode,
)
from vllm_dsv4_hw.ops.triton.common.quant import bf16_bits_to_f32, e4m3_bits_to_f32, ue8m0_to_f32
from vllm_dsv4_hw.ops.triton.linear.split_k import (
    SERIAL_MAX_ROWS,
    SERIAL_SPLIT_K,
    SplitOutputs,
    store_tile,
)
from vllm_dsv4_hw.platform.device import adaptor_for

# MATH (constexpr): the dot's input dtype
MATH_X16 = 0  # x's own 16-bit dtype (bf16 / fp16), fp32 accumulation: tensor cores
MATH_F32 = 1  # fp32 ieee (fp32 x; every 16-bit x under the interpreter)
MATH_F64 = 2  # float64 (float64 x)
_C_X16 = tl.constexpr(MATH_X16)
_C_F32 = tl.constexpr(MATH_F32)
_C_F64 = tl.constexpr(MATH_F64)


@triton.jit
def _e4m3_tile(wq, DT: tl.constexpr, CVT: tl.constexpr):
    """e4m3 bytes -> values of dtype DT (exact): packed PTX decode, hardware cvt or integer
    decode (``ptx_codecs.e4m3_mode``)."""
    if CVT == C_CVT_PTX:
        # fp32 x: the exact bf16 values widened (a shift)
        return e4m3_bits_to_16bit(wq, tl.float16 if DT == tl.float16 else tl.bfloat16).to(DT)
    elif CVT == C_CVT_HW:
        return wq.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        return e4m3_bits_to_f32(wq).to(DT)


@triton.jit
def widen(x):
    """x as fp32; bf16 from its bits (the interpreter's conversion garbles subnormals)."""
    if x.dtype == tl.bfloat16:
        return bf16_bits_to_f32(x.to(tl.uint16, bitcast=True))
    else:
        return x.to(tl.float32)


# M (the batch) varies per call: no recompile per batch size for it (strides and N / K stay
# specialized: they give the aligned wide weight loads).
@triton.jit(do_not_specialize=["M", "n_mblk", "sos"])
def _fp8_block_linear_kernel(
    x_ptr,
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
    swg,
    swn,
    ssg,
    ssn,
    sos,
    sog,
    som,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    MATH: tl.constexpr,
    CVT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    FOLD: tl.constexpr,
    SERIAL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_BF16: tl.constexpr,
    W16: tl.constexpr,
    PF_BYTES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    # W16: the weight is already x's 16-bit float dtype (``ops.dense_linear``): no decode, no
    # scales (s_ptr is never read), the FOLD path's accumulating dot
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
    pdl_start_prefetching(
        PDL, PF_BYTES, w_rows + kb0 * SBK, tl.where(n_ok, (K - kb0 * SBK) * (2 if W16 else 1), 0)
    )
    x_rows = x_ptr + g * sxg + offs_m.to(tl.int64) * sxm
    s_base = s_ptr + g * ssg + (offs_n // SBN).to(tl.int64) * ssn  # each column's scale row
    if MATH == _C_F64:
        acc = tl.zeros((BM, BN), dtype=tl.float64)
    elif FOLD == 2:
        acc = tl.zeros((BN, BM), dtype=tl.float32)  # y^T: the weight tile is the dot's A
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, kb_per_split):
        kb = kb0 + i
        if FOLD != 0:
            # 16-bit tensor cores, the block's power-of-two scale folded into the weight tile
            # (exact while scale * e4m3 stays a normal bf16 / fp16), accumulated in the dot
            lane = tl.arange(0, BK)
            offs_k = kb * SBK + lane
            k_ok = offs_k < K
            if BK != SBK:
                k_ok = k_ok & (lane < SBK)
            x = tl.load(
                x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            wq = tl.load(
                w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
            )
            if MATH == _C_X16:
                dt = x_ptr.dtype.element_ty
                if W16:
                    wt = wq
                else:
                    sb = tl.load(s_base + tl.minimum(kb, KB - 1), mask=n_ok, other=127)
                    wt = _e4m3_tile(wq, dt, CVT) * ue8m0_to_f32(sb).to(dt)[:, None]
                if FOLD == 2:
                    acc = tl.dot(wt, tl.trans(x), acc)
                else:
                    acc = tl.dot(x, tl.trans(wt), acc)
            else:
                xf = widen(x)
                if W16:
                    wt = widen(wq)
                else:
                    sb = tl.load(s_base + tl.minimum(kb, KB - 1), mask=n_ok, other=127)
                    wt = _e4m3_tile(wq, tl.float32, CVT) * ue8m0_to_f32(sb)[:, None]
                if FOLD == 2:
                    acc = tl.dot(wt, tl.trans(xf), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xf, tl.trans(wt), acc, input_precision="ieee")
        elif MATH == _C_F64:
            # float64 (the exact test path): rank-1 updates, no tl.dot (Triton 3.6 fails to lower
            # a float64 dot for sm_90). Vector indices: the interpreter mis-types vector & scalar.
            part = tl.zeros((BM, BN), dtype=tl.float64)
            for kk in range(0, SBK):
                km = offs_m * 0 + (kb * SBK + kk)
                kn = offs_n * 0 + (kb * SBK + kk)
                xk = tl.load(x_rows + km, mask=m_ok & (km < K), other=0.0).to(tl.float64)
                wk = tl.load(w_rows + kn, mask=n_ok & (kn < K), other=0)
                if W16:
                    part += xk[:, None] * widen(wk).to(tl.float64)[None, :]
                else:
                    part += xk[:, None] * e4m3_bits_to_f32(wk).to(tl.float64)[None, :]
        else:
            lane = tl.arange(0, BK)
            offs_k = kb * SBK + lane
            k_ok = offs_k < K
            if BK != SBK:  # the K tile is the scale block rounded up to a power of two
                k_ok = k_ok & (lane < SBK)
            x = tl.load(
                x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            wq = tl.load(
                w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
            )
            if MATH == _C_X16:
                wt = wq if W16 else _e4m3_tile(wq, x_ptr.dtype.element_ty, CVT)
                part = tl.dot(x, tl.trans(wt))
            else:
                wt = widen(wq) if W16 else _e4m3_tile(wq, tl.float32, CVT)
                part = tl.dot(widen(x), tl.trans(wt), input_precision="ieee")
        if FOLD == 0:
            if W16:
                acc += part
            else:
                # past the last K block (uneven split) x and w load as 0: any finite scale will do
                sb = tl.load(s_base + tl.minimum(kb, KB - 1), mask=n_ok, other=127)
                acc += part * ue8m0_to_f32(sb).to(acc.dtype)[None, :]
    if FOLD == 2:
        acc = tl.trans(acc)
    rel = g * sog + offs_m.to(tl.int64)[:, None] * som + offs_n[None, :]
    store_tile(
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


def _auto_block_n(n: int, g: int, m: int = 1, k: int = 0) -> int:
    """Column block below the prefill tile: 32-wide column blocks win up to 8192 output
    columns in all at M <= 16, 64 for wider weights; from M = 17 (32-row tiles) 64 also wins on
    the long-K weights (K >= 4096, at least 1024 columns) (evidence: docs/tuning.md, FP8 GEMM
    column block)."""
    if n * g > 8192 or (m > 16 and k >= 4096 and n * g >= 1024):
        return 64
    return 32


# Prefill tile (from PREFILL_TILE["from_m"] rows): 128 x 256 blocks, 8 warps, 3 stages, the scale
# folded into the weight tile: faster than the smaller tiles at prefill (evidence:
# docs/tuning.md, FP8 GEMM prefill tile). Only for weights of >= 1024 columns (the measured ones;
# a 256-wide tile leaves a narrow weight's device mostly idle). The tile needs 224 KiB of shared
# memory (sm_90's pipelined compile): only where the device declares that much (sm_90 / sm_100),
# and in the interpreter.
PREFILL_TILE = {
    "from_m": 2048,
    "from_n": 1024,
    "block_m": 128,
    "block_n": 256,
    "num_warps": 8,
    "num_stages": 3,
    "fold": 1,
}
PREFILL_TILE_SHARED = 224 * 1024


def _prefill_tile(m: int, n: int, device: torch.device) -> dict:
    if m < PREFILL_TILE["from_m"] or n < PREFILL_TILE["from_n"]:
        return {}
    if device.type == "cpu":
        return PREFILL_TILE
    if adaptor_for(device.type).capabilities.shared_mem < PREFILL_TILE_SHARED:
        return {}
    return PREFILL_TILE


def _auto_split_k(kb: int, base: int, sms: int) -> int:
    """Split-K for ``base`` (column x group x row) blocks over ``kb`` 128-wide K blocks: enough
    programs to cover the device twice when the blocks alone do not fill it (at most 8-way), and
    at most 16 K blocks per program (long K loops, e.g. wo_b, run better split)."""
    occupancy = 1 if base >= sms else min(8, -(-2 * sms // base))
    return max(1, min(kb, max(-(-kb // 16), occupancy)))


def split_k_for(device: torch.device, k: int, kb: int, base: int, n_mblk: int) -> int:
    """Split-K of a launch: the measured decode rule (in 128-wide K units, so 32x32 blocks split
    as 128x128 ones do), clamped to the K blocks; none off CUDA, and none for multi-tile M once
    the grid fills the device (prefill: the split was not measured there; partials grow with M)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    if n_mblk > 1 and base >= sms:
        return 1
    return max(1, min(kb, _auto_split_k(cdiv(k, 128), base, sms)))


def rows_per_launch(m: int, bm: int, programs_per_row_block: int, limit: int) -> int:
    """Rows one launch may cover so that its grid stays within ``limit`` programs (all ``m`` on
    CUDA, whose bound is never reached); whole row blocks of ``bm``."""
    blocks = limit // programs_per_row_block
    if blocks < 1:
        raise ValueError(
            f"fp8_block_linear: {programs_per_row_block} programs per row block exceed "
            f"the device's grid bound {limit}; use a larger block_n"
        )
    return min(m, blocks * bm)


def k_tile(bk: int) -> int:
    """The kernel's K tile for scale blocks of ``bk`` columns: a power of two >= 16 (tl.dot)."""
    return max(16, next_pow2(bk))


# FOLD (constexpr): how a K block's scale is applied. 0: a dot per block, scaled and added to the
# accumulator (decode: measured fastest up to 32 rows); 1: folded into the weight tile, the dot
# accumulates (the prefill tile); 2: as 1 with the weight tile as the dot's A operand (y^T = W
# x^T; measured, never ahead). float64 x always takes 0 (rank-1 updates).
FOLD_NONE, FOLD_W, FOLD_WT = 0, 1, 2


def _fold(math: int, forced: int | None) -> int:
    return FOLD_NONE if math == MATH_F64 or forced is None else forced


def _math(dtype: torch.dtype, interpreting: bool) -> int:
    if dtype == torch.float64:
        return MATH_F64
    if dtype == torch.float32 or interpreting:
        return MATH_F32
    return MATH_X16


def launch(
    a: Fp8LinearArgs,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_m: int | None = None,
    fold: int | None = None,
    cvt: int | None = None,
    serial: bool | None = None,
    w16: bool = False,
    prefetch: int | None = None,
) -> torch.Tensor:
    """One GEMM of checked arguments: column block, forced split-K, launch options, the e4m3
    decode, the split-K sum and the weight read-ahead (``prefetch``, as in
    ``fp8_dot_linear.launch``) as knobs. ``w16``: ``a.w`` is x's 16-bit float dtype, not e4m3
    bytes (``ops.triton.dense_linear``; ``a.s`` is then never read)."""
    m, g, n, k = a.m, a.g, a.n, a.k
    dev = a.x.device
    shape = (m, g, n) if a.grouped else (m, n)
    if m == 0 or n == 0:
        return torch.empty(shape, dtype=a.out_dtype, device=dev)
    if k == 0:
        return torch.zeros(shape, dtype=a.out_dtype, device=dev)
    xv = a.x if a.x.stride(-1) == 1 else a.x.contiguous()
    wb = a.w if a.w.stride(-1) == 1 else a.w.contiguous()
    sc = a.s.contiguous()
    interp = dev.type == "cpu"
    math = _math(a.x.dtype, interp)
    # the e4m3 decode the device declares (the integer one in the interpreter)
    cvt = e4m3_mode(dev) if cvt is None else cvt
    kb = cdiv(k, a.bk)
    bk_tile = k_tile(a.bk)
    tile = _prefill_tile(m, n, dev) if block_m is None and block_n is None else {}
    if block_m is None:
        block_m = tile.get("block_m", min(64, max(16, next_pow2(m))))
    bm = block_m
    n_mblk = cdiv(m, bm)
    bn_tile = (tile.get("block_n") or _auto_block_n(n, g, m, k)) if block_n is None else block_n
    num_warps = tile.get("num_warps", 4) if num_warps is None else num_warps
    num_stages = tile.get("num_stages", 3) if num_stages is None else num_stages
    fold = tile.get("fold", FOLD_W if w16 else None) if fold is None else fold
    n_nblk = cdiv(n, bn_tile)
    base = n_nblk * g * n_mblk
    if split_k is None:
        split_k = split_k_for(dev, k, kb, base, n_mblk)
    kps = cdiv(kb, max(1, min(split_k, kb)))
    split_k = cdiv(kb, kps)
    rows = rows_per_launch(m, bm, base // n_mblk * split_k, grid_limit(dev))
    if rows < m:  # a grid over the device's bound (Ascend, long prefill): launches of fewer rows
        kw = dict(
            block_n=bn_tile,
            split_k=split_k,
            num_warps=num_warps,
            num_stages=num_stages,
            block_m=bm,
            fold=fold,
            cvt=cvt,
            serial=serial,
            w16=w16,
            prefetch=prefetch,
        )
        return torch.cat(
            [
                launch(a._replace(m=min(rows, m - r), x=a.x[r : r + rows]), **kw)
                for r in range(0, m, rows)
            ]
        )
    if serial is None:
        serial = SERIAL_SPLIT_K and n_mblk == 1 and bm <= SERIAL_MAX_ROWS
    o = SplitOutputs.make(
        a, split_k, torch.float64 if math == MATH_F64 else torch.float32, serial, base
    )
    _fp8_block_linear_kernel[(base, split_k)](
        xv,
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
        wb.stride(0),
        wb.stride(1),
        sc.stride(0),
        sc.stride(1),
        o.sos,
        o.out.stride(-2),
        o.out.stride(-3),
        SBN=a.bn,
        SBK=a.bk,
        BM=bm,
        BN=bn_tile,
        BK=bk_tile,
        MATH=math,
        CVT=cvt,
        OUT_BF16=o.direct_bf16,
        FOLD=_fold(math, fold),
        SERIAL=o.serial,
        SPLITS=o.splits,
        RED_BF16=o.bf16_mode,
        W16=w16,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(dev),
        **weight_prefetch(dev, prefetch),
    )
    return o.finish(a)
