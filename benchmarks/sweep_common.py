# SPDX-License-Identifier: Apache-2.0
"""Timing and reporting shared by the kernel sweeps (``benchmarks.decode_kernels``,
``benchmarks.gemm_sweeps``): CUDA-graph medians over rotating input sets, one summary row per
op and shape."""

from __future__ import annotations

import torch

HBM = 4.3e12
INNER = 8


def graph_us(fn, n_sets: int, inner: int = INNER, reps: int = 7) -> float:
    """Median microseconds of one ``fn(i)`` call (i cycles over the input sets), graph-replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):  # the warmed-up stream, as vLLM captures
        for i in range(inner):
            fn(i % n_sets)
    g.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        g.replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ts = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    del g
    return ts[reps // 2] * 1e3 / inner


def _try(fn, n_sets, inner: int = INNER, reps: int = 7):
    try:
        return graph_us(fn, n_sets, inner, reps)
    except Exception as exc:  # a config out of resources
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def _summary(op, shape, results: dict, default_key, floor_us):
    ok = {k: v for k, v in results.items() if isinstance(v, float)}
    best = min(ok, key=ok.get) if ok else None
    row = {
        "op": op,
        "shape": shape,
        "floor_us": floor_us,
        "best": best,
        "best_us": ok.get(best),
        "default": default_key,
        "default_us": results.get(default_key),
        "configs": results,
    }
    print(
        f"{op:6s} {shape:42s} default {_f(row['default_us'])} best {_f(row['best_us'])} "
        f"floor {floor_us:6.2f}  {best}",
        flush=True,
    )
    return row


def _f(v):
    return f"{v:7.2f}" if isinstance(v, float) else "   fail"
