# SPDX-License-Identifier: Apache-2.0
"""The target matrix's compiles (``test_target_matrix.py``) run at the lowest CPU priority while
the rest of the suite runs, from its first test not marked ``serve_first`` (those time a ``vllm
serve`` process from its start and run first).

Why: the matrix compiles ~230 launches for each of 8 targets (~700 CPU seconds: ~6 minutes of a
2-core CI machine's wall time when it runs alone), while most of the suite keeps one core busy
(one intra-op thread). At ``nice 19`` the compile workers take the idle core and yield the busy
one, so the matrix's own tests (moved to the end of the session) find their results ready or
nearly so. Run alone (``pytest tests/aot``), the two workers take both cores as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATRIX = "tests/aot/test_target_matrix.py"
WORKERS = 2  # the CI machine's cores


class Compiles:
    """One compile worker process per target, ``WORKERS`` at a time, niced; ``result(target)``
    waits for that target's rows."""

    def __init__(self, targets: dict[str, tuple]):
        self._procs: list[subprocess.Popen] = []
        self._stopped = False
        self._pool = ThreadPoolExecutor(WORKERS)
        self.futures: dict[str, Future] = {
            t: self._pool.submit(self._compile, t, *spec) for t, spec in targets.items()
        }

    def _compile(self, target: str, fields: tuple, launches: Path, limit: int) -> list[dict]:
        if self._stopped:
            raise RuntimeError(f"{target}: the session ended before its compile started")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.aot.compile_launches",
                str(launches),
                *fields,
                str(limit),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.nice(19),
        )
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=3000)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        line = [ln for ln in out.splitlines() if ln.startswith("RESULTS")]
        if not line:
            raise RuntimeError(
                f"{target}: compile worker failed (exit {proc.returncode}):\n"
                f"{out[-2000:]}\n{err[-3000:]}"
            )
        return json.loads(line[-1][len("RESULTS") :])

    def result(self, target: str) -> list[dict]:
        return self.futures[target].result()

    def stop(self) -> None:
        """End every worker still running (a session cut short: -x, ^C, a deselected matrix)."""
        self._stopped = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


def start(config) -> Compiles:
    """The session's compiles (``config._dsv4_aot``), started on first call."""
    jobs = getattr(config, "_dsv4_aot", None)
    if jobs is None:
        from tests.aot.test_target_matrix import TARGETS

        jobs = config._dsv4_aot = Compiles(TARGETS)
    return jobs


def uses_matrix(item) -> bool:
    return item.nodeid.startswith(MATRIX) and "compiled" in getattr(item, "fixturenames", ())
