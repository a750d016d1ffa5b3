# SPDX-License-Identifier: Apache-2.0
"""Decode of the whole DeepSeek V4 attention stack at 8K / 128K / 1M tokens on one GPU (issue 6).

    python -m benchmarks.decode_stack                      # the prioritized matrix (H200, ~8 min)
    python -m benchmarks.decode_stack --model v4-flash --contexts 1m --batches 1,4
    python -m benchmarks.decode_stack --layers 4 --contexts 8k --batches 1 --steps 8
    python -m benchmarks.decode_stack --smoke               # tiny, CPU, reference ops, < 1 min

What runs: the attention layers of V4-Flash or V4-Pro at real dimensions and layer pattern
(``vllm_dsv4_hw.attention.layer.DSV4Attention``: projections, compressor, indexer, window, sink,
grouped output projection; FP8 weights as in the checkpoints, :mod:`benchmarks.stack.model`) with a
pre-norm residual stream between layers; MoE, the shared expert, mHC and embedding / head are left
out. Caches: one page pool per page-size bucket (:mod:`benchmarks.stack.pools`), bytes checked
against ``plan_kv``. Cache contents: a real chunked prefill where ``batch * context`` is at most
``--max-prefill-tokens`` (timed: prefill tokens/s), else random valid entries quantized through the
formats (all 1M rows). Then decode steps of one token per sequence, timed with multi-stream on/off
(``AuxStreams`` via ``VLLM_DSV4_HW_MULTI_STREAM``) and CUDA graphs on/off (the whole step captured,
streams included; the per-step input ``positions`` lives at a stable address and is advanced in
place between replays, every other metadata tensor is derived from it inside the graph:
:mod:`benchmarks.stack.decode_meta`).

Decode positions: a row at context C decodes positions ``C - steps - 1 ..`` so that the last step
reaches (almost) C; pages are allocated for C positions (``plan_kv(C)``).

JSON (``--out``/decode_stack.json, rewritten after every measurement):

* ``rows[]`` one per (model, context, batch, cuda_graphs, multi_stream):
  ``step_ms`` median decode step (metadata update + all layers; CUDA events per step),
  ``step_ms_mean``, ``tokens_per_s`` = batch / step; ``per_layer_ms`` {window, c4a, c128a}: median
  time of one layer of that kind (all layers of the kind run back to back, divided by their
  count); ``meta_ms``: deriving the step metadata alone; ``floor_ms`` / ``floor_bytes``: the bytes
  a step must move (weights once, c4a indexer keys, selected entries, window) over 4.3 TB/s;
  ``x_floor`` = step_ms / floor_ms; ``per_layer_floor_ms``; ``finite``: the stack output is finite;
  ``max_abs_diff_vs_first`` / ``equal_to_first``: last step's output against the first variant of
  the same job (same caches, same positions); ``cache_init``: ``prefill`` or ``random_fill``;
  ``streams_parallel``: branches really ran on side streams; ``peak_gib``: peak allocated device
  memory of the job so far; ``decode_positions``: first and last decoded position.
* ``prefill[]`` one per prefilled job: ``tokens`` (batch x positions), ``chunk_tokens`` (per step,
  all sequences), ``seconds``, ``tokens_per_s``, ``inflight_scratch_bytes_per_seq`` (the larger
  windowed rings a chunk needs while in flight; freed after prefill).
* ``kv[]`` one per job: ``measured_bytes_per_seq`` (pool bytes / batch) vs ``plan_bytes_per_seq``
  (``plan_kv(cfg, C).allocated_bytes``), ``rel_diff``, ``ok_1pct``, ``pools`` (per bucket: page
  bytes, pages, pages per sequence vs the plan's), ``fit_in_120gib`` (plan_kv's max_sequences),
  ``fit_by_measured_bytes`` / ``fit_agrees`` (120 GiB over the measured bytes per sequence, and
  whether it equals the plan's count), ``fit_on_device`` (free memory after the weights, less
  ``--reserve-gib``, over the bytes per sequence), ``batch`` (allocated) / ``batch_requested``.
* ``verify[]``: ``chunked_vs_oneshot_prefill`` (the timed prefill, ``chunk_per_seq`` tokens per
  sequence and step, against the same prompt prefilled into fresh caches with another page order
  and ``other_chunk_per_seq``: one step if the timed prefill was chunked, else 3 odd-sized
  chunks; ``last_chunk_rel_err`` over the last ``compared_tokens_per_seq`` outputs and
  ``decode_rel_err`` of two decode steps after it, max |diff| / max |ref|, against ``rtol``) and
  ``decode_meta_vs_builder`` (the graph-safe metadata against ``build_step_metadata`` at positions
  that do and do not complete c4a / c128a groups); run on the first prefilled job of each model
  with context <= ``--verify-max-context`` (8K).
* ``models`` weights per layer kind, ``ops`` (the backend each op resolved to), ``skipped``,
  ``errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import platform
import signal
import sys
import time
import traceback

import torch

from benchmarks.stack.runner import Runner, ctx_name
from benchmarks.stack.timing import Report, error_text
from vllm_dsv4_hw.kinds import KINDS
from vllm_dsv4_hw.ops import tuning

KIND_NAMES = tuple(k.name for k in KINDS.values())  # window, c4a, c128a

logger = logging.getLogger("decode_stack")

GIB = 1 << 30
CONTEXT_NAMES = {"8k": 8192, "128k": 131072, "1m": 1048576}
MODEL_ORDER = ("v4-flash", "v4-pro")


def parse_context(s: str) -> int:
    s = s.strip().lower()
    if s in CONTEXT_NAMES:
        return CONTEXT_NAMES[s]
    if s.endswith("k"):
        return int(float(s[:-1]) * 1024)
    if s.endswith("m"):
        return int(float(s[:-1]) * 1048576)
    return int(s)


def smoke_config():
    from vllm_dsv4_hw.config import DSV4Config

    return DSV4Config(name="smoke", hidden_size=256, num_heads=2, q_lora_rank=128, o_groups=2,
                      o_lora_rank=128, index_topk=32, compress_ratios=(0, 4, 128),
                      index_n_heads=8, max_position_embeddings=1024, vocab_size=512,
                      moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
                      num_hash_layers=1)


def model_config(name: str, layers: int | None):
    from vllm_dsv4_hw.config import load_config

    cfg = smoke_config() if name == "smoke" else load_config(name)
    if layers:
        if layers > cfg.num_layers:
            raise SystemExit(f"--layers {layers} > {cfg.num_layers} layers of {cfg.name}")
        cfg = cfg.with_layers(cfg.compress_ratios[:layers])
    return cfg


def _fmt(v, d=4):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{d}g}"
    return str(v)


def print_tables(data: dict) -> None:
    rows = data["rows"]
    print("\n== decode steps (ms; median of CUDA-event timed steps) ==")
    cols = ("model", "ctx", "B", "init", "graphs", "streams", "step_ms", "floor_ms", "x_floor",
            "tok_s", *KIND_NAMES, "meta_ms", "same")
    print(" | ".join(cols))
    for r in rows:
        pl = r.get("per_layer_ms", {})
        print(" | ".join(_fmt(v) for v in (
            r["model"], ctx_name(r["context"]), r["batch"], r["cache_init"],
            "on" if r["cuda_graphs"] else "off", "on" if r["multi_stream"] else "off",
            r.get("step_ms"), r.get("floor_ms"), r.get("x_floor"), r.get("tokens_per_s"),
            *(pl.get(k) for k in KIND_NAMES), r.get("meta_ms"),
            r.get("equal_to_first"))))
    if data["prefill"]:
        print("\n== chunked prefill ==")
        print("model | ctx | B | tokens | chunk | s | tokens/s")
        for p in data["prefill"]:
            print(" | ".join(_fmt(v) for v in (p["model"], ctx_name(p["context"]), p["batch"],
                                               p["tokens"], p["chunk_tokens"], p["seconds"],
                                               p["tokens_per_s"])))
    if data["kv"]:
        print("\n== KV bytes per sequence: measured pools vs plan_kv ==")
        print("model | ctx | B | measured B/seq | plan B/seq | rel diff | ok | fit 120GiB | "
              "fit device")
        for k in data["kv"]:
            print(" | ".join(_fmt(v) for v in (k["model"], ctx_name(k["context"]), k["batch"],
                                               int(k["measured_bytes_per_seq"]),
                                               k["plan_bytes_per_seq"], k["rel_diff"],
                                               k["ok_1pct"], k["fit_in_120gib"],
                                               k.get("fit_on_device"))))
    if data.get("network"):
        print("\n== whole network decode step (CUDA graphs; ms) ==")
        print(" | ".join(("model", "ctx", "B", "streams", "layers", "step_ms", *KIND_NAMES, "rest",
                          "full model ms", "tokens/s", "floor ms", "x floor",
                          "kernels/layer")))
        for r in data["network"]:
            pl = r["per_layer_ms"]
            kern = r.get("kernels_per_layer") or {}
            print(" | ".join(_fmt(v) for v in (
                r["model"], ctx_name(r["context"]), r["batch"],
                "on" if r.get("multi_stream", True) else "off", len(r["layers"]), r["step_ms"],
                *(pl.get(k) for k in KIND_NAMES), r["rest_ms"],
                r["full_model_step_ms"], r["full_model_tokens_per_s"],
                r.get("full_model_floor_ms"), r.get("x_floor"),
                "/".join(str(round(kern[k])) for k in KIND_NAMES if k in kern))))
    for v in data["verify"]:
        print(f"verify {v.get('model')} {v.get('what')}: ok={v.get('ok')} "
              f"{ {k: v[k] for k in v if k not in ('model', 'what', 'ok')} }"[:300])
    for s in data["skipped"]:
        print(f"skipped: {s}")
    for e in data["errors"]:
        print(f"ERROR: {e.get('where')}: {e.get('error')}")


# -- jobs -----------------------------------------------------------------------------------------
def plan_jobs(args) -> list[tuple[str, int, int]]:
    if args.smoke:
        return [("smoke", c, b) for c in args.contexts for b in args.batches]
    explicit = args.model is not None or args.contexts_given or args.batches_given
    models = [args.model] if args.model else list(MODEL_ORDER)
    jobs = []
    for m in models:
        ctxs = args.contexts
        bats = args.batches
        if m == "v4-pro" and not explicit:
            ctxs, bats = [CONTEXT_NAMES["1m"]], [1, 32]
        for c in ctxs:
            for b in bats:
                jobs.append((m, c, b))

    def prio(j):
        m, c, b = j
        tier = (0 if m == "v4-flash" else 1) if b <= 4 else (2 if m == "v4-flash" else 3)
        # the cheapest prefilled job of a tier first: it runs the verification (chunked vs
        # one-shot prefill, metadata) before the long rows
        return (tier, 0 if (c <= 8192 and b == 1) else 1, -c, b)

    return sorted(jobs, key=prio)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODEL_ORDER, default=None,
                    help="one model (default: the prioritized plan: Flash matrix, Pro 1M)")
    ap.add_argument("--contexts", default=None, help="e.g. 8k,128k,1m (default all three)")
    ap.add_argument("--batches", default=None, help="e.g. 1,4,32 (default); clamped to what fits")
    ap.add_argument("--layers", type=int, default=None,
                    help="first N layers of the model's pattern (quick runs)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per variant (32)")
    ap.add_argument("--reps", type=int, default=None, help="reps of per-kind / meta timings (10)")
    ap.add_argument("--graphs", default="on,off", help="CUDA graphs: on,off / on / off")
    ap.add_argument("--streams", default="on,off", help="multi-stream: on,off / on / off")
    ap.add_argument("--prefill-chunk", type=int, default=8192,
                    help="prefill tokens per step, all sequences together")
    ap.add_argument("--max-prefill-tokens", type=int, default=262144,
                    help="real prefill when batch * context <= this, else random valid fill")
    ap.add_argument("--no-prefill", action="store_true", help="random fill everywhere")
    ap.add_argument("--prefill-tail-chunks", type=int, default=0,
                    help="where the caches are randomly filled (1M): time this many prefill "
                         "chunks ending at the decode position over them")
    ap.add_argument("--prefill-streams", default="on", choices=("on", "off"),
                    help="multi-stream during prefill (eager, no graphs)")
    ap.add_argument("--verify", default="auto", choices=("auto", "on", "off"),
                    help="chunked vs one-shot prefill + metadata check on the first prefilled job "
                         "of each model (auto: on when its context <= 8K)")
    ap.add_argument("--verify-rtol", type=float, default=None,
                    help="relative tolerance of chunked vs one-shot (default 5e-2; smoke 1e-2)")
    ap.add_argument("--verify-max-context", type=int, default=8192,
                    help="verify only jobs up to this context (the one-shot prefill is one step)")
    ap.add_argument("--kv-format", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--indexer-format", default="mxfp4", choices=("mxfp4", "fp8", "bf16"))
    ap.add_argument("--reserve-gib", type=float, default=4.0,
                    help="device memory kept free for workspaces when sizing the batch")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no new variant after this many seconds")
    ap.add_argument("--indexer-select", default="auto", choices=("auto", "radix", "torch"),
                    help="indexer top-k selection: radix select kernels, torch.topk, or auto "
                         "(radix up to 1M scores per step and layer)")
    ap.add_argument("--bounded-select", default=None, choices=("on", "off"),
                    help="the radix top-k bounded to each token's visible entries, no score "
                         "stores past them (IndexerTuning.bounded; default: the product's, on)")
    ap.add_argument("--trim-walk", default=None, choices=("on", "off"),
                    help="sparse attention stops after each split's last compressed candidate "
                         "(SparseAttentionTuning.trim; default: the product's, on)")
    ap.add_argument("--weight-prefetch", type=int, default=None,
                    help="bytes of each weight row the GEMMs ask L2 for before their PDL wait "
                         "(VLLM_DSV4_HW_WEIGHT_PREFETCH; default: the setting's, 256)")
    ap.add_argument("--gemv-rows", type=int, default=None,
                    help="the FP8 linears' one-row GEMV for calls of up to this many rows "
                         "(LinearTuning.gemv_max_rows; default: the product's, 1)")
    ap.add_argument("--indexer-q", default=None, choices=("auto", "e4m3", "model"),
                    help="the indexer's query: e4m3 codes on FP8 dots or the model dtype "
                         "(VLLM_DSV4_HW_INDEXER_Q; default: the setting's, model)")
    ap.add_argument("--profile", action="store_true",
                    help="kernel tables per layer kind (torch.profiler; graph replay and eager)")
    ap.add_argument("--network", action="store_true",
                    help="also time the whole network (attention, mHC, MoE with FP4 experts, FP8 "
                         "linears, head) with --network-layers layers of each kind at "
                         "--network-contexts, extrapolated to the model's layer count")
    ap.add_argument("--network-only", action="store_true", help="only the --network rows")
    ap.add_argument("--network-layers", type=int, default=2)
    ap.add_argument("--network-contexts", default="128k,1m")
    ap.add_argument("--network-batches", default="1",
                    help="batches of the --network rows, e.g. 1,4,8 (each at every context)")
    ap.add_argument("--network-streams", default="on", choices=("on", "off"),
                    help="multi-stream in the --network rows (off: the side-stream branches inline)")
    ap.add_argument("--model-len", default=None,
                    help="positions the block tables and decode layouts span (vLLM's "
                         "--max-model-len: its tables cover the model length whatever the "
                         "context, the columns past a sequence unallocated); default: each "
                         "row's context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on CPU with the reference ops (checks the whole path)")
    args = ap.parse_args(argv)
    args.contexts_given = args.contexts is not None
    args.batches_given = args.batches is not None
    if args.smoke:
        args.device = args.device or "cpu"
        args.contexts = args.contexts or "512"
        args.batches = args.batches or "2"
        args.steps = args.steps or 3
        args.reps = args.reps or 2
        args.verify_max_context = max(args.verify_max_context, 1 << 20)
        args.verify_rtol = 1e-2 if args.verify_rtol is None else args.verify_rtol
        args.prefill_chunk = 512 if args.prefill_chunk == 8192 else args.prefill_chunk
        args.verify = "on" if args.verify == "auto" else args.verify
        args.budget_s = 1e9
    args.contexts = [parse_context(c) for c in (args.contexts or "1m,128k,8k").split(",")]
    args.network_contexts = [parse_context(c) for c in (
        "512" if args.smoke and args.network_contexts == "128k,1m" else
        args.network_contexts).split(",")]
    args.model_len = parse_context(args.model_len) if args.model_len else None
    if args.model_len is not None and args.model_len < max(args.contexts):
        raise SystemExit(f"--model-len {args.model_len} is below a context "
                         f"({max(args.contexts)}): the tables must cover every position")
    args.batches = [int(b) for b in (args.batches or "1,4,32").split(",")]
    args.steps = args.steps or 32
    args.reps = args.reps or 10
    args.prefill_streams = args.prefill_streams == "on"
    args.graphs = [{"on": True, "off": False}[g.strip()] for g in args.graphs.split(",")]
    args.streams = [{"on": True, "off": False}[s.strip()] for s in args.streams.split(",")]
    if args.verify == "auto":
        args.verify = min(args.contexts) <= 8192
    else:
        args.verify = args.verify == "on"
    if args.verify_rtol is None:
        args.verify_rtol = 5e-2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:  # tensors report cuda:N; keep one spelling
        dev = torch.device("cuda", torch.cuda.current_device())
    from benchmarks.vllm_state import single_rank
    from vllm_dsv4_hw.attention.indexer_query import e4m3_query
    from vllm_dsv4_hw.ops import REGISTRY

    if args.indexer_q is not None:  # read as the layers first score
        os.environ["VLLM_DSV4_HW_INDEXER_Q"] = args.indexer_q

    single_rank()  # the product's linears are vLLM layers: vLLM's parallel state, world size 1
    if args.weight_prefetch is not None:  # read at a device's first GEMM launch
        os.environ["VLLM_DSV4_HW_WEIGHT_PREFETCH"] = str(args.weight_prefetch)
    # the launch choices this run compares, for the rest of the run (ops.tuning: no module
    # global is assigned; unset flags keep the product's values)
    chosen = tuning.current()
    ix = dataclasses.replace(chosen.indexer, select=args.indexer_select,
                             **({} if args.bounded_select is None
                                else {"bounded": args.bounded_select == "on"}))
    sa = chosen.sparse_attention if args.trim_walk is None else tuning.SparseAttentionTuning(
        trim=args.trim_walk == "on")
    lin = chosen.linear if args.gemv_rows is None else tuning.LinearTuning(
        gemv_max_rows=args.gemv_rows)
    contextlib.ExitStack().enter_context(
        tuning.override(indexer=ix, sparse_attention=sa, linear=lin))
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    from vllm_dsv4_hw.quant.linear import e4m3_activations

    meta = {
        "schema": "decode_stack/1",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
        "host": platform.node(), "device": str(dev), "torch": torch.__version__,
        "triton": triton_version,
        "command": "python -m benchmarks.decode_stack " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "smoke": bool(args.smoke),
        "settings": {"steps": args.steps, "reps": args.reps, "layers": args.layers,
                     "model_len": args.model_len,
                     "prefill_chunk": args.prefill_chunk,
                     "max_prefill_tokens": args.max_prefill_tokens,
                     "kv_format": args.kv_format, "indexer_format": args.indexer_format,
                     "activation_dtype": "bfloat16", "weights": "as shipped (FP8 128x128 linears)",
                     "fp8_linear_activations": "e4m3 (W8A8)" if e4m3_activations(dev)
                     else "model dtype (W8A16)",
                     "indexer_select": args.indexer_select,
                     "bounded_select": args.bounded_select, "trim_walk": args.trim_walk,
                     "weight_prefetch": args.weight_prefetch, "gemv_rows": args.gemv_rows,
                     "indexer_q": "e4m3 codes (FP8 dots)" if e4m3_query(dev) else "model dtype",
                     "left_out": ["MoE (routed + shared experts)", "mHC hyper-connections",
                                  "embedding / LM head", "MTP layer"]},
        "ops": {op: f"{b} ({why})" for op, b, why in REGISTRY.explain(dev)},
    }
    report = Report(os.path.join(args.out, "decode_stack.json"), meta)
    runner = Runner(args, report, dev)
    jobs = plan_jobs(args)
    logger.info("jobs: %s", [(m, ctx_name(c), b) for m, c, b in jobs])
    rc = 0

    def _term(signum, frame):  # a timeout's SIGTERM: still print what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    old_handler = signal.signal(signal.SIGTERM, _term)
    old_ms = os.environ.get("VLLM_DSV4_HW_MULTI_STREAM")
    try:
        if args.network or args.network_only:
            from benchmarks.stack.network_run import run_network_rows

            try:
                run_network_rows(args, dev, report, "smoke" if args.smoke else
                                 (args.model or "v4-flash"), args.network_contexts,
                                 [int(b) for b in args.network_batches.split(",")])
            except Exception as exc:
                traceback.print_exc()
                report.add("errors", {"where": "network", "error": f"{type(exc).__name__}: {exc}"
                                      [:2000]})
        for m, c, b in ([] if args.network_only else jobs):
            if runner.left_s() < 0:
                report.data["skipped"].append(f"{m} {ctx_name(c)} B={b}: time budget")
                report.write()
                continue
            try:
                runner.run_job(m, c, b)
            except Exception as exc:
                traceback.print_exc()
                report.add("errors", {"where": f"{m} {ctx_name(c)} B={b}",
                                      "error": error_text(exc)})
                rc = 1
                if dev.type == "cuda":
                    gc.collect()
                    torch.cuda.empty_cache()
    except KeyboardInterrupt as exc:
        report.data["errors"].append({"where": "run", "error": f"interrupted: {exc}"})
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, old_handler)
        if old_ms is None:
            os.environ.pop("VLLM_DSV4_HW_MULTI_STREAM", None)
        else:
            os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = old_ms
        report.data["wall_s"] = round(time.time() - runner.t_start, 1)
        report.write()
        print_tables(report.data)
    if report.data["errors"] or not all(v.get("ok") for v in report.data["verify"]) or \
            not all(k["ok_1pct"] for k in report.data["kv"]):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
