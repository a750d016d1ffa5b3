# SPDX-License-Identifier: Apache-2.0
"""The product's network split over several GPUs: one process per GPU in one vLLM tensor-parallel
group (NCCL, vLLM's parallel state set up as its workers do: ``benchmarks.vllm_state``), V4-Flash
dimensions with a few layers of each kind, FP8 linears and FP4 experts resident
(``stack.model.build_network`` with this rank's ``parallel.ParallelLayout``).

Per context and batch: rank 0's logits against the unsplit network (built on rank 0 when it fits)
on the same caches, the decode step time (CUDA graph), and the communication alone (the step's
collectives at its sizes, timed standalone: the embedding and every ``wo_b`` / MoE all-reduce, the
logits all-gather). ``--world 1`` rehearses the same script on one GPU (no collective runs).

    bash benchmarks/with_vllm.sh python3 -m benchmarks.multi_gpu --world 2 [--expert-parallel]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

logger = logging.getLogger("multi_gpu")
CONTEXTS = {"128k": 131072, "1m": 1048576}


def _collective_ms(cfg, batch: int, timer, reps: int) -> float:
    """The step's collectives at its sizes, one CUDA graph, ms (0 on one rank)."""
    from vllm.distributed import (
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    from benchmarks.stack.timing import capture_cuda_graph, median

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return 0.0
    d = cfg.hidden_size
    bf = torch.zeros(batch, d, dtype=torch.bfloat16, device="cuda")
    f32 = torch.zeros(batch, d, dtype=torch.float32, device="cuda")
    logits = torch.zeros(batch, cfg.vocab_size // tp, dtype=torch.bfloat16, device="cuda")

    def collectives():
        tensor_model_parallel_all_reduce(bf)  # embedding
        for _ in range(cfg.num_layers):
            tensor_model_parallel_all_reduce(bf)  # wo_b
            tensor_model_parallel_all_reduce(f32)  # MoE partial sums
        return tensor_model_parallel_all_gather(logits, dim=-1)

    g, _ = capture_cuda_graph(collectives)
    return median(timer.loop(g.replay, reps))


def _rank(rank: int, args, port: int, out_dir: str) -> None:
    res: dict = {"rank": rank}
    try:
        torch.cuda.set_device(rank)
        from benchmarks.vllm_state import tensor_parallel_rank

        tensor_parallel_rank(args.world, rank, f"tcp://127.0.0.1:{port}", backend="nccl")
        res.update(_run(rank, args))
    except BaseException:  # noqa: BLE001 (reported by the parent)
        res["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@torch.no_grad()
def _run(rank: int, args) -> dict:
    from benchmarks.decode_stack import model_config
    from benchmarks.stack.decode_inputs import DecodeInputs
    from benchmarks.stack.model import build_network, resident_bytes
    from benchmarks.stack.network_run import _graph, network_config
    from benchmarks.stack.pools import StackCaches
    from benchmarks.stack.timing import Timer
    from vllm_dsv4_hw.attention.layer import running_step
    from vllm_dsv4_hw.parallel import ParallelLayout, current_layout
    from vllm_dsv4_hw.platform.streams import aux_streams

    device = torch.device("cuda", rank)
    layout = current_layout(expert_parallel=args.expert_parallel)
    cfg = network_config(model_config("v4-flash", None), args.layers_per_kind)
    contexts = [CONTEXTS[c] for c in args.contexts.split(",")]
    t0 = time.time()
    net = build_network(cfg, device, max(contexts), seed=args.seed, layout=layout)
    whole = (
        build_network(cfg, device, max(contexts), seed=args.seed, layout=ParallelLayout())
        if rank == 0 and layout.sharded and args.compare
        else None
    )
    out = {
        "layout": layout.describe(),
        "layers": list(cfg.compress_ratios),
        "weight_gib": resident_bytes(net) / 2**30,
        "build_s": time.time() - t0,
        "rows": [],
    }
    os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1"
    aux_streams(device)
    timer = Timer(device)
    for context in contexts:
        for batch in (int(b) for b in args.batches.split(",")):
            caches = StackCaches(cfg, batch, context, device, "fp8", "mxfp4", seed=args.seed)
            caches.fill_random(seed=args.seed)
            dm = DecodeInputs(caches, device)
            dm.set_position(context - 2)
            ids = torch.randint(
                0,
                cfg.vocab_size,
                (batch,),
                device=device,
                generator=torch.Generator(device=device).manual_seed(3),
            )

            def step(model=net):
                with running_step(dm.derive(), caches.layers):
                    return model.compute_logits(model(ids))

            ref = step(whole) if whole is not None else step()
            got = step()
            step_ms, _ = _graph(step, timer, args.reps, True)
            comm_ms = _collective_ms(cfg, batch, timer, args.reps)
            row = {
                "context": context,
                "batch": batch,
                "step_ms": step_ms,
                "comm_ms": comm_ms,
                "compute_ms": max(0.0, step_ms - comm_ms),
                "max_abs_logit_diff_vs_whole": float((got - ref).abs().max()),
                "compared_with_whole": whole is not None,
                "greedy_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))),
                "finite": bool(torch.isfinite(got).all()),
            }
            out["rows"].append(row)
            if rank == 0:
                logger.info(
                    "world %d %s, %d B=%d: step %.3f ms (collectives alone %.3f ms), "
                    "logits vs whole max %.4g",
                    args.world,
                    layout.describe(),
                    context,
                    batch,
                    step_ms,
                    comm_ms,
                    row["max_abs_logit_diff_vs_whole"],
                )
            del caches, dm
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count() or 1)
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--layers-per-kind", type=int, default=2)
    p.add_argument("--contexts", default="128k,1m")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the unsplit network on rank 0 (when it does not fit)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if torch.cuda.device_count() < args.world:
        raise SystemExit(
            f"--world {args.world} needs {args.world} GPUs, {torch.cuda.device_count()} visible"
        )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device docs: NVLink multicast off
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = Path(os.environ.get("OUT", "/tmp")) / "multi_gpu_ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _rank, args=(args, port, str(out_dir)), nprocs=args.world, start_method="spawn", join=True
    )
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(args.world)]
    report = {
        "what": "multi_gpu_decode",
        "world": args.world,
        "expert_parallel": args.expert_parallel,
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "ranks": ranks,
    }
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 1 if any("error" in r for r in ranks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
