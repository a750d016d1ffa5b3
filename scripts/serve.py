# SPDX-License-Identifier: Apache-2.0
"""``make serve``: serve the tiny DeepSeek V4 checkpoint with ``vllm serve`` through this plugin.

Builds ``checkpoints/tiny-flash-fp8`` (``vllm-dsv4-hw make-checkpoint --preset tiny-flash
--dtype fp8``: random weights in the official FP8 / FP4 format, an offline tokenizer with a chat
template) if it is not there, starts ``vllm serve`` on 127.0.0.1, and once ``/health`` answers
prints one ready line with the URL and requests to paste (after vLLM's start-up log, so that they
do not scroll away). Ctrl-C stops the server. Run with the venv's python (``make serve`` does).

Environment: ``PORT`` (default 8000), ``MAX_MODEL_LEN`` (default 4096), ``CHECKPOINT`` (serve this
directory instead; nothing is built), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache on CPU, default
1). Arguments are passed on to ``vllm serve``, e.g. ``make serve ARGS="--kv-cache-dtype bfloat16"``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "tiny-flash-fp8"
SERVED_NAME = "tiny-flash"


def ensure_checkpoint(path: Path) -> None:
    if (path / "config.json").exists():
        print(f"serve: checkpoint {path.relative_to(ROOT)} (already built)", flush=True)
        return
    print(f"serve: building {path.relative_to(ROOT)} (tiny-flash, fp8) ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dsv4_hw",
            "make-checkpoint",
            str(path),
            "--preset",
            "tiny-flash",
            "--dtype",
            "fp8",
            "--force",
            "-q",
        ],
        check=True,
    )


def vllm_command(model: Path, port: int, max_model_len: int, extra: list[str]) -> list[str]:
    cli = Path(sys.executable).with_name("vllm")
    head = (
        [str(cli), "serve", str(model)]
        if cli.exists()
        else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    )
    args = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
    ]
    if "--served-model-name" not in extra:
        args += ["--served-model-name", SERVED_NAME]
    return head + args + extra


def main(argv: list[str]) -> int:
    port = int(os.environ.get("PORT") or 8000)
    max_model_len = int(os.environ.get("MAX_MODEL_LEN") or 4096)
    if os.environ.get("CHECKPOINT"):
        model = Path(os.environ["CHECKPOINT"]).resolve()
        if not (model / "config.json").exists():
            sys.exit(f"serve: CHECKPOINT={model} has no config.json")
    else:
        model = DEFAULT_CHECKPOINT
        ensure_checkpoint(model)

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    env.pop("TRITON_INTERPRET", None)

    cmd = vllm_command(model, port, max_model_len, argv)
    name = (
        argv[argv.index("--served-model-name") + 1]
        if "--served-model-name" in argv
        else SERVED_NAME
    )
    url = f"http://127.0.0.1:{port}"
    print(f"serve: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    print(
        "serve: starting vLLM (about 50 s to healthy on 2 CPU cores; the ready line with "
        "requests to paste follows vLLM's start-up log)",
        flush=True,
    )
    proc = subprocess.Popen(cmd, env=env)
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            if _healthy(url):
                print(ready_text(url, name, time.monotonic() - t0), flush=True)
                break
            time.sleep(1)
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def ready_text(url: str, name: str, seconds: float) -> str:
    body = json.dumps(
        {
            "model": name,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )
    return f"""
serve: READY after {seconds:.0f} s: model {name!r} at {url}/v1 (OpenAI API; Ctrl-C stops it)
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'
  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0}}'
(random weights: the text is gibberish; chat requests are rendered by vLLM's deepseek_v4
tokenizer mode, DeepSeek V4's own chat format: README.md says how to use the checkpoint's
chat_template instead)
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
