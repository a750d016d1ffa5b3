"""Ahead-of-time Triton compiles for NVIDIA targets on a machine without a GPU, for the kernels'
compile tests: a script that calls ``triton.compile`` and prints ``RESULTS<json>`` runs in a
subprocess without ``TRITON_INTERPRET`` (under the interpreter the kernels are not compilable JIT
functions), with Triton's bundled ptxas (:data:`PTXAS`; the tests skip when it is absent).
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


def compile_results(script: str) -> list:
    """Run ``script`` in a fresh interpreter at the repository root and return its RESULTS list."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert line, f"compile script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line[-1][len("RESULTS"):])
