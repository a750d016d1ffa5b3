# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw make-checkpoint``: write a tiny DeepSeek V4 checkpoint in the official format."""

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


def add_parser(sub) -> None:
    from vllm_dsv4_hw.tools.checkpoint import DTYPES, PRESETS

    p = sub.add_parser(
        "make-checkpoint",
        help="write a tiny random DeepSeek V4 checkpoint (official names and formats, tokenizer)",
        description="Write a DeepSeek V4 checkpoint directory with random weights: config.json with "
        "the official field names, safetensors shards with the official tensor names "
        "(fp8: FP8 e4m3 linears with 128x128 ue8m0 scales and FP4 e2m1 experts; bf16: "
        "plain bf16), a byte-level BPE tokenizer with a chat template, and "
        "generation_config.json. Deterministic in --seed; the fp8 and bf16 checkpoints "
        "of one seed hold the same weights.",
    )
    p.add_argument("out", metavar="OUT", help="output directory (created; must be empty or absent)")
    p.add_argument(
        "--preset",
        required=True,
        choices=tuple(PRESETS),
        help="model shape: tiny-flash (5 layers, ratios 0,0,4,128,4) or tiny-pro "
        "(4 layers, ratios 128,128,4,128)",
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
        summary = make_checkpoint(
            args.out,
            preset=args.preset,
            dtype=args.dtype,
            seed=args.seed,
            overwrite=args.force,
            progress=progress,
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
