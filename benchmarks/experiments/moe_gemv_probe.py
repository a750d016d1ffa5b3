# SPDX-License-Identifier: Apache-2.0
"""The routed experts' FP4 GEMV (``ops.triton.moe.gemv``): its tiles at V4-Flash dimensions.

    python -m benchmarks.experiments.moe_gemv_probe [--tokens 1,4,8] [--out DIR]   # CUDA GPU

Each row sets ``gemv.TILES`` (one kernel's (BN, BK, warps), the other at the default) and times
the whole ``moe_experts`` call (CUDA-graph median, L2 flushed by ``do_bench``) against the bytes
of the experts the tokens hit at the copy rate measured in the same run. Every tile is first
checked against the default tile's output (same bits: the tiles only change how rows are split).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

GATE_UP = (
    (8, 512, 4),
    (8, 256, 4),
    (16, 256, 4),
    (16, 512, 8),
    (4, 512, 4),
    (8, 1024, 8),
    (32, 256, 8),
    (4, 1024, 4),
)
DOWN = (
    (8, 256, 8),
    (8, 256, 4),
    (4, 256, 4),
    (8, 512, 8),
    (16, 256, 8),
    (4, 512, 8),
    (16, 128, 8),
    (2, 512, 4),
    (4, 512, 4),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from benchmarks.gpu.timing import time_ms
    from benchmarks.gpu.weights import _experts, _routing
    from benchmarks.stack.network_floor import copy_bytes_per_s
    from vllm_dsv4_hw.ops.triton.moe import gemv

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    e, d, i, k = 256, 4096, 2048, 6
    w13, s13, w2, s2 = _experts(torch, e, d, i, dev, gen)
    per_expert = w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()
    rate = copy_bytes_per_s(dev)
    default = dict(gemv.TILES)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, d, device=dev, generator=gen).to(torch.bfloat16)
        tw, ids = _routing(torch, t, e, k, dev, gen)
        floor_us = int(ids.unique().numel()) * per_expert / rate * 1e6

        def call():
            return gemv.gemv_experts(x, tw, ids, w13, s13, w2, s2, 10.0, e, i)

        gemv.TILES.update(default)
        want = call()
        for which, tiles in (("gate_up", GATE_UP), ("down", DOWN)):
            for tile in tiles:
                gemv.TILES.update(default)
                gemv.TILES[which] = tile
                same = bool(torch.equal(call(), want))
                us = time_ms(call, dev) * 1e3
                row = {
                    "T": t,
                    "kernel": which,
                    "tile": tile,
                    "us": us,
                    "floor_us": floor_us,
                    "x_floor": us / floor_us,
                    "same_bits": same,
                }
                rows.append(row)
                print(
                    f"T={t} {which:8s} {tile}: {us:8.1f} us  floor {floor_us:6.1f}  "
                    f"x{us / floor_us:5.2f}  same bits {same}",
                    flush=True,
                )
    gemv.TILES.update(default)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_gemv_probe.json"), "w") as f:
        json.dump({"copy_bytes_per_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
