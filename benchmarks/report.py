# SPDX-License-Identifier: Apache-2.0
"""Render a gpu_run.json as the markdown tables of docs/performance.md.

python -m benchmarks.report docs/results/gpu_run-h200-2026-11-29.json
"""

from __future__ import annotations

import json
import sys


def _f(v, digits=4):
    return f"{v:.{digits}g}" if isinstance(v, (int, float)) else str(v)


def render(report: dict) -> str:
    out = [
        f"Command: `{report.get('command', 'python -m benchmarks.gpu_run')}` (= `make bench`); "
        f"machine: {report.get('machine')} (torch {report.get('torch')}, Triton "
        f"{report.get('triton')}); date: {report.get('date')}.",
        "",
        f"Measured ceilings: device copy {report['ceilings'].get('copy_tb_s')} TB/s, bf16 matmul "
        f"{report['ceilings'].get('bf16_matmul_tflops')} TFLOP/s; graph replay of 1 / 2 empty "
        f"kernels (launch floor): {report.get('launch_floor_ms')} ms. Timing modes: "
        f"{report.get('timing_modes')}.",
        "",
        "| op | case | unfused PyTorch ms | ours ms | speedup | floor ms | floor / ours |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report.get("bench", []):
        out.append(
            f"| {r.get('op')} | {r.get('case')} | {_f(r.get('ref_ms'))} | "
            f"{_f(r.get('ours_ms'))} | {_f(r.get('speedup'), 3)} | {_f(r.get('floor_ms'))} | "
            f"{_f(r.get('frac_of_floor'), 2)} |"
        )
    checks = report.get("checks", [])
    n_fail = sum(1 for c in checks if not c.get("ok"))
    out += ["", f"Checks: {len(checks) - n_fail} passed, {n_fail} failed."]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
