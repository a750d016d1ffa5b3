"""Triton weight-only FP8 GEMM for small M (decode): y = x @ dequant(W)^T with W in e4m3 and one
power-of-two (ue8m0) scale per 128x128 block, as the DeepSeek V4 checkpoints store it.

    y[m, n] = sum_kb s[n // 128, kb] * sum_{k in block kb} x[m, k] * e4m3(W[n, k])

A program owns ``BN`` output columns of ``BM`` rows (and one group ``g`` of a grouped weight, the
``wo_a`` case) and a contiguous range of 128-wide K blocks. Each K block: one [BM, 128] activation
tile, one [BN, 128] tile of e4m3 bytes converted to bf16 (exact: 3 mantissa bits), a bf16 tensor-core
dot with fp32 accumulation, scaled by the block's scale (exact: power of two) and accumulated in
fp32. Weights are read once per step from HBM as 1 byte per parameter; activations are bf16 (no
activation quantization: W8A16, the same weight bytes as the checkpoint's FP8 x FP8 GEMM).

Small N gets split-K (fp32 partials [S, M, G, N], summed and cast by ``_splitk_sum_kernel``) so
that the grid fills the device. An M = 1 kernel without tensor cores (fp32 multiply-accumulate,
one reduction at the end) was tried on the H200 on 2026-11-29 and was no faster (V4-Flash wq_b 15.6
vs 15.9 us, wo_b 24.9 vs 20.3 us, indexer wq_b 9.5 vs 6.9 us): the weight stream bounds both.

Under the Triton interpreter (CPU) e4m3 is decoded with integer ops and the dot runs in fp32
``ieee`` (the interpreter's bf16 dots are not exact).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.quant import e4m3_bits_to_f32

BLOCK = 128  # the checkpoint's scale block (both dims)


# M (the batch) varies per call: no recompile per batch size for it (strides and N / K stay
# specialized: they give the aligned wide weight loads).
@triton.jit(do_not_specialize=["M", "n_mblk", "sos"])
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr,
                  M, N, K, KB, kb_per_split, n_mblk,
                  sxg, sxm, swg, swn, ssg, ssn, sos, sog, som,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  CVT: tl.constexpr, DOT_F32: tl.constexpr, OUT_BF16: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_gm = tl.program_id(2)
    g = (pid_gm // n_mblk).to(tl.int64)
    mb = pid_gm % n_mblk
    offs_m = mb * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_base = x_ptr + g * sxg + offs_m.to(tl.int64)[:, None] * sxm
    w_base = w_ptr + g * swg + offs_n.to(tl.int64)[:, None] * swn
    s_base = s_ptr + g * ssg + (offs_n // BK).to(tl.int64) * ssn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kb0 = pid_s * kb_per_split
    for i in range(0, kb_per_split):
        kb = kb0 + i
        offs_k = kb * BK + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(x_base + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wq = tl.load(w_base + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if DOT_F32:
            w = e4m3_bits_to_f32(wq)
            part = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            if CVT == 2:    # hardware fp8 -> bf16
                w = wq.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            elif CVT == 1:  # hardware fp8 -> fp32 -> bf16
                w = wq.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
            else:           # integer decode
                w = e4m3_bits_to_f32(wq).to(tl.bfloat16)
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w))
        # past the last K block (uneven split) x and w load as 0: any finite scale will do
        s = tl.load(s_base + tl.minimum(kb, KB - 1), mask=n_ok, other=0.0)
        acc += part * s[None, :]
    out = (out_ptr + pid_s.to(tl.int64) * sos + g * sog + offs_m.to(tl.int64)[:, None] * som
           + offs_n[None, :])
    omask = m_ok[:, None] & n_ok[None, :]
    if OUT_BF16:
        tl.store(out, acc.to(tl.bfloat16), mask=omask)
    else:
        tl.store(out, acc, mask=omask)


@triton.jit
def _splitk_sum_kernel(part_ptr, out_ptr, n_splits, n_elems, stride_s, BLOCK: tl.constexpr):
    """out = sum over the split-K partials [S, ...] (fp32), cast to out's dtype: one launch
    instead of a reduction and a cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elems
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, n_splits):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu"


# e4m3 conversion on GPUs: 2 = hardware fp8 -> bf16, 1 = via fp32, 0 = integer decode. The
# probe (benchmarks.stack.fp8._probe_triton) tries them in that order and keeps the first that
# compiles and matches.
CVT_MODE = {"cvt": 2}


def _auto_block_n(n: int, g: int) -> int:
    # decode sweep (benchmarks/decode_kernels.py, H200): 32-wide column blocks win up to 8192
    # output columns in all (wq_a, wkv, wo_a, indexer wq_b, wo_b), 64 for the wide wq_b
    return 32 if n * g <= 8192 else 64


def _auto_split_k(kb: int, base: int, sms: int) -> int:
    """Split-K for ``base`` (column x group x row) blocks over ``kb`` 128-wide K blocks: enough
    programs to cover the device twice when the blocks alone do not fill it (at most 8-way), and
    at most 16 K blocks per program (long K loops, e.g. wo_b, run better split)."""
    occupancy = 1 if base >= sms else min(8, -(-2 * sms // base))
    return max(1, min(kb, max(-(-kb // 16), occupancy)))


def w8a16_matmul(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, *,
                 block_n: int | None = None, num_warps: int = 4, num_stages: int = 3,
                 split_k: int | None = None, cvt: int | None = None) -> torch.Tensor:
    """x [M, K] with w8 [N, K] / scale [ceil(N/128), ceil(K/128)] -> [M, N];
    or grouped: x [M, G, K] with w8 [G, N, K] / scale [G, ...] -> [M, G, N]. Output in x's dtype
    (bf16 on GPUs). w8: torch.float8_e4m3fn (or its uint8 bytes); scale: fp32 powers of two."""
    grouped = w8.dim() == 3
    if grouped:
        m, g, k = x.shape
        _, n, kw = w8.shape
    else:
        m, k = x.shape
        n, kw = w8.shape
        g = 1
    if kw != k:
        raise ValueError(f"w8a16_matmul: x has K={k}, weight K={kw}")
    dev = x.device
    if x.stride(-1) != 1:
        x = x.contiguous()
    wb = w8.view(torch.uint8) if w8.dtype != torch.uint8 else w8
    if wb.stride(-1) != 1:
        wb = wb.contiguous()
    sc = scale if scale.dtype == torch.float32 else scale.float()
    sc = sc.contiguous()
    kb = triton.cdiv(k, BLOCK)
    bm = min(64, max(16, triton.next_power_of_2(max(m, 1))))
    n_mblk = triton.cdiv(m, bm)
    if block_n is None:
        block_n = _auto_block_n(n, g)
    n_nblk = triton.cdiv(n, block_n)
    base = n_nblk * g * n_mblk
    if split_k is None:
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            split_k = _auto_split_k(kb, base, _sms(index))
        else:
            split_k = 1
    kps = triton.cdiv(kb, split_k)
    split_k = triton.cdiv(kb, kps)
    out_dtype = x.dtype
    if m == 0:
        return x.new_empty((m, g, n) if grouped else (m, n))
    if grouped:
        sxg, sxm = x.stride(1), x.stride(0)
        swg, swn = wb.stride(0), wb.stride(1)
        ssg, ssn = sc.stride(0), sc.stride(1)
    else:
        sxg, sxm = 0, x.stride(0)
        swg, swn = 0, wb.stride(0)
        ssg, ssn = 0, sc.stride(0)
    interp = _interpreting(dev)
    out_bf16 = split_k == 1 and out_dtype == torch.bfloat16 and not interp
    if out_bf16:
        out = torch.empty(m, g, n, dtype=torch.bfloat16, device=dev)
        sos = 0
    else:
        out = torch.empty(split_k, m, g, n, dtype=torch.float32, device=dev)
        sos = out.stride(0)
    som, sog = out.stride(-3), out.stride(-2)
    grid = (n_nblk, split_k, g * n_mblk)
    _w8a16_kernel[grid](
        x, wb, sc, out, m, n, k, kb, kps, n_mblk,
        sxg, sxm, swg, swn, ssg, ssn, sos, sog, som,
        BM=bm, BN=block_n, BK=BLOCK, CVT=(CVT_MODE["cvt"] if cvt is None else cvt)
        if not interp else 0, DOT_F32=interp,
        OUT_BF16=out_bf16, num_warps=num_warps, num_stages=num_stages)
    if not out_bf16:
        if split_k > 1:
            red = torch.empty(out.shape[1:], dtype=out_dtype, device=dev)
            ne = red.numel()
            _splitk_sum_kernel[(triton.cdiv(ne, 1024),)](out, red, split_k, ne, out.stride(0),
                                                          BLOCK=1024, num_warps=4)
            out = red
        else:
            out = (out.sum(0) if split_k > 1 else out[0]).to(out_dtype)
    return out if grouped else out.view(m, n)
