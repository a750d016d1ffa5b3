# SPDX-License-Identifier: Apache-2.0
"""``make serve``, the README's first command, tells the truth: it builds the tiny checkpoint when
it is missing (a fresh clone has none), says what it is doing, and prints its READY line with the
URL and requests to paste only after ``/health`` answers, after vLLM's start-up log.

Run from a copy of the repository's tracked files (``git ls-files``) with this venv linked in, as a
fresh clone after ``make setup``: no ``checkpoints/`` directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.serve.process import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _fresh_copy(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_file():
            shutil.copy2(ROOT / f, target)
    venv = ROOT / ".venv"
    (dest / ".venv").symlink_to(venv)
    # the setup stamp is newer than the copied sources: make sees a done setup
    os.utime(venv / ".dsv4-hw-setup") if (venv / ".dsv4-hw-setup").exists() else None
    return dest


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_make_serve_prints_ready_after_health(tmp_path):
    repo = _fresh_copy(tmp_path / "clone")
    assert not (repo / "checkpoints").exists()
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_DSV4_HW_") and k != "TRITON_INTERPRET"
    }
    env.update(PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        ["make", "serve"],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    healthy_when_ready = None
    t0 = time.monotonic()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "serve: READY" in line:
                healthy_when_ready = _health(url)
            if healthy_when_ready is not None and "chat_template" in line:
                break  # the last line of the READY block
            if time.monotonic() - t0 > TIMEOUT_S:
                break
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "\n".join(lines)
    ready = [i for i, ln in enumerate(lines) if "serve: READY" in ln]
    assert ready, text[-3000:]
    assert healthy_when_ready, "READY printed before /health answered"
    started = [i for i, ln in enumerate(lines) if "Application startup complete" in ln]
    assert started and started[0] < ready[0], "the READY line must follow vLLM's start-up log"
    assert "serve: building checkpoints/tiny-flash-fp8" in text  # the fresh clone had none
    assert f"{url}/v1/chat/completions" in text and "curl" in text
    assert (repo / "checkpoints" / "tiny-flash-fp8" / "config.json").exists()
    print(f"\n{lines[ready[0]]}", file=sys.stderr)
