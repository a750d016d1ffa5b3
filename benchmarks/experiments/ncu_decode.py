# SPDX-License-Identifier: Apache-2.0
"""Eager launches of the decode step's heaviest kernels at real shapes, for Nsight Compute.

    ncu --clock-control none --set full --kernel-name regex:'block_linear|indexer_score|radix|sparse'
        --csv --page details python -m benchmarks.experiments.ncu_decode --only gemm,index,topk,attn

Why: the sweeps (``benchmarks.decode_kernels``) say how long each config takes, not why; the
decode FP8 GEMM streams its weight at about 2.3 TB/s of the 4.3 the card copies at, and only the
hardware counters (DRAM throughput, warp stall reasons, occupancy) tell which limit it is. Each
case builds the product's op on the sweeps' inputs (weights as shipped, caches of random valid
entries) and calls it ``--calls`` times after one warm-up call (the compile), so the profiler sees
a few launches per case; ``[ncu_decode] <case>`` lines on stderr give the order.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _mark(name):
    print(f"[ncu_decode] {name}", file=sys.stderr, flush=True)


def _run(name, fn, calls):
    fn()
    torch.cuda.synchronize()
    _mark(name)
    torch.cuda.nvtx.range_push(name)
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def cases_gemm(dev, calls, batches):
    """The FP8 linears as the layers call them: e4m3 activations (W8A8) where the device takes
    them (``quant.linear.e4m3_activations``), the W8A16 kernel elsewhere."""
    from benchmarks.gemm_sweeps import _shape_cases
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear
    from vllm_dsv4_hw.quant.linear import e4m3_activations

    w8a8 = e4m3_activations(dev)
    for label, ws, _, x, floor in _shape_cases(dev, batches):
        _run(
            f"gemm {label} {'w8a8' if w8a8 else 'w8a16'} floor {floor:.2f} us",
            lambda: fp8_block_linear(x, *ws[0], (128, 128), quantize_x=w8a8),
            calls,
        )


def cases_index(dev, calls, batches):
    from benchmarks.gpu.indexer import _decode_reqs, make_inputs
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    for ctx in (131072, 1048576):
        for b in batches:
            args = make_inputs(dev, "mxfp4", _decode_reqs(b, ctx))[0]
            _run(f"index ctx={ctx} B={b}", lambda: ti.indexer_scores(*args, 4), calls)
            del args
            torch.cuda.empty_cache()


def cases_topk(dev, calls, batches):
    from vllm_dsv4_hw.ops.triton.indexer.topk import radix_topk

    for n in (32768, 262144):
        for b in batches:
            s = torch.randn(b, n, device=dev)
            out = torch.full((b, 512), -1, dtype=torch.int32, device=dev)
            _run(f"topk n={n} B={b}", lambda: radix_topk(s, 512, out), calls)


def cases_attn(dev, calls, batches):
    from benchmarks.gpu.sparse_attention import make_inputs
    from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa

    for k_comp in (512, 8192):
        for b in batches:
            args = make_inputs(dev, "fp8_ds_mla", b, topk=k_comp, cache_entries=1 << 20)[0]
            out = torch.empty_like(args[0])
            _run(
                f"attn W=128 K={k_comp} B={b}",
                lambda: tsa.sparse_attention_triton(*args, out=out),
                calls,
            )
            del args
            torch.cuda.empty_cache()


CASES = {"gemm": cases_gemm, "index": cases_index, "topk": cases_topk, "attn": cases_attn}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.only.split(","):
        CASES[name](dev, args.calls, batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
