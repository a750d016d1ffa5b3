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
* ``models`` weights per layer kind, ``fp8_gemm`` (path and probes), ``skipped``, ``errors``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import signal
import sys
import time
import traceback

import torch

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


def ctx_name(n: int) -> str:
    if n % 1048576 == 0:
        return f"{n // 1048576}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def smoke_config():
    from vllm_dsv4_hw.config import DSV4Config

    return DSV4Config(name="smoke", hidden_size=256, num_heads=2, q_lora_rank=128, o_groups=2,
                      o_lora_rank=128, index_topk=32, compress_ratios=(0, 4, 128),
                      index_n_heads=8, max_position_embeddings=1024)


def model_config(name: str, layers: int | None):
    from vllm_dsv4_hw.config import load_config

    cfg = smoke_config() if name == "smoke" else load_config(name)
    if layers:
        if layers > cfg.num_layers:
            raise SystemExit(f"--layers {layers} > {cfg.num_layers} layers of {cfg.name}")
        cfg = cfg.with_layers(cfg.compress_ratios[:layers])
    return cfg


# -- timing -----------------------------------------------------------------------------------------
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


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# -- the report -------------------------------------------------------------------------------------
class Report:
    def __init__(self, path: str, meta: dict) -> None:
        self.path = path
        self.data = dict(meta, rows=[], prefill=[], kv=[], verify=[], models={}, skipped=[],
                         errors=[])

    def add(self, key: str, row: dict) -> None:
        self.data[key].append(row)
        self.write()

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


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
            "tok_s", "window", "c4a", "c128a", "meta_ms", "same")
    print(" | ".join(cols))
    for r in rows:
        pl = r.get("per_layer_ms", {})
        print(" | ".join(_fmt(v) for v in (
            r["model"], ctx_name(r["context"]), r["batch"], r["cache_init"],
            "on" if r["cuda_graphs"] else "off", "on" if r["multi_stream"] else "off",
            r.get("step_ms"), r.get("floor_ms"), r.get("x_floor"), r.get("tokens_per_s"),
            pl.get("window"), pl.get("c4a"), pl.get("c128a"), r.get("meta_ms"),
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


class Runner:
    def __init__(self, args, report: Report, device: torch.device) -> None:
        self.args = args
        self.report = report
        self.device = device
        self.timer = Timer(device)
        self.t_start = time.time()
        self.stack = None
        self.model = None
        self.verified_models: set[str] = set()

    def set_streams(self, on: bool):
        """Multi-stream on / off through the typed setting (VLLM_DSV4_HW_MULTI_STREAM), with one
        AuxStreams (one pair of branch streams) shared by every layer of the stack."""
        from vllm_dsv4_hw.platform.streams import AuxStreams

        os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1" if on else "0"
        aux = AuxStreams(self.device, num_branches=2)  # reads VLLM_DSV4_HW_MULTI_STREAM
        for layer in self.stack.layers:
            layer._aux = aux
        return aux

    # -- budget ---------------------------------------------------------------------------------
    def left_s(self) -> float:
        return self.args.budget_s - (time.time() - self.t_start)

    # -- model ----------------------------------------------------------------------------------
    def load_model(self, name: str):
        from benchmarks.stack.model import AttentionStack

        if self.model == name:
            return self.stack
        from vllm_dsv4_hw.attention import layer as layer_mod

        self.stack = None
        layer_mod._shared_rope_table.cache_clear()  # the previous model's RoPE tables
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = model_config(name, self.args.layers)
        t0 = time.time()
        max_pos = cfg.max_position_embeddings
        self.stack = AttentionStack(cfg, self.device, max_positions=max_pos, seed=self.args.seed)
        self.model = name
        self.timer.sync()
        info = {"layers": cfg.num_layers, "kinds": self.stack.kinds(),
                "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                "weight_bytes_total": self.stack.total_weight_bytes(),
                "weight_bytes_per_layer": self.stack.weight_bytes_by_kind(),
                "build_s": round(time.time() - t0, 2)}
        self.report.data["models"][name] = info
        self.report.write()
        logger.info("built %s: %d layers %s, weights %.2f GiB (%.1f s)", name, cfg.num_layers,
                    info["kinds"], info["weight_bytes_total"] / GIB, info["build_s"])
        return self.stack

    # -- one job ----------------------------------------------------------------------------------
    def run_job(self, model: str, context: int, batch: int) -> None:
        from benchmarks.stack.decode_meta import DecodeMeta
        from benchmarks.stack.pools import StackCaches
        from vllm_dsv4_hw.kv_cache.sizing import plan_kv

        args = self.args
        stack = self.load_model(model)
        cfg = stack.cfg
        if context > cfg.max_position_embeddings:
            self.report.data["skipped"].append(f"{model} {ctx_name(context)}: beyond "
                                               f"max_position_embeddings")
            return
        plan = plan_kv(cfg, context, args.kv_format, args.indexer_format, memory_bytes=120 * GIB)
        fit_dev = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            free, _ = torch.cuda.mem_get_info()
            fit_dev = int(max(0, free - args.reserve_gib * GIB) // plan.allocated_bytes)
        b = min(batch, plan.max_sequences)
        if fit_dev is not None:
            b = min(b, fit_dev)
        if b < 1:
            self.report.data["skipped"].append(f"{model} {ctx_name(context)} B={batch}: no "
                                               f"sequence fits")
            self.report.write()
            return
        if b != batch:
            logger.info("%s %s: batch %d clamped to %d (fit 120 GiB: %d, device: %s)", model,
                        ctx_name(context), batch, b, plan.max_sequences, fit_dev)
        steps = args.steps
        p0 = context - steps - 1
        if p0 < 1:
            raise SystemExit(f"context {context} too small for {steps} steps")
        logger.info("== %s ctx %s batch %d: plan %.4f GiB/seq allocated, %d fit in 120 GiB",
                    model, ctx_name(context), b, plan.allocated_bytes / GIB, plan.max_sequences)

        caches = StackCaches(cfg, b, context, self.device, args.kv_format, args.indexer_format,
                             seed=args.seed)
        kv = caches.kv_check()
        fit_measured = int(120 * GIB // kv["measured_bytes_per_seq"])
        kv.update(model=model, batch_requested=batch, fit_on_device=fit_dev,
                  allocated_gib_total=caches.allocated_bytes() / GIB,
                  fit_by_measured_bytes=fit_measured,
                  fit_agrees=fit_measured == plan.max_sequences)
        self.report.add("kv", kv)
        logger.info("kv: measured %d B/seq vs plan %d (rel %.2e) ok=%s; allocated %.2f GiB for %d "
                    "seqs; 120 GiB holds %d sequences by plan_kv, %d by the measured bytes",
                    kv["measured_bytes_per_seq"], kv["plan_bytes_per_seq"], kv["rel_diff"],
                    kv["ok_1pct"], kv["allocated_gib_total"], b, plan.max_sequences,
                    fit_measured)

        # -- cache contents -----------------------------------------------------------------------
        do_prefill = (b * p0 <= args.max_prefill_tokens) and not args.no_prefill
        dm = DecodeMeta(caches, self.device, impl=args.meta_impl)
        h_in = torch.randn(b, cfg.hidden_size, device=self.device,
                           generator=torch.Generator(device=self.device).manual_seed(7)
                           ).to(torch.bfloat16)
        if do_prefill:
            last_chunk_out, main_chunk = self.prefill(model, caches, p0, args.prefill_chunk)
            init = "prefill"
        else:
            t0 = time.time()
            caches.fill_random(seed=args.seed)
            self.timer.sync()
            logger.info("random valid fill: %.1f s", time.time() - t0)
            init = "random_fill"
            last_chunk_out, main_chunk = None, None

        # every decode phase below starts at p0 from these windowed pages (rings only hold the
        # last W positions of positions that advance)
        self.snap = caches.snapshot_windows()
        want_verify = (args.verify and model not in self.verified_models and do_prefill
                       and context <= args.verify_max_context)
        if want_verify:
            self.verified_models.add(model)
            self.verify(model, caches, dm, p0, h_in, last_chunk_out, main_chunk)

        # -- decode variants ----------------------------------------------------------------------
        first_out = None
        graph_opts = [True, False] if self.device.type == "cuda" else [False]
        graph_opts = [g for g in graph_opts if g in args.graphs]
        for graphs in graph_opts:
            for streams in args.streams:
                if self.left_s() < 0:
                    self.report.data["skipped"].append(
                        f"{model} {ctx_name(context)} B={b} graphs={graphs} streams={streams}: "
                        f"time budget")
                    self.report.write()
                    continue
                try:
                    row, out = self.decode_variant(model, caches, dm, p0, h_in, graphs, streams)
                except Exception as exc:
                    traceback.print_exc()
                    self.report.add("errors", {"where": f"{model} {ctx_name(context)} B={b} "
                                                        f"graphs={graphs} streams={streams}",
                                               "error": f"{type(exc).__name__}: {exc}"[:2000]})
                    continue
                if first_out is None:
                    first_out = out
                    row["max_abs_diff_vs_first"] = 0.0
                    row["equal_to_first"] = True
                else:
                    d = (out.float() - first_out.float()).abs().max().item()
                    row["max_abs_diff_vs_first"] = d
                    row["equal_to_first"] = bool(torch.equal(out, first_out))
                row.update(cache_init=init, batch_requested=batch)
                self.report.add("rows", row)
                logger.info("%s %s B=%d graphs=%s streams=%s: step %.3f ms (floor %.3f, x%.2f) "
                            "per layer %s meta %.3f ms same=%s", model, ctx_name(context), b,
                            graphs, streams, row["step_ms"], row["floor_ms"], row["x_floor"],
                            {k: round(v, 4) for k, v in row["per_layer_ms"].items()},
                            row["meta_ms"], row["equal_to_first"])
        del caches, dm
        self.snap = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill_inputs(self, b, p0, hidden, seed=11):
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(b, p0, hidden, device=self.device, generator=gen, dtype=torch.bfloat16)

    @torch.no_grad()
    def run_prefill(self, caches, p0: int, chunk_per_seq: int, xs: torch.Tensor,
                    time_it: bool = True):
        """Chunked prefill of positions 0..p0-1 of every sequence (``chunk_per_seq`` new tokens
        of each sequence per step) into ``caches``. Returns (seconds, output of the last chunk
        [B, n, hidden], scratch bytes per sequence)."""
        from vllm_dsv4_hw.attention.metadata import build_step_metadata

        stack = self.stack
        b = caches.batch
        self.set_streams(self.args.prefill_streams)
        pf = caches.prefill_caches(chunk_per_seq)
        starts = list(range(0, p0, chunk_per_seq))

        def chunk(s0):
            n = min(chunk_per_seq, p0 - s0)
            metas = {r: build_step_metadata([s0] * b, [n] * b, r, pf.tables[r],
                                            pf.layouts[r].geometry, caches.cfg.sliding_window)
                     for r in pf.layouts}
            x = xs[:, s0:s0 + n].reshape(b * n, -1)
            return stack.run(x, metas, pf.layers), n

        if time_it and self.device.type != "cpu":
            chunk(starts[0])  # compile / warm up; rewrites the same slots when timed below
        self.timer.sync()
        t0 = time.time()
        out = None
        for s0 in starts:
            out, n = chunk(s0)
        self.timer.sync()
        secs = time.time() - t0
        caches.migrate_windows(pf, p0)
        scratch = pf.allocated_bytes() / b
        return secs, out.view(b, -1, out.shape[-1]), scratch

    def prefill(self, model, caches, p0: int, chunk_tokens: int):
        b = caches.batch
        per_seq = max(1, min(p0, chunk_tokens // b))
        xs = self._prefill_inputs(b, p0, caches.cfg.hidden_size)
        secs, out, scratch = self.run_prefill(caches, p0, per_seq, xs)
        row = {"model": model, "context": caches.context, "batch": b, "tokens": b * p0,
               "chunk_tokens": per_seq * b, "chunk_per_seq": per_seq, "seconds": round(secs, 3),
               "tokens_per_s": b * p0 / secs, "inflight_scratch_bytes_per_seq": scratch,
               "multi_stream": self.args.prefill_streams, "cuda_graphs": False}
        self.report.add("prefill", row)
        logger.info("prefill %s %s B=%d: %d tokens in %.2f s = %.0f tokens/s (chunk %d/seq)",
                    model, ctx_name(caches.context), b, b * p0, secs, b * p0 / secs, per_seq)
        del xs
        return out, per_seq

    # -- verification -----------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self, model, caches, dm, p0, h_in, chunked_last, main_chunk):
        """The timed prefill (``main_chunk`` tokens per sequence and step) against a second
        prefill of the same prompt into fresh caches with another chunking (one step if the timed
        one was chunked, else 3 chunks of an odd size), and the graph-safe metadata against the
        general builder."""
        from benchmarks.stack.decode_meta import DecodeMeta, check_against_builder
        from benchmarks.stack.pools import StackCaches

        cfg = self.stack.cfg
        b = caches.batch
        # 1. metadata at positions that complete c4a / c128a groups and ones that do not
        c = caches.context
        cands = [p0, (p0 // 4) * 4 + 3, (p0 // 128) * 128 + 127, c - 1, p0 + 1]
        cands = [p for p in cands if 0 <= p < c]
        results = []
        for shift in range(len(cands)):
            pos = [cands[(shift + r) % len(cands)] for r in range(b)]
            results.append(check_against_builder(dm, pos))
        ok = all(r["ok"] for r in results)
        self.report.add("verify", {"model": model, "what": "decode_meta_vs_builder", "ok": ok,
                                   "impl": dm.impl, "context": c, "batch": b,
                                   "mismatches": [m for r in results for m in r["mismatches"]]})
        if dm.impl == "triton":  # the torch variant too
            dmt = DecodeMeta(caches, self.device, impl="torch")
            res_t = [check_against_builder(dmt, r["positions"]) for r in results]
            self.report.add("verify", {"model": model, "what": "decode_meta_torch_vs_builder",
                                       "ok": all(r["ok"] for r in res_t)})
        # 2. the same prompt with another chunking into fresh caches (another page order), then
        #    two decode steps on both
        alt_chunk = p0 if main_chunk < p0 else p0 // 3 + 1
        xs = self._prefill_inputs(b, p0, cfg.hidden_size)
        other = StackCaches(cfg, b, c, self.device, caches.main_format, caches.indexer_format,
                            seed=self.args.seed + 1)
        _, other_last, _ = self.run_prefill(other, p0, alt_chunk, xs, time_it=False)
        del xs
        n_last = min(chunked_last.shape[1], other_last.shape[1])
        a = chunked_last[:, -n_last:].float()
        e = other_last[:, -n_last:].float()
        pre_err = ((a - e).abs().max() / e.abs().max()).item()
        outs = []
        caches.restore_windows(self.snap)
        for cc in (caches, other):
            d = DecodeMeta(cc, self.device, impl=dm.impl)
            o = []
            for s in range(2):
                d.positions.fill_(p0 + s)
                o.append(self.stack.run(h_in, d.derive(), cc.layers))
            outs.append(torch.stack(o))
        dec_err = ((outs[0].float() - outs[1].float()).abs().max()
                   / outs[1].float().abs().max()).item()
        finite = bool(torch.isfinite(outs[0]).all()) and bool(torch.isfinite(a).all())
        tol = self.args.verify_rtol
        row = {"model": model, "what": "chunked_vs_oneshot_prefill", "context": c, "batch": b,
               "prefill_tokens_per_seq": p0, "chunk_per_seq": main_chunk,
               "other_chunk_per_seq": alt_chunk, "compared_tokens_per_seq": n_last,
               "last_chunk_rel_err": pre_err,
               "decode_rel_err": dec_err, "finite": finite, "rtol": tol,
               "ok": finite and pre_err <= tol and dec_err <= tol}
        self.report.add("verify", row)
        logger.info("verify %s: meta ok=%s; prefill chunks %d vs %d per seq: last tokens %.2e, "
                    "decode %.2e (rtol %.0e) finite=%s", model, ok, main_chunk, alt_chunk,
                    pre_err, dec_err, tol, finite)
        del other
        gc.collect()

    # -- decode -----------------------------------------------------------------------------------
    def profile_kind(self, out: dict, kind: str, replay, eager, n_layers: int) -> None:
        """Kernel tables of the layers of one kind (graph replay and eager), per layer."""
        from benchmarks.stack.profile import kernel_table, print_table

        for mode, fn in (("graph", replay), ("eager", eager)):
            tab = kernel_table(fn, reps=3)
            for key in ("wall_us", "busy_us", "launches"):
                tab[key] /= n_layers
            for r in tab["kernels"]:
                r["launches"] /= n_layers
                r["us_per_call"] /= n_layers
            out.setdefault(kind, {})[mode] = tab
            print_table(f"{kind} layer, {mode} (per layer, {n_layers} layers)", tab)

    @torch.no_grad()
    def decode_variant(self, model, caches, dm, p0, h_in, graphs: bool, streams: bool):
        from benchmarks.stack.floor import floor_for
        from benchmarks.stack.model import KIND_NAMES

        args = self.args
        stack = self.stack
        cfg = stack.cfg
        dev = self.device
        b = caches.batch
        aux = self.set_streams(streams)
        layers = caches.layers

        def step():
            return stack.run(h_in, dm.derive(), layers)

        def advance():
            dm.positions.add_(1)

        kinds: dict[str, list[int]] = {}
        for i, layer in enumerate(stack.layers):
            kinds.setdefault(KIND_NAMES[layer.ratio], []).append(i)

        graphs_held = []
        caches.restore_windows(self.snap)
        dm.positions.fill_(p0)
        if graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = step()
            graphs_held.append(g)
            dm.positions.fill_(p0)
            caches.restore_windows(self.snap)
            times = self.timer.loop(g.replay, args.steps, between=advance)
            out = static_out.clone()
            # metadata alone
            gm = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gm):
                dm.derive()
            graphs_held.append(gm)
            meta_ms = median(self.timer.loop(gm.replay, args.reps))
        else:
            for _ in range(2 if dev.type != "cpu" else 0):
                step()  # warm-up (compile) at p0: rewrites the same slots
            dm.positions.fill_(p0)
            res = {}

            def eager():
                res["out"] = step()

            times = self.timer.loop(eager, args.steps, between=advance)
            out = res["out"]
            meta_ms = median(self.timer.loop(dm.derive, args.reps))
        last_pos = p0 + args.steps - 1

        # per layer kind: all layers of the kind back to back at a fixed position
        caches.restore_windows(self.snap)
        dm.positions.fill_(p0)
        metas = dm.derive()
        per_layer = {}
        row_profile: dict = {}
        for k, ids in kinds.items():
            if graphs:
                gk = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    stack.run(h_in, metas, layers, ids)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(gk):
                    stack.run(h_in, metas, layers, ids)
                graphs_held.append(gk)
                t = self.timer.loop(gk.replay, args.reps)
                if args.profile:
                    self.profile_kind(row_profile, k, gk.replay,
                                      lambda ids=ids: stack.run(h_in, metas, layers, ids),
                                      len(ids))
            else:
                if dev.type != "cpu":
                    stack.run(h_in, metas, layers, ids)  # warm-up
                t = self.timer.loop(lambda ids=ids: stack.run(h_in, metas, layers, ids), args.reps)
            per_layer[k] = median(t) / len(ids)
        del graphs_held
        finite = bool(torch.isfinite(out).all())
        fl = floor_for(cfg, stack.weight_bytes_by_kind(), b, caches.context, caches.main_format,
                       caches.indexer_format)
        step_ms = median(times)
        row = {
            "model": model, "context": caches.context, "batch": b, "cuda_graphs": graphs,
            "multi_stream": streams, "streams_parallel": aux.parallel,
            "decode_positions": [p0, last_pos], "steps": args.steps,
            "step_ms": step_ms, "step_ms_mean": sum(times) / len(times),
            "step_ms_min": min(times), "step_ms_max": max(times),
            "tokens_per_s": b / (step_ms * 1e-3),
            "per_layer_ms": per_layer, "meta_ms": meta_ms,
            "floor_ms": fl["floor_ms"], "floor_bytes": fl["bytes"],
            "floor_total_bytes": fl["total_bytes"], "x_floor": step_ms / fl["floor_ms"],
            "per_layer_floor_ms": {k: v["floor_ms"] for k, v in fl["per_layer"].items()},
            "per_layer_x_floor": {k: per_layer[k] / v["floor_ms"]
                                  for k, v in fl["per_layer"].items() if k in per_layer},
            "finite": finite,
            "profile": row_profile or None,
            "peak_gib": (torch.cuda.max_memory_allocated() / GIB if dev.type == "cuda" else None),
        }
        return row, out


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
    ap.add_argument("--fp8-gemm", default="auto", choices=("auto", "triton", "scaled_mm",
                                                           "dequant"))
    ap.add_argument("--meta-impl", default="triton", choices=("triton", "torch"),
                    help="decode metadata derivation (triton: 5 launches; CPU always torch)")
    ap.add_argument("--prefill-chunk", type=int, default=8192,
                    help="prefill tokens per step, all sequences together")
    ap.add_argument("--max-prefill-tokens", type=int, default=262144,
                    help="real prefill when batch * context <= this, else random valid fill")
    ap.add_argument("--no-prefill", action="store_true", help="random fill everywhere")
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
    ap.add_argument("--profile", action="store_true",
                    help="kernel tables per layer kind (torch.profiler; graph replay and eager)")
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
        args.fp8_gemm = "dequant" if args.fp8_gemm == "auto" else args.fp8_gemm
        args.verify = "on" if args.verify == "auto" else args.verify
        args.budget_s = 1e9
    args.contexts = [parse_context(c) for c in (args.contexts or "1m,128k,8k").split(",")]
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
    from benchmarks.stack import fp8

    from vllm_dsv4_hw.ops.triton import indexer as triton_indexer

    triton_indexer.SELECT["impl"] = args.indexer_select
    gemm = fp8.set_gemm(args.fp8_gemm)
    gemm.resolve(dev)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
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
                     "prefill_chunk": args.prefill_chunk,
                     "max_prefill_tokens": args.max_prefill_tokens,
                     "kv_format": args.kv_format, "indexer_format": args.indexer_format,
                     "meta_impl": args.meta_impl, "activation_dtype": "bfloat16",
                     "indexer_select": args.indexer_select,
                     "left_out": ["MoE (routed + shared experts)", "mHC hyper-connections",
                                  "embedding / LM head", "MTP layer"]},
        "fp8_gemm": gemm.describe(),
    }
    report = Report(os.path.join(args.out, "decode_stack.json"), meta)
    logger.info("fp8 gemm: %s", gemm.describe())
    runner = Runner(args, report, dev)
    jobs = plan_jobs(args)
    logger.info("jobs: %s", [(m, ctx_name(c), b) for m, c, b in jobs])
    rc = 0

    def _term(signum, frame):  # a timeout's SIGTERM: still print what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    old_handler = signal.signal(signal.SIGTERM, _term)
    old_ms = os.environ.get("VLLM_DSV4_HW_MULTI_STREAM")
    try:
        for m, c, b in jobs:
            if runner.left_s() < 0:
                report.data["skipped"].append(f"{m} {ctx_name(c)} B={b}: time budget")
                report.write()
                continue
            try:
                runner.run_job(m, c, b)
            except Exception as exc:
                traceback.print_exc()
                report.add("errors", {"where": f"{m} {ctx_name(c)} B={b}",
                                      "error": f"{type(exc).__name__}: {exc}"[:2000]})
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
        report.data["fp8_gemm"] = gemm.describe()
        report.write()
        print_tables(report.data)
    if report.data["errors"] or not all(v.get("ok") for v in report.data["verify"]) or \
            not all(k["ok_1pct"] for k in report.data["kv"]):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
