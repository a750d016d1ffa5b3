# SPDX-License-Identifier: Apache-2.0
"""Test scripts that run in a fresh interpreter at the repository root and report one marked
stdout line: ahead-of-time Triton compiles for NVIDIA targets on a machine without a GPU
(:func:`compile_results`: without ``TRITON_INTERPRET``, under which the kernels are not compilable
JIT functions, with Triton's bundled ptxas, :data:`PTXAS`; the tests skip when it is absent), and
peak-memory measurements (:func:`memory_mib`: one thread, a fresh process's peak RSS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

try:
    import triton

    PTXAS: Path | None = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
except ImportError:
    PTXAS = None

HAS_PTXAS = PTXAS is not None and PTXAS.exists()


def marked_line(script: str, marker: str, what: str, env: dict, timeout: float) -> str:
    """The last stdout line of ``script`` that starts with ``marker``, without the marker."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    assert line, f"{what} script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return line[-1][len(marker) :]


def compile_results(script: str) -> list:
    """The ``RESULTS<json>`` list of a compile script, run without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return json.loads(marked_line(script, "RESULTS", "compile", env, 600))


def memory_mib(script: str) -> tuple[float, ...]:
    """The numbers of a memory script's ``MEM a b c`` line (MiB), run with one OpenMP thread."""
    line = marked_line(script, "MEM", "memory", dict(os.environ, OMP_NUM_THREADS="1"), 300)
    return tuple(float(v) for v in line.split())
