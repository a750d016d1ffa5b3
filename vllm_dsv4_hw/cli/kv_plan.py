# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw kv-plan``: KV cache bytes per sequence, page buckets, padding, capacity."""

from __future__ import annotations

import argparse
import json
import logging
import re

from vllm_dsv4_hw.cli.device_arg import HELP_TARGETS, apply_device, parse_device
from vllm_dsv4_hw.cli.main import CLIError
from vllm_dsv4_hw.config import PRESETS, load_config
from vllm_dsv4_hw.envs import INDEXER_KV_FORMATS, MAIN_KV_FORMATS
from vllm_dsv4_hw.kv_cache.sizing import (
    BASELINE_V32_BYTES_PER_TOKEN_LAYER,
    GIB,
    KVPlan,
    KVPlanError,
    plan_kv,
)

logger = logging.getLogger(__name__)

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20}


def parse_context(text: str) -> int:
    """Tokens: an integer, optionally with a binary suffix (128k = 131072, 1M = 1048576)."""
    m = re.fullmatch(r"\s*([+-]?[0-9][0-9_]*)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (an integer, optionally with suffix k or M)"
        )
    return int(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).lower()]


def parse_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"memory must be a positive number of GiB, got {text}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kv-plan",
        help="KV cache bytes per sequence for a model, context and cache formats",
        description="Size the KV cache of one sequence: per cache kind, page buckets, padding, "
        "the V3.2-style baseline, and how many sequences fit in --memory GiB.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"preset ({', '.join(PRESETS)}) or a path to a config.json (or its folder)",
    )
    p.add_argument(
        "--context",
        required=True,
        type=parse_context,
        help="tokens per sequence (e.g. 1048576, 128k, 1M)",
    )
    p.add_argument(
        "--kv-format",
        default=None,
        choices=MAIN_KV_FORMATS,
        help="main KV entry format (default: VLLM_DSV4_HW_KV_FORMAT, else the most "
        "compact the device holds: fp8 = fp8_ds_mla on cuda/cpu, bf16 on npu)",
    )
    p.add_argument(
        "--indexer-format",
        default=None,
        choices=INDEXER_KV_FORMATS,
        help="indexer key entry format (default: VLLM_DSV4_HW_INDEXER_FORMAT, else the "
        "most compact the device holds: mxfp4 on cuda/cpu, bf16 on npu)",
    )
    p.add_argument(
        "--device",
        default=None,
        type=parse_device,
        metavar="DEVICE",
        help=f"plan for this device instead of the local one ({HELP_TARGETS}; sets the "
        "default formats and checks explicit ones against its capabilities)",
    )
    p.add_argument(
        "--memory",
        type=parse_gib,
        metavar="GIB",
        help="KV cache memory in GiB: report how many sequences fit",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="C",
        help="with --memory: also predict what `vllm serve` reports for this memory "
        "(KV cache tokens, maximum concurrency at --context = max_model_len) "
        "when it schedules at most C tokens per step",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="T",
        help="plan one of T tensor-parallel ranks (checks that the model splits T "
        "ways; the KV cache is replicated on every rank: --memory is per rank)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: routed experts split by expert",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _parallel(args: argparse.Namespace, cfg) -> dict:
    from vllm_dsv4_hw.parallel import SplitError, check_split
    from vllm_dsv4_hw.quant.scheme import shipped

    if args.model in PRESETS:  # a preset names the official checkpoint, weights as shipped
        cfg = shipped(cfg)
    tp = args.tensor_parallel_size
    if tp < 1:
        raise CLIError(f"--tensor-parallel-size must be >= 1, got {tp}")
    try:
        check_split(cfg, tp, args.enable_expert_parallel)
    except SplitError as exc:
        raise CLIError(str(exc)) from None
    return {
        "tensor_parallel_size": tp,
        "expert_parallel": bool(args.enable_expert_parallel),
        "kv_per_rank": "replicated",
        "note": "one shared KV head: every rank holds every cache entry (the figures above "
        "are per rank); weights are split (the resident bytes each rank logs at load)",
    }


def _choose(args: argparse.Namespace):
    from vllm_dsv4_hw.kv_cache.format_choice import FormatUnsupportedError, choose_formats
    from vllm_dsv4_hw.platform.device import detect_device_type

    device = apply_device(args.device) or detect_device_type()
    try:
        return choose_formats(
            device,
            args.kv_format,
            args.indexer_format,
            main_source="--kv-format" if args.kv_format else "VLLM_DSV4_HW_KV_FORMAT",
            indexer_source="--indexer-format"
            if args.indexer_format
            else "VLLM_DSV4_HW_INDEXER_FORMAT",
        )
    except FormatUnsupportedError as exc:
        raise CLIError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.model)
    logger.info("model %s: %d layers, ratios %s", cfg.name, cfg.num_layers, cfg.compress_ratios)
    parallel = _parallel(args, cfg)
    memory = None if args.memory is None else int(args.memory * GIB)
    choice = _choose(args)
    try:
        plan = plan_kv(cfg, args.context, choice.main, choice.indexer, memory)
    except KVPlanError as exc:
        raise CLIError(str(exc)) from None
    pool = None
    if args.max_num_batched_tokens is not None:
        if memory is None:
            raise CLIError("--max-num-batched-tokens needs --memory (the KV cache space)")
        from vllm_dsv4_hw.engine.kv_pool import plan_vllm_pool

        try:
            pool = plan_vllm_pool(
                cfg, choice.main, choice.indexer, memory, args.context, args.max_num_batched_tokens
            )
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if args.json:
        d = plan.to_dict()
        d["device"] = choice.device_type
        d["format_choice"] = {
            "main": choice.main,
            "indexer": choice.indexer,
            "reason": choice.reason,
        }
        if pool is not None:
            d["vllm_pool"] = pool.to_dict()
        d["parallel"] = parallel
        print(json.dumps(d, indent=2))
    else:
        print(format_plan(plan))
        print(f"formats for {choice.device_type} ({choice.device_name}): {choice.reason}")
        if pool is not None:
            print(
                f"vLLM pool (max_model_len {pool.max_model_len}, max_num_batched_tokens "
                f"{pool.max_num_batched_tokens}): {pool.num_blocks} blocks of "
                f"{pool.bytes_per_block} B, {pool.blocks_per_request} per request -> KV cache "
                f"size {pool.tokens:,} tokens, maximum concurrency {pool.max_concurrency:.2f}x"
            )
            for g in pool.groups:
                print(
                    f"  group {'+'.join(g.kinds)}: {g.layers} layer caches, "
                    f"{g.positions_per_page} positions/page, {g.packed_bytes} B packed, "
                    f"{g.blocks_per_request} blocks/request"
                )
        if parallel["tensor_parallel_size"] > 1:
            ep = ", experts split by expert" if parallel["expert_parallel"] else ""
            print(
                f"per rank of --tensor-parallel-size {parallel['tensor_parallel_size']}{ep}: "
                f"{parallel['note']}"
            )
    return 0


def _gib(n: int) -> str:
    return f"{n / GIB:.4f}"


def format_plan(plan: KVPlan) -> str:
    lines = [
        f"KV cache plan: {plan.model}, {plan.num_layers} layers, context {plan.context:,} tokens, "
        f"main {plan.main_format}, indexer {plan.indexer_format}",
        "",
    ]
    head = (
        "kind",
        "layers",
        "format",
        "B/entry",
        "entries/layer",
        "per page",
        "window",
        "pages/layer",
        "page B",
        "bucket",
        "useful GiB",
        "alloc GiB",
        "padding B",
    )
    rows = [head]
    for k in plan.kinds:
        window = "-" if k.sliding_window is None else f"{k.sliding_window} ({k.window_pages} pg)"
        rows.append(
            (
                k.kind,
                str(k.num_layers),
                k.format,
                str(k.entry_bytes),
                f"{k.entries_per_layer:,}",
                str(k.entries_per_page),
                window,
                f"{k.pages_per_layer:,}",
                str(k.page_bytes),
                k.bucket,
                _gib(k.useful_bytes),
                _gib(k.allocated_bytes),
                f"{k.padding_bytes:,}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i < 3 or i == 9 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
    lines.append("")
    lines.append("useful bytes by category:")
    for cat, n in plan.breakdown.items():
        lines.append(f"  {cat:<17} {n:>16,} B  {_gib(n):>10} GiB")
    lines.append("")
    lines.append(
        f"per sequence (useful):   {plan.bytes_per_sequence:>16,} B  "
        f"{_gib(plan.bytes_per_sequence):>10} GiB"
    )
    lines.append(
        f"allocated (pages):       {plan.allocated_bytes:>16,} B  "
        f"{_gib(plan.allocated_bytes):>10} GiB"
    )
    lines.append(
        f"padding:                 {plan.padding_bytes:>16,} B  "
        f"({100 * plan.padding_fraction:.3f}% of per-sequence bytes)"
    )
    lines.append("")
    lines.append(f"page buckets ({len(plan.page_buckets)} page sizes):")
    for b in plan.page_buckets:
        lines.append(
            f"  {b.name:<7} {b.page_bytes:>7,} B/page  {b.pages_per_sequence:>10,} "
            f"pages/seq  kinds: {', '.join(b.kinds)}"
        )
    lines.append("")
    ratio = "n/a (no compressed entries yet)" if plan.ratio is None else f"{plan.ratio:.2f}x"
    lines.append(
        f"V3.2-style baseline ({BASELINE_V32_BYTES_PER_TOKEN_LAYER} B/token/layer x "
        f"{plan.num_layers} layers): {plan.baseline_v32_bytes / GIB:.3f} GiB; compressed KV + "
        f"indexer keys {plan.growing_bytes / GIB:.3f} GiB; ratio {ratio}"
    )
    if plan.memory_bytes is not None:
        lines.append(
            f"memory {plan.memory_bytes / GIB:g} GiB: max_sequences "
            f"{plan.max_sequences:,} (at {_gib(plan.allocated_bytes)} GiB allocated each)"
        )
    return "\n".join(lines)
