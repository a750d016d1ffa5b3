# SPDX-License-Identifier: Apache-2.0
"""Timing for the GPU benchmarks: medians of ``triton.testing.do_bench`` over CUDA-graph replays.

A decode-sized op runs for microseconds, less than the Python wrapper around it takes to launch it,
so timing eager calls measures the host. Each timed function is captured once in a CUDA graph and
the replays are timed (METHOD.md: "for many small launches, capture a graph and time its
replays"); this is also how the decode step runs in production. A function that cannot be captured
(host syncs, as in parts of the unfused PyTorch reference) is timed eagerly, and ``MODES`` counts
how often each mode was used so the report can say it.
"""

from __future__ import annotations

import time
from collections import Counter

MODES: Counter = Counter()


def time_ms(fn, device, graph: bool = True) -> float:
    import torch

    device = torch.device(device)
    if device.type != "cuda":  # CPU smoke runs: the run path matters, not the number
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):  # the warmed-up stream, as vLLM
                fn()
            ms = float(triton.testing.do_bench(g.replay, return_mode="median"))
            MODES["graph"] += 1
            del g
            _release(torch)
            return ms
        except Exception:  # not capturable: fall back to eager timing
            torch.cuda.synchronize()
            MODES["eager (capture failed)"] += 1
            _release(torch)
    else:
        MODES["eager"] += 1
    ms = float(triton.testing.do_bench(fn, return_mode="median"))
    _release(torch)
    return ms


def _release(torch) -> None:
    """Give graph pools and large temporaries back: a run times hundreds of cases, and the cached
    blocks of a 1M-context case otherwise fragment the next one's allocations."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def launch_floor_ms(device, kernels: int = 1) -> float:
    """Graph replay time of ``kernels`` empty Triton launches: the latency floor of any op."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 0.0)

    x = torch.empty(132, device=device)

    def fn():
        for _ in range(kernels):
            _noop[(132,)](x)

    return time_ms(fn, device)
