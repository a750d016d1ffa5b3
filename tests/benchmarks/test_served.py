# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/served.py`` without a server: its arguments, plan, the commands it gives ``vllm
serve`` and ``vllm bench serve``, the log facts it reads and the JSON it writes."""

from __future__ import annotations

import json

import pytest

from benchmarks import served


def test_defaults_plan_the_issue_runs():
    args = served.parse_args([])
    runs = served.plan(args)
    assert [r.name for r in runs] == [
        "decode-c1", "decode-c8", "decode-c32", "decode-c64",
        "ttft-8192", "ttft-32768", "ttft-131072", "prefix-32768",
    ]  # fmt: skip
    decode = [r for r in runs if r.kind == "decode"]
    assert all((r.input_len, r.output_len) == (1024, 256) for r in decode)
    assert [r.prompts for r in decode] == [8, 32, 128, 256]
    assert all(r.concurrency == 1 for r in runs if r.kind != "decode")
    prefix = runs[-1]
    assert (prefix.prefix_len, prefix.input_len, prefix.prompts) == (32768, 0, 2)
    # the model length covers the longest prompt and its output, in whole 256-position blocks
    assert served.max_model_len(args) == 131072 + 256


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--concurrency", "1,x"], "'x' is not a token count"),
        (["--layers", "0"], "--layers 0"),
        (["--concurrency", "", "--ttft-lengths", "", "--prefix-length", "0"], "nothing to run"),
        (["--cudagraph-mode", "PIECEWISE_ONLY"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        served.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_commands_carry_the_recipe_and_the_run():
    args = served.parse_args(["--layers", "2", "--port", "9000", "--serve-arg=--enforce-eager"])
    serve = served.serve_command(args)
    assert serve[serve.index("serve") + 1] == "/tmp/served-ckpt-v4-flash-2"
    for flag, value in (("--kv-cache-dtype", "fp8"), ("--block-size", "256"), ("--port", "9000")):
        assert serve[serve.index(flag) + 1] == value
    assert "--attention-config.indexer_kv_dtype=mxfp4" in serve and serve[-1] == "--enforce-eager"
    mode = json.loads(serve[serve.index("--compilation-config") + 1])
    assert mode == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    run = served.plan(args)[1]
    bench = served.bench_command(args, run, served.Path("/r"))
    assert bench[bench.index("bench") + 1] == "serve"
    for flag, value in (
        ("--max-concurrency", "8"),
        ("--num-prompts", "32"),
        ("--random-input-len", "1024"),
        ("--random-output-len", "256"),
        ("--base-url", "http://127.0.0.1:9000"),
        ("--result-filename", "decode-c8.vllm.json"),
    ):
        assert bench[bench.index(flag) + 1] == value, flag
    assert "--ignore-eos" in bench and "--save-detailed" in bench


LOG = """(Worker pid=1) INFO [model.py:125] dsv4-hw: resident weights 13062.25 MiB for 12990.5 MiB
(EngineCore pid=2) INFO [kv_cache_utils.py:2327] GPU KV cache size: 1,234,560 tokens, Maximum \
concurrency for 131,328 tokens per request: 9.40x
"""


def test_server_log_facts_and_the_written_json(tmp_path):
    facts = served.parse_server_log(LOG)
    assert facts == {"kv_tokens": 1234560, "kv_max_concurrency": 9.4,
                     "resident_weights_mib": 13062.25}  # fmt: skip
    assert served.parse_server_log("no such lines") == {}
    run = served.Run("prefix-32768", "prefix", 1, 0, 16, 2, 32768)
    result = {"mean_tpot_ms": 5.5, "median_ttft_ms": 80.0, "completed": 2, "failed": 0,
              "ttfts": [1.5, 0.0625], "itls": [[0.1]]}  # fmt: skip
    meta = {"vllm": "0.32.0", "card": "NVIDIA H100", "commit": "abc1234", "date": "d"}
    row = served.record(run, result, facts, meta)
    assert row["mean_tpot_ms"] == 5.5 and row["p99_itl_ms"] is None
    assert row["ttfts_ms"] == [1500.0, 62.5]  # cold, then the prefix hit
    assert row["run"]["prefix_len"] == 32768 and row["kv_tokens"] == 1234560
    assert row["card"] == "NVIDIA H100" and "itls" not in row
    path = served.write(tmp_path / "out", run, row)
    assert path.name == "served-prefix-32768.json"
    assert json.loads(path.read_text()) == row
    decode = served.record(served.Run("decode-c1", "decode", 1, 1024, 256, 8), result, {}, meta)
    assert "ttfts_ms" not in decode
