# SPDX-License-Identifier: Apache-2.0
"""The GEMV of the FP8 linears (``ops.triton.fp8_gemv``): its tiles and splits against the W8A8
tile kernels on the decode step's weights at 1 and 4 rows, and the product check.

    python -m benchmarks.experiments.gemv_probe [--rows 1,4] [--only NAMES] [--out DIR]  # sweep (CUDA GPU)
    python -m benchmarks.experiments.gemv_probe --product-check [--out DIR]  # the default GEMV vs the tiles

Each projection is called as the layer calls it: x quantized in the launch (``quantize_x``),
wo_a on the e4m3 codes + scales ``inv_rope_fp8_quant`` leaves (``x_scales``).

Why: at batch 1 every FP8 linear of the decode step paid ~4 us over its weight bytes / HBM rate
with the W8A8 tensor-core tiles (wq_b 12.0 us on the H200 for a 7.8 us floor); Nsight Compute on
an H100 (2026-12-06) put those launches at 16-24% achieved occupancy and 55-62% of DRAM
throughput. The first form of this file (commit 2ef58d6) timed a GEMV of its own (split-K by
fp32 atomics) to see what plain vector loads reach; the product's ``fp8_gemv`` was built from
it, and this file now sweeps that kernel's launch knobs (``block_n``, ``block_k``, ``split_k``,
``num_warps``, ``num_stages``, ``ahead``) on the product's own call, each config checked against
the tile kernels first.
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

# (block_n, block_k, split_k, num_warps, num_stages, ahead; None: the rule's); warps 8 and
# stages 1-3 were swept on 2026-12-06 (H100): 8 warps lost everywhere, the stages tied
CONFIGS = (
    ((None,) * 6, (None,) * 5 + (True,))
    + tuple(
        (bn, bk, split, 4, 3, None)
        for bn in (4, 8, 16)
        for bk in (512, 1024)
        for split in (None, 1, 2, 4)
    )
    + tuple((bn, bk, None, 4, 3, True) for bn in (4, 8, 16) for bk in (512, 1024))
)
# the merged projections the layers call (wq_a | wkv: one GEMM) besides GEMM_SHAPES'
MERGED = {"flash wq_a|wkv": (1, 1536, 4096), "pro wq_a|wkv": (1, 2048, 7168)}


def shapes() -> dict:
    from benchmarks.gemm_sweeps import GEMM_SHAPES

    return dict(GEMM_SHAPES, **MERGED)


def _call(dev, name: str, rows: int, codes: bool | None = None):
    """The call of ``fp8_block_linear`` as the layer makes it, for ``rows`` rows of projection
    ``name``: ``call(weights, out_dtype=None, **knobs)``; wo_a (or any, with ``codes``) takes
    codes + scales (the product's quantization, ``fp8_dot_linear.quantize``)."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear
    from vllm_dsv4_hw.ops.triton.linear.w8a8 import quantize

    g, n, k = shapes()[name]
    x = torch.randn((rows, g, k) if g > 1 else (rows, k), device=dev, dtype=torch.bfloat16)
    if name.endswith("wo_a") if codes is None else codes:
        q, scales = quantize(x.reshape(-1, k), 128)
        q, scales = q.view(*x.shape), scales.view(*x.shape[:-1], -1)

        def call(w, out=None, **kw):
            return fp8_block_linear(q, *w, (128, 128), out, x_scales=scales, **kw)

        return call

    def call(w, out=None, **kw):
        return fp8_block_linear(x, *w, (128, 128), out, True, **kw)

    return call


def product_check(dev) -> list[dict]:
    """The product's GEMV (``gemv=True``) against its W8A8 tiles on every projection at 1 and
    4 rows: relative error, the same bits on a second call, and both timed."""
    from benchmarks.gemm_sweeps import _shipped_weights

    rows = []
    for name, (g, n, k) in shapes().items():
        ws = _shipped_weights(dev, g, n, k, 2)
        for m in (1, 4):
            call = _call(dev, name, m)
            tile = call(ws[0], torch.float32, gemv=False)
            got = call(ws[0], torch.float32, gemv=True)
            same = torch.equal(got, call(ws[0], torch.float32, gemv=True))
            err = float((got - tile).abs().max() / tile.abs().max())
            coded = _call(dev, name, m, codes=True)  # what x given as codes would save
            res = {
                "tiles": graph_us(lambda i: call(ws[i], gemv=False), 2),
                "gemv": graph_us(lambda i: call(ws[i], gemv=True), 2),
                "gemv on codes": graph_us(lambda i: coded(ws[i], gemv=True), 2),
            }
            print(
                f"gemv_check {name:14s} M={m} rel err vs tiles {err:.1e} same bits twice "
                f"{same} us tiles {res['tiles']:.2f} gemv {res['gemv']:.2f} on codes "
                f"{res['gemv on codes']:.2f}",
                flush=True,
            )
            rows.append({"shape": f"{name} M={m}", "rel_err": err, "same_bits": same, "us": res})
        del ws
        torch.cuda.empty_cache()
    return rows


def _sweep(dev, name: str, m: int) -> dict:
    """One projection at ``m`` rows: the tiles, then every config of the GEMV (checked first)."""
    from benchmarks.gemm_sweeps import _shipped_weights

    g, n, k = shapes()[name]
    n_sets = max(2, min(6, math.ceil(200e6 / (g * n * k))))
    ws = _shipped_weights(dev, g, n, k, n_sets)
    floor = (g * n * k + g * math.ceil(n / 128) * math.ceil(k / 128) * 4) / HBM * 1e6
    call = _call(dev, name, m)
    res = {"w8a8 tiles": graph_us(lambda i: call(ws[i], gemv=False), n_sets)}
    want = call(ws[0], torch.float32, gemv=False)
    for cfg in CONFIGS:
        kw = {
            kk: v
            for kk, v in zip(
                ("block_n", "block_k", "split_k", "num_warps", "num_stages", "ahead"), cfg
            )
            if v is not None
        }
        key = "gemv " + (" ".join(f"{kk}={v}" for kk, v in kw.items()) or "default")
        try:
            got = call(ws[0], torch.float32, gemv=kw)
            err = float((got - want).abs().max() / want.abs().max())
            res[key] = (
                graph_us(lambda i, kw=kw: call(ws[i], gemv=kw), n_sets)
                if err <= 1e-2
                else f"wrong: rel err {err:.1e}"
            )
        except Exception as exc:  # out of resources at this tile
            torch.cuda.synchronize()
            res[key] = f"{type(exc).__name__}: {str(exc)[:80]}"
    ok = {kk: v for kk, v in res.items() if isinstance(v, float)}
    best = min((kk for kk in ok if kk.startswith("gemv")), key=ok.get, default=None)
    print(
        f"{name:14s} M={m} floor {floor:6.2f}  w8a8 tiles {_f(res['w8a8 tiles'])}  default "
        f"{_f(ok.get('gemv default'))}  best {_f(ok.get(best))}  {best}",
        flush=True,
    )
    del ws
    torch.cuda.empty_cache()
    return {"shape": f"{name} M={m}", "floor_us": floor, "configs": res, "best": best}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", default=None, help="comma-separated shape names (shapes())")
    ap.add_argument("--rows", default="1,4", help="comma-separated row counts")
    ap.add_argument(
        "--product-check",
        action="store_true",
        help="the default GEMV (fp8_gemv) against the tiles instead of the sweep",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_probe needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    command = "python -m benchmarks.experiments.gemv_probe " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.product_check:
        out, schema, rows = "gemv_check.json", "gemv_check/2", product_check(dev)
    else:
        names = args.only.split(",") if args.only else list(shapes())
        out, schema = "gemv_probe.json", "gemv_probe/2"
        rows = [_sweep(dev, name, int(m)) for m in args.rows.split(",") for name in names]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, out), "w") as f:
        json.dump(
            {
                "schema": schema,
                "machine": torch.cuda.get_device_name(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": command,
                "rows": rows,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
