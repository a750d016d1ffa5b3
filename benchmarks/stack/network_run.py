# SPDX-License-Identifier: Apache-2.0
"""The whole-model decode row of ``benchmarks.decode_stack --network``: the product's network
(``DSV4Network``: attention, mHC, MoE with FP4 experts, FP8 linears and shared expert, head) at real
dimensions with a few layers of each kind, one decode step timed at each context (CUDA graph of
the whole step), ms per layer kind (the layers of one kind back to back, divided by their count),
extrapolated to the model's full layer pattern and stated as tokens/s for one sequence.

Caches are the benchmark pools (``pools.StackCaches``) filled with random valid entries; decode
metadata is the product's graph-safe builder (``decode_inputs.DecodeInputs``).
"""

from __future__ import annotations

import gc
import logging
import os
import time

import torch

from benchmarks.stack.network_floor import copy_bytes_per_s, kernels_per_replay, step_floor
from benchmarks.stack.profile import kernel_table, print_table
from benchmarks.stack.timing import Timer, capture_cuda_graph, median

logger = logging.getLogger("decode_stack")
GIB = 1 << 30


def network_config(base, per_kind: int):
    """``base``'s dimensions with ``per_kind`` layers of each of its layer kinds, in its order
    (the first layers hash-routed as in the model)."""
    kinds = []
    for r in base.compress_ratios:
        if r not in kinds:
            kinds.append(r)
    pattern = tuple(r for r in kinds for _ in range(per_kind))
    return base.with_layers(pattern)


def _graph(fn, timer: Timer, reps: int, cuda: bool) -> tuple[float, object]:
    """Median ms of ``fn`` (captured in a CUDA graph on GPUs); returns (ms, last output)."""
    if not cuda:
        out = {}

        def call():
            out["v"] = fn()

        return median(timer.loop(call, reps)), out["v"]
    g, out = capture_cuda_graph(fn)
    ms = median(timer.loop(g.replay, reps))
    torch.cuda.synchronize()
    return ms, (g, out)


@torch.no_grad()
def run_network_rows(args, device: torch.device, report, model: str, contexts, batches=(1,)):
    from benchmarks.decode_stack import model_config
    from benchmarks.stack.decode_inputs import DecodeInputs
    from benchmarks.stack.model import build_network, resident_bytes
    from benchmarks.stack.pools import StackCaches
    from vllm_dsv4_hw.attention.layer import running_step
    from vllm_dsv4_hw.kinds import kind_of
    from vllm_dsv4_hw.platform.streams import aux_streams

    full = model_config(model, None)
    cfg = network_config(full, args.network_layers)
    cuda = device.type == "cuda"
    timer = Timer(device)
    t0 = time.time()
    net = build_network(cfg, device, max_positions=max(contexts), seed=args.seed)
    timer.sync()
    kinds: dict[str, list[int]] = {}
    for i, r in enumerate(cfg.compress_ratios):
        kinds.setdefault(kind_of(r).name, []).append(i)
    layer_bytes = {k: resident_bytes(net.layers[ids[0]]) for k, ids in kinds.items()}
    logger.info(
        "network %s: %d layers %s built in %.1f s, weights %.2f GiB",
        model,
        cfg.num_layers,
        {k: len(v) for k, v in kinds.items()},
        time.time() - t0,
        resident_bytes(net) / GIB,
    )
    full_counts = {}
    for r in full.compress_ratios:
        full_counts[kind_of(r).name] = full_counts.get(kind_of(r).name, 0) + 1
    streams = getattr(args, "network_streams", "on") == "on"
    os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1" if streams else "0"
    aux_streams(device)
    rate = copy_bytes_per_s(device) if cuda else None
    gen = torch.Generator(device=device).manual_seed(3)
    for batch, context in [(b, c) for b in batches for c in contexts]:
        caches = StackCaches(
            cfg, batch, context, device, args.kv_format, args.indexer_format, seed=args.seed
        )
        caches.fill_random(seed=args.seed)
        dm = DecodeInputs(caches, device)
        dm.set_position(context - 2)
        ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=gen)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        def step():
            with running_step(dm.derive(), caches.layers):
                return net.compute_logits(net(ids))

        step_ms, held = _graph(step, timer, args.reps, cuda)
        logits = held[1] if cuda else held
        per_kind, kernels = {}, {}
        h = net.embed_input_ids(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for k, layer_ids in kinds.items():
            with running_step(dm.derive(), caches.layers):  # a previous layer's pending post
                _, carry0 = net.layers[layer_ids[0]].forward_carried(h, ids, None)

            def layers_of_kind(layer_ids=layer_ids, carry0=carry0):
                # as inside the network: each layer opens with the seam from the one before
                with running_step(dm.derive(), caches.layers):
                    x, carry = h, carry0
                    for i in layer_ids:
                        x, carry = net.layers[i].forward_carried(x, ids, carry)
                    return x, carry

            ms, held_kind = _graph(layers_of_kind, timer, args.reps, cuda)
            per_kind[k] = ms / len(layer_ids)
            if cuda:
                kernels[k] = kernels_per_replay(held_kind[0]) / len(layer_ids)
                if args.profile:  # where one layer's time goes, kernel by kernel
                    tab = kernel_table(held_kind[0].replay, args.reps)
                    print_table(f"{model} {context} B={batch} {k} x{len(layer_ids)}", tab)
                    report.add(
                        "network_profile",
                        {
                            "context": context,
                            "batch": batch,
                            "kind": k,
                            "layers": len(layer_ids),
                            **tab,
                        },
                    )
            del held_kind
        layers_ms = sum(per_kind[k] * len(v) for k, v in kinds.items())
        rest_ms = max(0.0, step_ms - layers_ms)  # embedding, hc_head, norm, head, metadata
        full_ms = sum(per_kind[k] * n for k, n in full_counts.items()) + rest_ms
        floor = step_floor(net, cfg, full_counts, kinds, batch, context, args)
        floor_ms = floor["step_bytes"] / rate * 1e3 if rate else None
        row = {
            "model": model,
            "what": "whole_network_decode",
            "context": context,
            "batch": batch,
            "layers": list(cfg.compress_ratios),
            "cuda_graphs": cuda,
            "multi_stream": streams,
            "step_ms": step_ms,
            "per_layer_ms": per_kind,
            "rest_ms": rest_ms,
            "layer_weight_bytes": layer_bytes,
            "full_model_layers": full_counts,
            "full_model_step_ms": full_ms,
            "full_model_tokens_per_s": batch / (full_ms * 1e-3),
            "copy_bytes_per_s": rate,
            "floor": floor,
            "full_model_floor_ms": floor_ms,
            "x_floor": full_ms / floor_ms if floor_ms else None,
            "kernels_per_layer": kernels,
            "finite": bool(torch.isfinite(logits).all()),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        }
        report.add("network", row)
        logger.info(
            "network %s %d B=%d: step %.3f ms for %d layers, per layer %s, rest %.3f ms; "
            "%d layers: %.2f ms = %.1f tokens/s; floor %s ms (%s x); kernels per layer %s",
            model,
            context,
            batch,
            step_ms,
            cfg.num_layers,
            {k: round(v, 4) for k, v in per_kind.items()},
            rest_ms,
            full.num_layers,
            full_ms,
            row["full_model_tokens_per_s"],
            None if floor_ms is None else round(floor_ms, 3),
            None if floor_ms is None else round(full_ms / floor_ms, 2),
            kernels,
        )
        del caches, dm, held
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    del net
    gc.collect()
