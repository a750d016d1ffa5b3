# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw make-checkpoint``: write a DeepSeek V4 checkpoint in the official format, tiny or
at the real dimensions (the model's first ``--layers`` layers and its MTP block)."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_dsv4_hw.cli.main import EXIT_FAILURE, CLIError


def _seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer seed") from None
    if not 0 <= value < (1 << 63):
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2^63), got {text}")
    return value


def _layers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a layer count") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_parser(sub) -> None:
    from vllm_dsv4_hw.tools.checkpoint import ALL_PRESETS, DTYPES

    p = sub.add_parser(
        "make-checkpoint",
        help="write a random DeepSeek V4 checkpoint, tiny or at the real dimensions (official "
        "names and formats, tokenizer)",
        description="Write a DeepSeek V4 checkpoint directory with random weights: config.json with "
        "the official field names, safetensors shards with the official tensor names "
        "(fp8: FP8 e4m3 linears with 128x128 ue8m0 scales and FP4 e2m1 experts; bf16: "
        "plain bf16), a byte-level BPE tokenizer with a chat template, and "
        "generation_config.json. Deterministic in --seed (and --device); the fp8 and bf16 "
        "checkpoints of one seed hold the same weights. The real-dimension presets hold "
        "the model's first --layers layers in its own order and its MTP block.",
    )
    p.add_argument("out", metavar="OUT", help="output directory (created; must be empty or absent)")
    p.add_argument(
        "--preset",
        required=True,
        choices=ALL_PRESETS,
        help="model shape: tiny-flash (5 layers, ratios 0,0,4,128,4) or tiny-pro "
        "(4 layers, ratios 128,128,4,128); v4-flash (43 layers) or v4-pro (61 layers) at the "
        "real dimensions, with --layers",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        metavar="N",
        help="the model's first N layers, in its order (hash-routed first), plus its MTP block: "
        "required with v4-flash / v4-pro (about 3.2 / 12.5 GiB per layer in fp8, and as "
        "much again for the MTP block); a tiny preset keeps all of its layers by default",
    )
    p.add_argument(
        "--dtype",
        default="fp8",
        choices=DTYPES,
        help="weight format (default fp8: FP8 linears + FP4 experts, as the official "
        "checkpoints; bf16: those as plain bf16; other tensors keep their official "
        "dtypes in both)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the weights are drawn and encoded: cpu (default; one thread per core) or "
        "cuda (much faster at the real dimensions; other random values than cpu)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        metavar="N",
        help="generating threads (default: one per core on cpu, 4 on cuda)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be written (layers, tensors, size, shards) and write nothing",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_hw.tools.checkpoint import CheckpointError, make_checkpoint

    def progress(msg: str) -> None:
        if not args.quiet:
            sys.stderr.write(f"make-checkpoint: {msg}\n")
            sys.stderr.flush()

    try:
        if args.dry_run:
            return _dry_run(args)
        summary = make_checkpoint(
            args.out,
            preset=args.preset,
            dtype=args.dtype,
            seed=args.seed,
            layers=args.layers,
            overwrite=args.force,
            progress=progress,
            device=args.device,
            workers=args.workers,
        )
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot write {args.out}: {exc.strerror or exc}", EXIT_FAILURE) from None
    if args.json:
        print(json.dumps(summary.as_dict()))
    else:
        print(
            f"{summary.path}  ({summary.preset}, {summary.dtype}, seed {summary.seed}: "
            f"{summary.num_params / 1e6:.2f}M params, {summary.size_bytes / 2**20:.1f} MiB, "
            f"{len(summary.files)} files)"
        )
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    from vllm_dsv4_hw.tools.checkpoint import checkpoint_plan

    plan = checkpoint_plan(args.preset, args.dtype, args.layers)
    cfg = plan.cfg
    summary = {
        "path": args.out,
        "preset": args.preset,
        "dtype": args.dtype,
        "layers": cfg["num_hidden_layers"],
        "compress_ratios": cfg["compress_ratios"],
        "num_hash_layers": cfg["num_hash_layers"],
        "num_params": plan.num_params,
        "num_params_main": plan.num_params_main,
        "num_tensors": len(plan.tensors),
        "tensor_bytes": plan.tensor_bytes,
        "files": plan.files,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{args.out}  ({args.preset}, {args.dtype}: {cfg['num_hidden_layers']} layers + "
            f"{cfg['num_nextn_predict_layers']} MTP, ratios {cfg['compress_ratios']}; "
            f"{plan.num_params / 1e9:.2f}B params, {len(plan.tensors)} tensors, "
            f"{plan.tensor_bytes / 2**30:.2f} GiB in {len(plan.files)} shard(s); nothing written)"
        )
    return 0
