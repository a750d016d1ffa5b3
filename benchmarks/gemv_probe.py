"""How fast can one decode row stream an FP8 weight? A probe, not a product path.

    python -m benchmarks.gemv_probe [--out DIR]      # CUDA GPU; prints a table, writes JSON

Why: at batch 1 every FP8 linear of the decode step (``fp8_block_linear``, W8A8 tensor-core
tiles) pays ~4 us over its weight bytes / HBM rate (wq_b 12.0 us on the H200 for a 7.8 us
floor), and Nsight Compute on an H100 (2026-12-06) put those launches at 16-24% achieved
occupancy and 55-62% of DRAM throughput. This probe times a plain GEMV on the same shipped
weights (e4m3 bytes + ue8m0 scales per 128 x 128 block, bf16 x): each program loads a [BN, BK]
tile of weight bytes as plain vector loads, converts them in registers and reduces with FMAs (no
tensor cores), over K in BK steps, split over K with fp32 atomics where the grid would be small
(nondeterministic order: fine for timing, why it is not the product's path). If it streams near
the HBM rate where the product's kernel does not, a GEMV path for M <= 4 is worth building (with
the product's exact-order split-K sum); if not, the gap is elsewhere (launch, PDL chain).
Every config is checked against the product's ``fp8_block_linear`` (W8A16, same bf16 x) to 1e-2
relative before it is timed. Times: CUDA-graph medians (``sweep_common.graph_us``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

from benchmarks.sweep_common import HBM, _f, graph_us
from vllm_dsv4_hw.ops.triton.quant import e4m3_bits_to_f32


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, KB, k_per_split,
                 BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr,
                 HW_CVT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    r_ok = rows < N
    acc = tl.zeros([BN], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BK):
        cols = k0 + tl.arange(0, BK)
        c_ok = cols < K
        wq = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                     mask=r_ok[:, None] & c_ok[None, :], other=0)
        if HW_CVT:
            wf = wq.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # the interpreter (CPU check of the probe itself)
            wf = e4m3_bits_to_f32(wq)
        xv = tl.load(x_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
        blk = tl.sum(tl.reshape(wf * xv[None, :], (BN, BK // 128, 128)), axis=2)
        kb = k0 // 128 + tl.arange(0, BK // 128)
        sb = tl.load(s_ptr + (rows // 128).to(tl.int64)[:, None] * KB + kb[None, :],
                     mask=r_ok[:, None] & (kb < KB)[None, :], other=127).to(tl.int32)
        acc += tl.sum(blk * (sb << 23).to(tl.float32, bitcast=True), axis=1)
    if ATOMIC:
        tl.atomic_add(y_ptr + rows, acc, mask=r_ok, sem="relaxed")
    else:
        tl.store(y_ptr + rows, acc, mask=r_ok)


def gemv(x, w, s, y, bn: int, bk: int, split: int, num_warps: int) -> None:
    """y [N] fp32 (+)= dequant(w) @ x; split > 1 adds with atomics (y zeroed by the caller)."""
    n, k = w.shape
    kb = s.shape[1]
    k_per_split = math.ceil(math.ceil(k / split) / bk) * bk
    grid = (triton.cdiv(n, bn), triton.cdiv(k, k_per_split))
    _gemv_kernel[grid](x, w, s, y, n, k, kb, k_per_split, BN=bn, BK=bk, ATOMIC=split > 1,
                       HW_CVT=x.device.type == "cuda", num_warps=num_warps)


CONFIGS = ((16, 512, 1, 4), (8, 1024, 1, 4), (16, 1024, 1, 8), (32, 512, 1, 8), (4, 1024, 1, 4),
           (16, 512, 2, 4), (16, 512, 4, 4), (8, 1024, 4, 4), (4, 2048, 4, 8), (8, 512, 8, 4))


def product_check(dev) -> list[dict]:
    """The product's one-row GEMV (``fp8_gemv``, ``gemv=True``) against its W8A8 tiles on every
    projection: relative error, the same bits on a second call, and both timed."""
    from benchmarks.gemm_sweeps import GEMM_SHAPES, _shipped_weights
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    rows = []
    for name, (g, n, k) in GEMM_SHAPES.items():
        ws = _shipped_weights(dev, g, n, k, 2)
        x = torch.randn((1, g, k) if g > 1 else (1, k), device=dev, dtype=torch.bfloat16)
        tile = fp8_block_linear(x, *ws[0], (128, 128), torch.float32, True, gemv=False)
        got = fp8_block_linear(x, *ws[0], (128, 128), torch.float32, True, gemv=True)
        same = torch.equal(got, fp8_block_linear(x, *ws[0], (128, 128), torch.float32, True,
                                                 gemv=True))
        err = float((got - tile).abs().max() / tile.abs().max())
        res = {"tiles": graph_us(lambda i: fp8_block_linear(x, *ws[i], (128, 128), None, True,
                                                            gemv=False), 2),
               "gemv": graph_us(lambda i: fp8_block_linear(x, *ws[i], (128, 128), None, True,
                                                           gemv=True), 2)}
        print(f"gemv_check {name:14s} rel err vs tiles {err:.1e} same bits twice {same} us "
              f"tiles {res['tiles']:.2f} gemv {res['gemv']:.2f}", flush=True)
        rows.append({"shape": f"{name} M=1", "rel_err": err, "same_bits": same, "us": res})
        del ws
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    from benchmarks.gemm_sweeps import GEMM_SHAPES, _shipped_weights
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", default=None, help="comma-separated GEMM_SHAPES names")
    ap.add_argument("--product-check", action="store_true",
                    help="the product's GEMV (fp8_gemv) against its tiles instead of the probe")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_probe needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.product_check:
        rows = product_check(dev)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemv_check.json"), "w") as f:
            json.dump({"schema": "gemv_check/1", "machine": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)
        return 0
    rows = []
    names = args.only.split(",") if args.only else [n for n, (g, _, _) in GEMM_SHAPES.items()
                                                     if g == 1]
    for name in names:
        g, n, k = GEMM_SHAPES[name]
        n_sets = max(2, min(6, math.ceil(200e6 / (n * k))))
        ws = _shipped_weights(dev, 1, n, k, n_sets)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        floor = (n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4) / HBM * 1e6
        res = {"product w8a16": graph_us(lambda i: fp8_block_linear(x, *ws[i], (128, 128)),
                                         n_sets),
               "product w8a8": graph_us(lambda i: fp8_block_linear(
                   x, *ws[i], (128, 128), quantize_x=True), n_sets)}
        want = fp8_block_linear(x, *ws[0], (128, 128)).float()[0]
        ys = [torch.zeros(n, device=dev, dtype=torch.float32) for _ in range(n_sets)]
        for bn, bk, split, nw in CONFIGS:
            key = f"gemv bn={bn} bk={bk} split={split} warps={nw}"
            s8 = [w[1].view(torch.uint8) for w in ws]
            w8 = [w[0].view(torch.uint8) for w in ws]
            try:
                ys[0].zero_()
                gemv(x[0], w8[0], s8[0], ys[0], bn, bk, split, nw)
                err = float((ys[0] - want).abs().max() / want.abs().max())
                if err > 1e-2:
                    res[key] = f"wrong: rel err {err:.1e}"
                    continue
                res[key] = graph_us(lambda i, c=(bn, bk, split, nw): gemv(
                    x[0], w8[i], s8[i], ys[i], *c), n_sets)
            except Exception as exc:  # out of resources at this tile
                torch.cuda.synchronize()
                res[key] = f"{type(exc).__name__}: {str(exc)[:80]}"
        ok = {kk: v for kk, v in res.items() if isinstance(v, float)}
        best = min((kk for kk in ok if kk.startswith("gemv")), key=ok.get, default=None)
        print(f"{name:14s} floor {floor:6.2f}  w8a16 {_f(res['product w8a16'])}  w8a8 "
              f"{_f(res['product w8a8'])}  best gemv {_f(ok.get(best))}  {best}", flush=True)
        rows.append({"shape": f"{name} M=1", "floor_us": floor, "configs": res, "best": best})
        del ws, ys
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv_probe.json"), "w") as f:
        json.dump({"schema": "gemv_probe/1", "machine": torch.cuda.get_device_name(),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                       timespec="seconds"),
                   "command": "python -m benchmarks.gemv_probe " + " ".join(
                       sys.argv[1:] if argv is None else argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
