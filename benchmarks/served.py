# SPDX-License-Identifier: Apache-2.0
"""The served benchmark: ``vllm serve`` of a real-dimension checkpoint, driven by vLLM's own
``vllm bench serve`` (issue 47: what a user measures, beside ``decode_stack --network``).

    python -m benchmarks.served --preset v4-flash --layers 4 --out OUT          # a vLLM install
    bash benchmarks/with_vllm.sh python3 -m benchmarks.served --preset v4-flash --layers 4
    python -m benchmarks.served --preset v4-flash --layers 4 --dry-run          # the plan only

Steps: the checkpoint (``vllm-dsv4-hw make-checkpoint --preset P --layers N``, kept in
``--checkpoint`` and reused when its config is there), one ``vllm serve`` with the recipe's flags
and CUDA graphs (``--cudagraph-mode``), then each run of the plan through ``vllm bench serve``
(random dataset, fixed output length, ``--ignore-eos``): decode at each ``--concurrency`` (1K in /
256 out), time to first token of each ``--ttft-lengths`` prompt at concurrency 1, and one prompt
of ``--prefix-length`` sent twice (the second a prefix-cache hit). One JSON per run in OUT (vLLM's
TPOT / ITL / TTFT / throughput, the KV capacity and resident weights vLLM's log states, vLLM
version, card, commit); the server is stopped with SIGINT (its clean shutdown) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

# The recipe's flags (docs/serving.md), without the CUDA graph mode this benchmark sets.
RECIPE = (
    "--kv-cache-dtype", "fp8", "--block-size", "256",
    "--attention-config.indexer_kv_dtype=mxfp4", "--tokenizer-mode", "deepseek_v4",
    "--reasoning-parser", "deepseek_v4", "--tool-call-parser", "deepseek_v4",
    "--enable-auto-tool-choice",
)  # fmt: skip
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "NONE")
# what a run takes from vLLM's result JSON (ms, tokens/s, counts)
METRICS = tuple(
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl") for stat in ("mean", "median", "p99")
) + ("output_throughput", "request_throughput", "total_token_throughput", "completed", "failed",
     "duration")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One ``vllm bench serve`` call."""

    name: str
    kind: str  # decode | ttft | prefix
    concurrency: int
    input_len: int
    output_len: int
    prompts: int
    prefix_len: int = 0


def _size(text: str) -> int:
    """'1024', '8k', '128K' -> tokens (k = 1,024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 1024, 8k, 128k)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _size(text)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_size(t) for t in text.split(",") if t.strip()) if text.strip() else ()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="v4-flash", choices=("v4-flash", "v4-pro", "tiny-flash"))
    ap.add_argument("--layers", type=int, default=4, help="layers of the checkpoint (default 4)")
    ap.add_argument("--checkpoint", default=None,
                    help="checkpoint directory (default: /tmp/served-ckpt-PRESET-LAYERS); made "
                         "there when it holds no config.json")  # fmt: skip
    ap.add_argument("--concurrency", type=_sizes, default=(1, 8, 32, 64))
    ap.add_argument("--input-len", type=_size, default=1024)
    ap.add_argument("--output-len", type=_size, default=256)
    ap.add_argument(
        "--ttft-lengths",
        type=_sizes,
        default=(8192, 32768, 131072),
        help="prompt lengths timed to their first token at concurrency 1 ('' none)",
    )
    ap.add_argument("--prefix-length", type=_size_or_zero, default=32768,
                    help="the prompt sent twice (prefix-cache hit); 0: none")  # fmt: skip
    ap.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY", choices=CUDAGRAPH_MODES)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more vllm serve argument (repeatable)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--dry-run", action="store_true", help="print the commands and the plan")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: give at least 1")
    if not args.concurrency and not args.ttft_lengths and not args.prefix_length:
        ap.error("nothing to run: give --concurrency, --ttft-lengths or --prefix-length")
    args.checkpoint = args.checkpoint or f"/tmp/served-ckpt-{args.preset}-{args.layers}"
    return args


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs, in order: decode at each concurrency (4 requests a slot, at least 8), then the
    TTFT prompts (2 each: the first also warms the prefill shapes), then the prefix pair."""
    runs = [
        Run(f"decode-c{c}", "decode", c, args.input_len, args.output_len, max(8, 4 * c))
        for c in args.concurrency
    ]
    runs += [Run(f"ttft-{n}", "ttft", 1, n, 16, 2) for n in args.ttft_lengths]
    if args.prefix_length:
        runs.append(Run(f"prefix-{args.prefix_length}", "prefix", 1, 0, 16, 2, args.prefix_length))
    return runs


def max_model_len(args: argparse.Namespace) -> int:
    longest = max((r.input_len + r.prefix_len + r.output_len for r in plan(args)), default=0)
    return -(-longest // 256) * 256


def vllm_cli() -> list[str]:
    """``vllm`` as a module (works where the CLI script is absent: ``with_vllm.sh``)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_command(args: argparse.Namespace) -> list[str]:
    return [
        *vllm_cli(), "serve", args.checkpoint, "--host", "127.0.0.1", "--port", str(args.port),
        *RECIPE, "--max-model-len", str(max_model_len(args)),
        "--compilation-config", json.dumps({"cudagraph_mode": args.cudagraph_mode}),
        *args.serve_arg,
    ]  # fmt: skip


def bench_command(args: argparse.Namespace, run: Run, result_dir: Path) -> list[str]:
    return [
        *vllm_cli(), "bench", "serve", "--backend", "vllm",
        "--base-url", f"http://127.0.0.1:{args.port}", "--model", args.checkpoint,
        "--dataset-name", "random", "--random-input-len", str(run.input_len),
        "--random-output-len", str(run.output_len), "--random-prefix-len", str(run.prefix_len),
        "--num-prompts", str(run.prompts), "--max-concurrency", str(run.concurrency),
        "--ignore-eos", "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{run.name}.vllm.json",
    ]  # fmt: skip


def parse_server_log(text: str) -> dict:
    """What vLLM's and the plugin's log lines state: the KV capacity in tokens, the maximum
    concurrency at the model length, the resident weights (MiB)."""
    out = {}
    m = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens "
                  r"per request: ([\d.]+)x", text)  # fmt: skip
    if m:
        out["kv_tokens"] = int(m.group(1).replace(",", ""))
        out["kv_max_concurrency"] = float(m.group(3))
    m = re.search(r"resident weights ([\d.]+) MiB", text)
    if m:
        out["resident_weights_mib"] = float(m.group(1))
    return out


def record(run: Run, result: dict, server: dict, meta: dict) -> dict:
    """The JSON of one run: the plan row, vLLM's metrics, the TTFT of each request (the prefix
    pair: cold, then hit), the server's log facts and where it ran."""
    row = {"run": asdict(run), **{k: result.get(k) for k in METRICS}, **server, **meta}
    if run.kind in ("ttft", "prefix") and result.get("ttfts"):
        row["ttfts_ms"] = [round(1000 * t, 3) for t in result["ttfts"]]
    return row


def environment() -> dict:
    """vLLM version, card, commit."""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except ImportError:
        meta["vllm"] = None
    try:
        import torch

        meta["card"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        meta["card"] = None
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    meta["commit"] = git.stdout.strip() or None
    return meta


def write(out: Path, run: Run, row: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"served-{run.name}.json"
    path.write_text(json.dumps(row, indent=1) + "\n")
    return path


def _checkpoint(args: argparse.Namespace) -> None:
    if (Path(args.checkpoint) / "config.json").exists():
        print(f"served: reusing {args.checkpoint}", flush=True)
        return
    device = ["--device", "cuda"] if _has_cuda() else []
    cmd = [sys.executable, "-m", "vllm_dsv4_hw", "make-checkpoint", args.checkpoint,
           "--preset", args.preset, "--force", *device]  # fmt: skip
    if not args.preset.startswith("tiny"):
        cmd += ["--layers", str(args.layers)]
    subprocess.run(cmd, check=True)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _wait_healthy(proc, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vllm serve was not healthy after {timeout:.0f} s")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    runs = plan(args)
    if args.dry_run:
        print(shlex.join(serve_command(args)))
        for run in runs:
            print(shlex.join(bench_command(args, run, out / "vllm")))
        return 0
    _checkpoint(args)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(serve_command(args), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, args.port, args.startup_timeout)
            meta = environment()
            for run in runs:
                print(f"served: {run.name}", flush=True)
                subprocess.run(bench_command(args, run, out / "vllm"), check=True)
                result = json.loads((out / "vllm" / f"{run.name}.vllm.json").read_text())
                row = record(run, result, parse_server_log(log_path.read_text()), meta)
                print(f"served: wrote {write(out, run, row)}", flush=True)
        finally:
            _stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
