# SPDX-License-Identifier: Apache-2.0
"""Upstream's DeepSeek V4 command line works unchanged, and what cannot work stops early.

* ``recipe``: the FP8 tiny checkpoint with the flags users copy from vLLM's DeepSeek V4 recipe and
  blog that mean something on one CPU device: ``--kv-cache-dtype fp8 --block-size 256
  --attention-config.indexer_kv_dtype=mxfp4 --tokenizer-mode deepseek_v4 --reasoning-parser
  deepseek_v4 --tool-call-parser deepseek_v4 --enable-auto-tool-choice --compilation-config
  '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'`` (no ``--enforce-eager``). Completions and chat
  answer; a chat request with tools whose output is scripted through vLLM's structured outputs
  (random weights never emit DeepSeek V4's DSML tool syntax by themselves) comes back with the
  reasoning and the parsed tool call in the fields of vLLM's OpenAI API (``message.reasoning``,
  ``message.tool_calls``, ``finish_reason: tool_calls``).
* Refusals: a bad ``compress_ratios``, a missing tensor, a truncated or missing shard, flags that
  need several devices or formats we do not have, and a KV cache too small for one request of
  ``--max-model-len`` each make ``vllm serve`` exit non-zero within ``EARLY_S`` seconds (30), the
  last line of its output naming the problem, before any engine process starts (checked in the
  first process by ``engine/serve_checks.py``). These run first in the serve suite (no other
  server starting), after one untimed refusal that fills vLLM's cache (a machine's very first
  start also inspects the model class in a subprocess: about 25 s on 2 cores).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tests.serve.helpers import drop_tensor
from tests.serve.server import ServerSpec

pytestmark = pytest.mark.slow

# Refusals took 15.0 s and (2026-12-03, a suite of 1,923 s) 20.0 s in loaded fresh-clone CI runs;
# a model load is ~35 s on an idle machine, more on a loaded one.
EARLY_S = 30.0
RECIPE = (
    "--kv-cache-dtype",
    "fp8",
    "--block-size",
    "256",
    "--attention-config.indexer_kv_dtype=mxfp4",
    "--tokenizer-mode",
    "deepseek_v4",
    "--reasoning-parser",
    "deepseek_v4",
    "--tool-call-parser",
    "deepseek_v4",
    "--enable-auto-tool-choice",
    "--structured-outputs-config.enable_in_reasoning=True",
    "--compilation-config",
    '{"cudagraph_mode": "FULL_AND_PIECEWISE"}',
)
SERVERS = {
    "recipe_server": ServerSpec(
        "recipe", checkpoint="fp8", args=RECIPE, extra={"enforce_eager": False}
    )
}
DSML = "｜DSML｜"
SCRIPT = (
    "I should look up the weather.</think>\n\n"
    f"<{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">\n"
    f"<{DSML}parameter name=\"city\" string=\"true\">Paris</{DSML}parameter>\n"
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def recipe_server(vllm_servers):
    yield vllm_servers.get(SERVERS["recipe_server"])
    vllm_servers.stop("recipe")


def test_recipe_flags_serve_completions_and_chat(recipe_server):
    out = recipe_server.complete("The quick brown fox", max_tokens=8, temperature=0)
    assert out["usage"]["completion_tokens"] == 8
    chat = recipe_server.chat([{"role": "user", "content": "Hello!"}], max_tokens=8)
    msg = chat["choices"][0]["message"]
    assert msg["role"] == "assistant" and chat["usage"]["completion_tokens"] == 8
    assert recipe_server.log_lines("indexer mxfp4"), "the indexer format flag was not honoured"


def test_reasoning_and_tool_call_fields(recipe_server):
    chat = recipe_server.chat(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        max_tokens=200,
        structured_outputs={"choice": [SCRIPT]},
    )
    choice = chat["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["reasoning"] == "I should look up the weather.", msg
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert not msg["content"]
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


# -- early refusals --------------------------------------------------------------------------------
def _serve_fails(run_dir, ckpt, *args, unset: tuple[str, ...] = ()) -> tuple[float, list[str]]:
    from tests.serve.process import VllmServer, free_port

    # one log directory, hence one VLLM_CACHE_ROOT, for every refusal: vLLM's first start with a
    # cold cache inspects the model class in a subprocess (about 10 s more); later starts read it
    server = VllmServer(
        ckpt,
        args=args,
        max_model_len=1024,
        log_path=run_dir / "server.log",
        name="refused",
        enforce_eager=False,
        port=free_port(),
    )
    t0 = time.monotonic()
    env = {k: v for k, v in server.environment().items() if k not in unset}
    p = subprocess.run(server.command(), capture_output=True, text=True, timeout=120, env=env)
    seconds = time.monotonic() - t0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode != 0, lines[-20:]
    return seconds, lines


def _bad_ratio(tmp_path, ckpt):
    bad = shutil.copytree(ckpt, tmp_path / "bad-ratio")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["compress_ratios"][2] = 8
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def _missing_tensor(tmp_path, ckpt):
    bad = shutil.copytree(ckpt, tmp_path / "missing-tensor")
    drop_tensor(bad, "layers.3.attn.compressor.wkv.weight")
    return bad


SHARD = "model-00002-of-00003.safetensors"


def _truncated_shard(tmp_path, ckpt):
    bad = shutil.copytree(ckpt, tmp_path / "truncated-shard")
    with (bad / SHARD).open("r+b") as f:
        f.truncate((bad / SHARD).stat().st_size // 2)
    return bad


def _missing_shard(tmp_path, ckpt):
    bad = shutil.copytree(ckpt, tmp_path / "missing-shard")
    (bad / SHARD).unlink()
    return bad


CASES = {
    "bad compress_ratios": (_bad_ratio, (), ("compress_ratios[2] = 8", "layer 2", "0, 4, 128")),
    "missing tensor": (_missing_tensor, (), ("layers.3.attn.compressor.wkv.weight", "missing")),
    # the shard's path, what is wrong, and the command that makes this checkpoint again
    "truncated shard": (
        _truncated_shard,
        (),
        (f"truncated-shard/{SHARD} is ", "truncated", "vllm-dsv4-hw make-checkpoint "),
    ),
    "missing shard": (
        _missing_shard,
        (),
        (f"missing-shard/{SHARD} is missing", "vllm-dsv4-hw make-checkpoint "),
    ),
    "tensor parallel split": (
        None,
        ("--tensor-parallel-size", "4"),
        ("--tensor-parallel-size 4", "o_groups 2", "sizes that split this checkpoint: 1, 2"),
    ),
    "data parallel": (None, ("--data-parallel-size", "2"), ("--data-parallel-size 2",)),
    "nvfp4 indexer keys": (
        None,
        ("--attention-config.indexer_kv_dtype=nvfp4",),
        ("nvfp4", "mxfp4"),
    ),
    "kv cache dtype": (None, ("--kv-cache-dtype", "fp8_e5m2"), ("--kv-cache-dtype fp8_e5m2",)),
    # 64 MiB of KV cache (VLLM_CPU_KVCACHE_SPACE unset: it would override the flag) for 1M
    # positions; vLLM's own engine figures for these settings are 0.51 GiB needed and 792 tokens.
    "kv pool too small": (
        None,
        ("--max-model-len", "1048576", "--kv-cache-memory-bytes", str(64 << 20)),
        (
            "--max-model-len 1048576 needs 0.505 GiB",
            "has 0.062 GiB (--kv-cache-memory-bytes)",
            "at most 792",
        ),
    ),
}
UNSET = {"kv pool too small": ("VLLM_CPU_KVCACHE_SPACE",)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ckpt_fp8):
    """The refusals' shared run directory, its vLLM cache warmed by one untimed refusal (what a
    second start on a machine sees)."""
    d = tmp_path_factory.mktemp("refusals")
    _serve_fails(d, ckpt_fp8, "--tensor-parallel-size", "4")
    return d


@pytest.mark.serve_first
@pytest.mark.parametrize("case", list(CASES))
def test_refused_early_in_one_line(case, tmp_path, run_dir, ckpt_fp8):
    make, args, needles = CASES[case]
    ckpt = make(tmp_path, ckpt_fp8) if make else ckpt_fp8
    seconds, lines = _serve_fails(run_dir, ckpt, *args, unset=UNSET.get(case, ()))
    last = lines[-1]
    assert "dsv4" in last.lower() or "DeepSeek V4" in last or "config.json" in last, last
    for needle in needles:
        assert needle in last, (needle, last)
    assert seconds <= EARLY_S, f"{case}: exited after {seconds:.1f} s ({last})"
    engine = [ln for ln in lines if "EngineCore" in ln]
    assert not engine, f"{case}: refused only after the engine process started: {engine[:3]}"
