# SPDX-License-Identifier: Apache-2.0
"""The whole-step floor and kernel counts of ``decode_stack --network`` rows.

Floor of one decode step of B sequences at context n: the bytes that must move, over the card's
copy rate measured in the same run (so the ratio holds on any card):

* per layer, its weights as read at this batch: everything but the routed experts, plus the
  experts the batch hits (expected distinct experts of B tokens choosing k of E at random:
  ``E (1 - (1 - k/E)^B)``; exactly k at B = 1);
* per layer, the KV entries its attention reads (``floor.kv_bytes_per_layer``);
* once, the head weight (the embedding reads B rows: left out).

Kernels per layer kind: one replay of that kind's CUDA graph under ``torch.profiler``, its GPU
kernels counted (memcpy / memset left out) and divided by the layers in the graph.
"""

from __future__ import annotations

import torch

from benchmarks.stack.floor import kv_bytes_per_layer
from benchmarks.stack.model import resident_bytes


def copy_bytes_per_s(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Device-to-device copy rate (bytes read + written per second), measured now."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def layer_read_bytes(layer, batch: int) -> int:
    """Bytes of ``layer``'s weights one decode step of ``batch`` tokens reads."""
    experts = layer.ffn.experts
    e = experts.w13.shape[0]
    k = layer.ffn.top_k
    all_experts = resident_bytes(experts)
    hit = e * (1 - (1 - k / e) ** batch)
    return resident_bytes(layer) - all_experts + round(all_experts / e * hit)


def step_floor(net, cfg, full_counts: dict, kinds: dict, batch: int, context: int, args) -> dict:
    """Bytes of one whole-model step (the full layer pattern) and per layer kind."""
    per_kind = {}
    for name, layer_ids in kinds.items():
        layer = net.layers[layer_ids[0]]
        kv = kv_bytes_per_layer(
            cfg, layer.ratio, batch, context, args.kv_format, args.indexer_format
        )
        per_kind[name] = layer_read_bytes(layer, batch) + sum(kv.values())
    head = resident_bytes(net.head) + resident_bytes(net.norm)
    total = sum(per_kind[k] * n for k, n in full_counts.items()) + head
    return {"per_layer_bytes": per_kind, "head_bytes": head, "step_bytes": total}


def kernels_per_replay(graph) -> int:
    """GPU kernels one replay of ``graph`` launches (memcpy / memset not counted)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.lower().startswith(("memcpy", "memset"))
    )
