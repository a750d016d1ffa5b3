# SPDX-License-Identifier: Apache-2.0
"""Arrival counters of the kernels whose last program to finish a unit of work completes it
inside the launch (the serial split-K sum, the mHC mixes): one zeroed int32 set per device
stream, left zeroed by every launch that uses it."""

from __future__ import annotations

import torch

COUNTER_WORDS = 4096  # units of one launch (decode launches have <= 1,024)
COUNTERS: dict[tuple, torch.Tensor] = {}


def arrival_counters(device: torch.device, units: int) -> torch.Tensor | None:
    """The zeroed int32 arrival counters on this device's current stream (each launch leaves them
    zeroed; launches on one stream run in order, so one set per stream serves them all, CUDA-graph
    replays included: vLLM captures on the stream it also runs eagerly). None, so that the caller
    takes its launch without counters, for more units than a set holds and on a stream first met
    under graph capture (a set allocated then would be the graph's memory, zeroed only when that
    graph replays)."""
    if units > COUNTER_WORDS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = COUNTERS[key] = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
    return buf
