"""The one-row GEMV of the FP8 linears (``ops.triton.fp8_gemv``): its tiles and splits against
the W8A8 tile kernels on the decode step's weights, and the product check.

    python -m benchmarks.gemv_probe [--out DIR]                  # tile sweep (CUDA GPU)
    python -m benchmarks.gemv_probe --product-check [--out DIR]  # the default GEMV vs the tiles

Why: at batch 1 every FP8 linear of the decode step paid ~4 us over its weight bytes / HBM rate
with the W8A8 tensor-core tiles (wq_b 12.0 us on the H200 for a 7.8 us floor); Nsight Compute on
an H100 (2026-12-06) put those launches at 16-24% achieved occupancy and 55-62% of DRAM
throughput. The first form of this file (commit 2ef58d6) timed a GEMV of its own (split-K by
fp32 atomics) to see what plain vector loads reach; the product's ``fp8_gemv`` was built from
it, and this file now sweeps that kernel's launch knobs (``block_n``, ``block_k``, ``split_k``,
``num_warps``) on the product's own call, each config checked against the tile kernels first.
Times: CUDA-graph medians (``sweep_common.graph_us``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

from benchmarks.sweep_common import HBM, _f, graph_us

# (block_n, block_k, split_k, num_warps)
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
    from vllm_dsv4_hw.ops.reference.fp8_linear import check_fp8_block_linear_args
    from vllm_dsv4_hw.ops.triton import fp8_gemv
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", default=None, help="comma-separated GEMM_SHAPES names")
    ap.add_argument("--product-check", action="store_true",
                    help="the default GEMV (fp8_gemv) against the tiles instead of the sweep")
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
        res = {"w8a8 tiles": graph_us(lambda i: fp8_block_linear(
            x, *ws[i], (128, 128), None, True, gemv=False), n_sets)}
        want = fp8_block_linear(x, *ws[0], (128, 128), torch.float32, True, gemv=False)
        for bn, bk, split, nw in CONFIGS:
            key = f"gemv bn={bn} bk={bk} split={split} warps={nw}"
            kw = dict(block_n=bn, block_k=bk, split_k=split, num_warps=nw)
            try:
                got = fp8_gemv.launch(check_fp8_block_linear_args(
                    x, *ws[0], (128, 128), torch.float32), **kw)
                err = float((got - want).abs().max() / want.abs().max())
                if err > 1e-2:
                    res[key] = f"wrong: rel err {err:.1e}"
                    continue
                res[key] = graph_us(lambda i, kw=kw: fp8_gemv.launch(
                    check_fp8_block_linear_args(x, *ws[i], (128, 128), None), **kw), n_sets)
            except Exception as exc:  # out of resources at this tile
                torch.cuda.synchronize()
                res[key] = f"{type(exc).__name__}: {str(exc)[:80]}"
        ok = {kk: v for kk, v in res.items() if isinstance(v, float)}
        best = min((kk for kk in ok if kk.startswith("gemv")), key=ok.get, default=None)
        print(f"{name:14s} floor {floor:6.2f}  w8a8 tiles {_f(res['w8a8 tiles'])}  best gemv "
              f"{_f(ok.get(best))}  {best}", flush=True)
        rows.append({"shape": f"{name} M=1", "floor_us": floor, "configs": res, "best": best})
        del ws
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
