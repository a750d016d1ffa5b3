# SPDX-License-Identifier: Apache-2.0
"""Timing and the JSON report shared by the decode benchmarks."""

from __future__ import annotations

import json
import os
import time

import torch


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def loop(self, fn, n: int, between=None) -> list[float]:
        """ms of each of n calls of fn (``between`` runs after each call, inside the interval)."""
        if self.cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
            ev[0].record()
            for i in range(n):
                fn()
                if between is not None:
                    between()
                ev[i + 1].record()
            torch.cuda.synchronize()
            return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            if between is not None:
                between()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def capture_cuda_graph(fn, warmups: int = 2):
    """(graph, output of the captured call): ``fn`` runs ``warmups`` times on a side stream first
    (compile, autotune and allocations outside the capture), then once under capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the warmed-up stream, as vLLM captures
        out = fn()
    return graph, out


def error_text(exc: BaseException) -> str:
    """One line for a results file: the exception, and the one it was raised while handling (a
    failed CUDA-graph capture reports "capturing stream has unjoined work" and hides the error
    inside the captured call that caused it)."""
    text = f"{type(exc).__name__}: {exc}"
    inner = exc.__cause__ or exc.__context__
    if inner is not None:
        text += f" [raised while handling {type(inner).__name__}: {inner}]"
    return text[:2000]


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# -- the report -------------------------------------------------------------------------------------
class Report:
    def __init__(self, path: str, meta: dict) -> None:
        self.path = path
        self.data = dict(
            meta,
            rows=[],
            prefill=[],
            kv=[],
            verify=[],
            network=[],
            network_profile=[],
            models={},
            skipped=[],
            errors=[],
        )

    def add(self, key: str, row: dict) -> None:
        self.data[key].append(row)
        self.write()

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)
