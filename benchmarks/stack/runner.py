# SPDX-License-Identifier: Apache-2.0
"""The jobs of ``benchmarks.decode_stack``: build the product's attention stack, fill or prefill
its pools, verify chunked against one-shot prefill, and time decode steps (graphs / streams)."""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback

import torch

from benchmarks.stack.timing import Report, Timer, capture_cuda_graph, error_text, median

logger = logging.getLogger("decode_stack")
GIB = 1 << 30


def ctx_name(n: int) -> str:
    if n % 1048576 == 0:
        return f"{n // 1048576}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


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
        self.chunk_seconds: list[float] = []
        self.prefill_profile: dict | None = None

    def set_streams(self, on: bool):
        """Multi-stream on / off through the typed setting (VLLM_DSV4_HW_MULTI_STREAM): the layers
        take the process's shared branch streams for it (``platform.streams.aux_streams``)."""
        from vllm_dsv4_hw.platform.streams import aux_streams

        os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1" if on else "0"
        return aux_streams(self.device)

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
        from benchmarks.decode_stack import model_config

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
        from benchmarks.stack.decode_inputs import DecodeInputs
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
                             seed=args.seed, model_len=getattr(args, "model_len", None))
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
        dm = DecodeInputs(caches, self.device)
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
            if args.prefill_tail_chunks:
                self.prefill(model, caches, p0, args.prefill_chunk, args.prefill_tail_chunks)

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
                                               "error": error_text(exc)})
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
                    time_it: bool = True, first: int = 0):
        """Chunked prefill of positions first..p0-1 of every sequence (``chunk_per_seq`` new
        tokens of each sequence per step) into ``caches``. Returns (seconds, output of the last
        chunk [B, n, hidden], scratch bytes per sequence). ``first`` > 0 (the 1M figure): the
        full-kind caches already hold random valid entries for the positions before it, so each
        chunk reads a cache of the real length."""
        from vllm_dsv4_hw.attention.metadata import build_step_metadata

        stack = self.stack
        b = caches.batch
        self.set_streams(self.args.prefill_streams)
        pf = caches.prefill_caches(chunk_per_seq)
        starts = list(range(first, p0, chunk_per_seq))

        def chunk(s0):
            n = min(chunk_per_seq, p0 - s0)
            metas = {r: build_step_metadata([s0] * b, [n] * b, r, pf.tables[r],
                                            pf.layouts[r].geometry, caches.cfg.sliding_window)
                     for r in pf.layouts}
            x = xs[:, s0 - first:s0 - first + n].reshape(b * n, -1)
            return stack.run(x, metas, pf.layers), n

        if time_it and self.device.type != "cpu":
            # compile / warm up (they rewrite the same slots when timed below); a shorter last
            # chunk is another Triton specialization (lengths not divisible by 16), compiled once
            # per process in serving too: warmed up here so the timed figure is the steady state
            for s0 in {starts[0], starts[-1]}:
                chunk(s0)
        self.timer.sync()
        t0 = time.time()
        out = None
        chunk_s = []  # per-chunk seconds (a sync per chunk: chunks take ~1 s, the sync is noise)
        for s0 in starts:
            c0 = time.time()
            out, n = chunk(s0)
            if time_it:
                self.timer.sync()
                chunk_s.append(time.time() - c0)
        self.timer.sync()
        secs = time.time() - t0
        self.chunk_seconds = chunk_s
        self.prefill_first = first
        if time_it and self.args.profile and self.device.type == "cuda":
            # the last chunk (longest context) again: it rewrites the same slots with the same
            # values, so the caches the decode phase reads are unchanged
            from benchmarks.stack.profile import kernel_table, print_table

            tab = kernel_table(lambda: chunk(starts[-1]), reps=1, warmup=0)
            self.prefill_profile = tab
            print_table(f"prefill chunk at {starts[-1]} ({chunk_per_seq} tokens x {b})", tab,
                        top=60)
        caches.migrate_windows(pf, p0)
        scratch = pf.allocated_bytes() / b
        return secs, out.view(b, -1, out.shape[-1]), scratch

    def prefill(self, model, caches, p0: int, chunk_tokens: int, tail_chunks: int = 0):
        """Time a chunked prefill to ``p0``: all of it, or (``tail_chunks`` > 0, over randomly
        filled caches) only its last ``tail_chunks`` chunks."""
        b = caches.batch
        per_seq = max(1, min(p0, chunk_tokens // b))
        first = max(0, p0 - tail_chunks * per_seq) if tail_chunks else 0
        xs = self._prefill_inputs(b, p0 - first, caches.cfg.hidden_size)
        secs, out, scratch = self.run_prefill(caches, p0, per_seq, xs, first=first)
        n_tok = b * (p0 - first)
        row = {"model": model, "context": caches.context, "batch": b, "tokens": n_tok,
               "first_position": first, "cache_before_first": "random valid" if first else None,
               "chunk_tokens": per_seq * b, "chunk_per_seq": per_seq, "seconds": round(secs, 3),
               "tokens_per_s": n_tok / secs, "inflight_scratch_bytes_per_seq": scratch,
               "multi_stream": self.args.prefill_streams, "cuda_graphs": False,
               "chunk_seconds": [round(c, 4) for c in getattr(self, "chunk_seconds", [])],
               "profile_last_chunk": getattr(self, "prefill_profile", None)}
        self.prefill_profile = None
        self.report.add("prefill", row)
        logger.info("prefill %s %s B=%d: %d tokens from %d in %.2f s = %.0f tokens/s (chunk %d/seq)",
                    model, ctx_name(caches.context), b, n_tok, first, secs, n_tok / secs, per_seq)
        del xs
        return out, per_seq

    # -- verification -----------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self, model, caches, dm, p0, h_in, chunked_last, main_chunk):
        """The timed prefill (``main_chunk`` tokens per sequence and step) against a second
        prefill of the same prompt into fresh caches with another chunking (one step if the timed
        one was chunked, else 3 chunks of an odd size), then two decode steps on both. (The
        graph-safe decode metadata is checked against the general builder by the conformance
        kit's ``decode_metadata`` cases and ``tests/attention/test_decode_metadata.py``.)"""
        from benchmarks.stack.decode_inputs import DecodeInputs
        from benchmarks.stack.pools import StackCaches

        cfg = self.stack.cfg
        b = caches.batch
        c = caches.context
        ok = True
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
            d = DecodeInputs(cc, self.device)
            o = []
            for s in range(2):
                d.set_position(p0 + s)
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
            dm.advance()

        kinds: dict[str, list[int]] = {}
        for i, layer in enumerate(stack.layers):
            kinds.setdefault(layer.kind.name, []).append(i)

        graphs_held = []
        caches.restore_windows(self.snap)
        dm.set_position(p0)
        if graphs:
            g, static_out = capture_cuda_graph(step)
            graphs_held.append(g)
            dm.set_position(p0)
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
            dm.set_position(p0)
            res = {}

            def eager():
                res["out"] = step()

            times = self.timer.loop(eager, args.steps, between=advance)
            out = res["out"]
            meta_ms = median(self.timer.loop(dm.derive, args.reps))
        last_pos = p0 + args.steps - 1

        # per layer kind: all layers of the kind back to back at a fixed position
        caches.restore_windows(self.snap)
        dm.set_position(p0)
        metas = dm.derive()
        per_layer = {}
        row_profile: dict = {}
        for k, ids in kinds.items():
            if graphs:
                gk, _ = capture_cuda_graph(lambda ids=ids: stack.run(h_in, metas, layers, ids),
                                           warmups=1)
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
            "model": model, "context": caches.context, "model_len": caches.model_len,
            "batch": b, "cuda_graphs": graphs,
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


