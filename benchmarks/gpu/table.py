# SPDX-License-Identifier: Apache-2.0
"""The plain-text table every GPU benchmark module prints (one column per key seen in the rows)."""

from __future__ import annotations

import sys


def fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def size_label(n: int) -> str:
    """A count for a table cell: 4096 -> 4K, 1048576 -> 1M (exact multiples only), else as is."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def print_table(rows: list[dict], file=sys.stdout) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(wd) for k, wd in zip(keys, widths)), file=file)
    for c in cells:
        print("  ".join(v.ljust(wd) for v, wd in zip(c, widths)), file=file)


def prepare_smoke_env(argv: list[str]) -> None:
    """``--smoke`` on a machine without a GPU runs the Triton interpreter; the variable must be set
    before anything imports triton, so module ``__main__`` blocks call this first."""
    import os

    if "--smoke" in argv and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def run_cli(doc: str, check, bench, argv=None, sweep_help: str | None = None) -> int:
    """The shared command line of the per-kernel GPU modules: check and/or bench, print tables,
    exit 1 when a check fails, 2 when no device can run the kernels."""
    import argparse
    import os

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes; CPU + Triton interpreter when no GPU is present",
    )
    if sweep_help:
        p.add_argument("--sweep", action="store_true", help=sweep_help)
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args(argv)
    import torch

    if torch.cuda.is_available():
        device = "cuda"
    elif a.smoke:
        device = "cpu"
        if os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "no GPU: re-run with TRITON_INTERPRET=1 (set before triton is imported)",
                file=sys.stderr,
            )
            return 2
    else:
        print("no CUDA device; use --smoke for the CPU interpreter run", file=sys.stderr)
        return 2
    ok = True
    if not a.no_check:
        rows = check(device, smoke=a.smoke)
        print("== check ==")
        print_table(rows)
        ok = all(r.get("ok", True) for r in rows)
    if not a.no_bench:
        print("== bench ==")
        kw = {"sweep": a.sweep} if sweep_help else {}
        print_table(bench(device, smoke=a.smoke, **kw))
    return 0 if ok else 1
