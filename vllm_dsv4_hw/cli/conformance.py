# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw conformance``: certify the backends of one device (vllm_dsv4_hw.conformance)."""

from __future__ import annotations

import argparse
import sys

from vllm_dsv4_hw.cli.main import EXIT_FAILURE, CLIError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run every op of the device's backends against the float64 reference; check cache "
        "layouts, page buckets and stream overlap; exit 1 on any failure",
        description="Conformance kit for a device: every op of the backend the dispatcher selects "
        "there (and of every other registered backend that can run there) against a "
        "float64 oracle on fresh random inputs with poisoned outputs; cache byte "
        "layouts and page buckets on the device; two-branch stream overlap. Prints a "
        "pass/fail table, optionally writes a report, exits 1 on any failure. On the "
        "CPU without TRITON_INTERPRET=1 only the reference runs.",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,npu}[:N]",
        help="device to certify (default cpu)",
    )
    p.add_argument(
        "--shapes",
        default="small",
        choices=("small", "real"),
        help="small: real head/rope/index dims, few heads and tokens (default); real: "
        "V4-Flash at decode batch 8 (64 heads x 512, rope 64, index 64 x 128, "
        "top-512)",
    )
    p.add_argument(
        "--report",
        metavar="FILE",
        help="write the report to FILE: .json or .md (the suffix picks the format)",
    )
    p.add_argument(
        "--backends",
        default="all",
        choices=("all", "selected"),
        help="all: the selected backend and every other one that runs here (default); "
        "selected: only the dispatcher's choice",
    )
    p.add_argument(
        "--ops",
        help="comma-separated ops to check, and/or the device checks "
        "'buckets' and 'streams' (default: every op and check; the "
        "kv_insert / kv_gather cases are the cache-layout checks)",
    )
    p.add_argument("--seed", type=int, help="replay the inputs of an earlier run")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_hw.conformance import report as rep
    from vllm_dsv4_hw.conformance.runner import ConformanceSetupError
    from vllm_dsv4_hw.conformance.runner import run as run_kit

    if args.report:
        try:
            rep.report_kind(args.report)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    printed = {"header": False}

    def progress(row: dict) -> None:  # stream the verdicts while the run goes on
        if not printed["header"]:
            printed["header"] = True
        mark = rep.status(row)
        b = row.get("backend", "-") + ("*" if row.get("selected") else "")
        print(f"  {mark}  {row['check']} [{b}] {row['case']}", file=sys.stderr, flush=True)

    try:
        report = run_kit(
            args.device,
            args.shapes,
            args.backends,
            ops,
            args.seed,
            progress=progress if args.verbose else None,
        )
    except ConformanceSetupError as exc:
        raise CLIError(str(exc)) from None
    print(rep.header(report))
    for line in rep.table_lines(report):
        print(line)
    print(rep.summary_line(report))
    if args.report:
        kind = rep.write(report, args.report)
        print(f"report ({kind}): {args.report}")
    return 0 if report["summary"]["ok"] else EXIT_FAILURE
