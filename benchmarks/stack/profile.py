# SPDX-License-Identifier: Apache-2.0
"""Kernel-level breakdown of a decode region (``decode_stack --profile``): which kernels one layer
launches, how long each runs on the device, and how much of the region's time is launch gaps.

``kernel_table(fn, reps)`` runs ``fn`` (a graph replay or an eager call) ``reps`` times under
``torch.profiler`` (CUDA activity only: CUPTI records the kernels of graph replays too) and returns
per kernel name: launches per call, device microseconds per call and per launch. ``busy_us`` is the
sum over kernels per call; the region's event-timed wall time minus ``busy_us`` is what the launches
and dependencies cost (with several streams, kernels overlap and ``busy_us`` can exceed the wall).
"""

from __future__ import annotations

import torch


def _short(name: str, width: int = 72) -> str:
    name = name.split("(")[0] if name.startswith("void ") else name
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_table(fn, reps: int = 5, warmup: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / reps
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if not us or e.count == 0:
            continue
        if e.key.startswith(("cudaGraphLaunch", "cudaLaunch", "cudaStream", "cudaEvent")):
            continue
        rows.append(
            {
                "kernel": _short(e.key),
                "launches": e.count / reps,
                "us_per_call": us / reps,
                "us_per_launch": us / e.count,
            }
        )
    rows.sort(key=lambda r: -r["us_per_call"])
    busy = sum(r["us_per_call"] for r in rows)
    return {
        "wall_us": wall_us,
        "busy_us": busy,
        "launches": sum(r["launches"] for r in rows),
        "kernels": rows,
    }


def print_table(title: str, tab: dict, top: int = 40) -> None:
    print(
        f"\n-- {title}: wall {tab['wall_us']:.1f} us, kernels busy {tab['busy_us']:.1f} us, "
        f"{tab['launches']:.0f} launches"
    )
    for r in tab["kernels"][:top]:
        print(
            f"  {r['us_per_call']:8.2f} us  x{r['launches']:<5.3g} {r['us_per_launch']:7.2f} us  "
            f"{r['kernel']}"
        )
