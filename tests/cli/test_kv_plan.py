# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw kv-plan``: spec figures through the CLI (in-process and as a subprocess),
config.json input, capacity, and bad arguments (non-zero exit, one line on stderr)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.config import V4_FLASH

GIB = 2**30
M = 1_048_576
SPEC_ROWS = [  # spec section 7: compressed KV + indexer keys per sequence at 1M, GiB
    ("v4-pro", "bf16", "bf16", 9.617),
    ("v4-pro", "fp8", "fp8", 5.382),
    ("v4-pro", "fp8", "mxfp4", 4.914),
    ("v4-flash", "bf16", "bf16", 6.719),
    ("v4-flash", "fp8", "fp8", 3.760),
    ("v4-flash", "fp8", "mxfp4", 3.432),
]
REQUIRED_KEYS = {
    "bytes_per_sequence",
    "gib_per_sequence",
    "breakdown",
    "baseline_v32_gib",
    "page_buckets",
    "padding_bytes",
}


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *argv):
    rc, out, err = run_main(capsys, "kv-plan", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def check_spec_row(d, model, main_fmt, idx_fmt, gib):
    assert REQUIRED_KEYS <= d.keys()
    b = d["breakdown"]
    assert round((b["compressed_kv"] + b["indexer_keys"]) / GIB, 3) == pytest.approx(gib, abs=1e-9)
    assert (
        b["compressed_kv"] + b["indexer_keys"] + b["window"] + b["compressor_state"]
        == d["bytes_per_sequence"]
    )
    assert d["gib_per_sequence"] == d["bytes_per_sequence"] / GIB
    layers = 61 if model == "v4-pro" else 43
    assert d["baseline_v32_gib"] == 1408 * M * layers / GIB
    assert len({p["page_bytes"] for p in d["page_buckets"]}) <= 3
    assert 0 < d["padding_bytes"] < 0.01 * d["bytes_per_sequence"]
    assert set(b["kinds"]) == {
        "c4a_kv",
        "c128a_kv",
        "indexer_kv",
        "window_kv",
        "c4a_state",
        "c128a_state",
        "indexer_state",
    }
    assert sum(k["padding_bytes"] for k in b["kinds"].values()) == d["padding_bytes"]
    if model == "v4-pro" and main_fmt == idx_fmt == "bf16":
        assert round(d["baseline_v32_gib"], 3) == 83.875
        assert round(b["window"] / GIB, 4) == 0.0074
        assert round(b["compressor_state"] / GIB, 4) == 0.0174
        assert round(d["ratio"], 1) == 8.7


@pytest.mark.parametrize("model,main_fmt,idx_fmt,gib", SPEC_ROWS)
def test_spec_rows_in_process(capsys, model, main_fmt, idx_fmt, gib):
    d = plan_json(
        capsys,
        "--model",
        model,
        "--context",
        str(M),
        "--kv-format",
        main_fmt,
        "--indexer-format",
        idx_fmt,
    )
    check_spec_row(d, model, main_fmt, idx_fmt, gib)


def _cli(*argv, script=False):
    if script:
        exe = Path(sys.executable).with_name("vllm-dsv4-hw")
        if not exe.exists():
            pytest.skip("console script vllm-dsv4-hw is not installed next to the interpreter")
        cmd = [str(exe), *argv]
    else:
        cmd = [sys.executable, "-m", "vllm_dsv4_hw", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSV4_HW_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_spec_rows_subprocess():
    # One process per row: `python -m vllm_dsv4_hw` (kv-plan imports no torch, so this is fast).
    for model, main_fmt, idx_fmt, gib in SPEC_ROWS:
        p = _cli(
            "kv-plan",
            "--model",
            model,
            "--context",
            str(M),
            "--kv-format",
            main_fmt,
            "--indexer-format",
            idx_fmt,
            "--json",
        )
        assert p.returncode == 0, p.stderr
        check_spec_row(json.loads(p.stdout), model, main_fmt, idx_fmt, gib)


def test_console_script_and_bad_argument_subprocess():
    p = _cli(
        "kv-plan",
        "--model",
        "v4-flash",
        "--context",
        "1M",
        "--kv-format",
        "fp8",
        "--indexer-format",
        "mxfp4",
        "--memory",
        "80",
        script=True,
    )
    assert p.returncode == 0, p.stderr
    assert "max_sequences" in p.stdout and "37,376" in p.stdout
    p = _cli("kv-plan", "--model", "v4-pro", "--context", "0")
    assert p.returncode != 0 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr
    assert "positive" in p.stderr


def test_human_table(capsys):
    rc, out, err = run_main(
        capsys,
        "kv-plan",
        "--model",
        "v4-pro",
        "--context",
        "1048576",
        "--kv-format",
        "fp8",
        "--indexer-format",
        "mxfp4",
        "--memory",
        "80",
    )
    assert rc == 0 and err == ""
    for text in (
        "c4a_kv",
        "c128a_kv",
        "indexer_kv",
        "window_kv",
        "c4a_state",
        "c128a_state",
        "indexer_state",
        "37,376 B/page",
        "4,352 B/page",
        "1,168 B/page",
        "83.875 GiB",
        "4.914 GiB",
        "max_sequences 16",
        "128 (3 pg)",
    ):
        assert text in out, text
    rc, out, _ = run_main(capsys, "kv-plan", "--model", "v4-pro", "--context", "1")
    assert rc == 0 and "n/a" in out and "max_sequences" not in out


@pytest.mark.parametrize("gib", ["80", "0.5", "141.5"])
def test_max_sequences(capsys, gib):
    d = plan_json(
        capsys,
        "--model",
        "v4-flash",
        "--context",
        "131072",
        "--kv-format",
        "fp8",
        "--indexer-format",
        "fp8",
        "--memory",
        gib,
    )
    assert d["max_sequences"] == int(float(gib) * GIB) // d["allocated_bytes"]
    assert d["allocated_bytes"] == d["bytes_per_sequence"] + d["padding_bytes"]
    assert d["memory_bytes"] == int(float(gib) * GIB)
    assert "max_sequences" not in plan_json(capsys, "--model", "v4-flash", "--context", "131072")


def test_context_suffixes(capsys):
    a = plan_json(capsys, "--model", "v4-flash", "--context", "128k")
    b = plan_json(capsys, "--model", "v4-flash", "--context", "131072")
    assert a == b and a["context"] == 131072
    assert plan_json(capsys, "--model", "v4-flash", "--context", "1M")["context"] == M


@pytest.mark.parametrize("n", [1, 3, 4, 127, 128, 129, 255, 256, 257])
def test_boundary_counts_through_cli(capsys, n):
    d = plan_json(
        capsys,
        "--model",
        "v4-flash",
        "--context",
        str(n),
        "--kv-format",
        "bf16",
        "--indexer-format",
        "bf16",
    )
    k = d["breakdown"]["kinds"]
    assert k["c4a_kv"]["entries_per_layer"] == n // 4
    assert k["indexer_kv"]["entries_per_layer"] == n // 4
    assert k["c128a_kv"]["entries_per_layer"] == n // 128
    assert k["window_kv"]["entries_per_layer"] == min(n, 128)
    assert k["c4a_state"]["entries_per_layer"] == min(n, 8)
    assert k["c128a_state"]["entries_per_layer"] == min(n, 128)
    assert k["c4a_kv"]["pages_per_layer"] == math.ceil(n / 256)
    b = d["breakdown"]
    assert b["compressed_kv"] == 21 * (n // 4) * 1024 + 20 * (n // 128) * 1024
    assert b["indexer_keys"] == 21 * (n // 4) * 256
    assert b["window"] == 43 * min(n, 128) * 1024
    assert b["compressor_state"] == 21 * min(n, 8) * (8192 + 2048) + 20 * min(n, 128) * 4096


def _official_config(ratios, **extra):
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": 4096,
        "num_hidden_layers": len(ratios) - 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        "compress_ratios": ratios,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": M,
        "vocab_size": 129280,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    cfg.update(extra)
    return cfg


def _write(tmp_path, obj, name="config.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_config_json_matches_preset(capsys, tmp_path):
    ratios = list(V4_FLASH.compress_ratios) + [0]  # official list: 43 layers, then MTP 0
    path = _write(tmp_path, _official_config(ratios))
    for arg in (str(path), str(tmp_path)):  # the file, or the folder holding it
        d = plan_json(
            capsys,
            "--model",
            arg,
            "--context",
            "65536",
            "--kv-format",
            "fp8",
            "--indexer-format",
            "mxfp4",
        )
        p = plan_json(
            capsys,
            "--model",
            "v4-flash",
            "--context",
            "65536",
            "--kv-format",
            "fp8",
            "--indexer-format",
            "mxfp4",
        )
        assert d["model"] == str(path)
        d.pop("model"), p.pop("model")
        assert d == p


def test_small_config_json(capsys, tmp_path):
    path = _write(
        tmp_path, _official_config([0, 0, 4, 128, 4, 128, 0], max_position_embeddings=65536)
    )
    n = 1000
    d = plan_json(
        capsys,
        "--model",
        str(path),
        "--context",
        str(n),
        "--kv-format",
        "fp8",
        "--indexer-format",
        "mxfp4",
        "--memory",
        "1",
    )
    assert d["num_layers"] == 6  # the trailing MTP 0 is not a layer
    b = d["breakdown"]
    assert b["compressed_kv"] == 2 * (n // 4) * 584 + 2 * (n // 128) * 584
    assert b["indexer_keys"] == 2 * (n // 4) * 68
    assert b["window"] == 6 * 128 * 584
    assert b["compressor_state"] == 2 * 8 * (8192 + 2048) + 2 * 128 * 4096
    large, middle, small = 64 * 584, 64 * 68, 2 * 584
    blocks_ = math.ceil(n / 256)
    alloc = (
        2 * blocks_ * (large + middle)
        + 2 * blocks_ * small
        + 6 * 3 * large
        + 2 * 3 * large
        + 2 * 5 * middle
        + 2 * 17 * large
    )
    assert d["allocated_bytes"] == alloc
    assert d["max_sequences"] == GIB // alloc
    assert d["baseline_v32_bytes"] == 1408 * n * 6
    rc, _, err = run_main(capsys, "kv-plan", "--model", str(path), "--context", "65537")
    assert rc != 0 and "max_position_embeddings (65536)" in err


def _assert_one_line_failure(rc, out, err, *needles):
    assert rc != 0
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


BAD_ARGS = [
    (["--model", "v4-ultra", "--context", "10"], ["unknown model 'v4-ultra'", "v4-flash"]),
    (["--model", "v4-pro", "--context", "0"], ["positive"]),
    (["--model", "v4-pro", "--context", "-5"], ["positive"]),
    (["--model", "v4-pro", "--context", "1048577"], ["max_position_embeddings (1048576)"]),
    (["--model", "v4-pro", "--context", "lots"], ["--context", "lots"]),
    (["--model", "v4-pro", "--context", "10", "--kv-format", "fp4"], ["--kv-format", "fp4"]),
    (["--model", "v4-pro", "--context", "10", "--kv-format", "mxfp4"], ["--kv-format"]),
    (
        ["--model", "v4-pro", "--context", "10", "--indexer-format", "int8"],
        ["--indexer-format", "int8"],
    ),
    (["--model", "v4-pro", "--context", "10", "--memory", "0"], ["--memory"]),
    (["--model", "v4-pro", "--context", "10", "--memory", "-3"], ["--memory"]),
    (["--model", "v4-pro", "--context", "10", "--memory", "lots"], ["--memory"]),
    (["--model", "v4-pro"], ["--context"]),
    (
        ["--model", "v4-pro", "--context", "10", "--tensor-parallel-size", "16"],
        ["--tensor-parallel-size 16", "3072/16 = 192 cuts the 128-wide FP8 block", "1, 2, 4, 8"],
    ),
    (["--context", "10"], ["--model"]),
]


@pytest.mark.parametrize("argv,needles", BAD_ARGS)
def test_bad_arguments(capsys, argv, needles):
    rc, out, err = run_main(capsys, "kv-plan", *argv)
    _assert_one_line_failure(rc, out, err, *needles)


def test_no_or_unknown_subcommand(capsys):
    _assert_one_line_failure(*run_main(capsys), "COMMAND")
    _assert_one_line_failure(*run_main(capsys, "plan-kv"), "plan-kv")


BAD_CONFIGS = [
    ('{"hidden_size": 4096,', "not valid JSON"),
    ("[1, 2, 3]", "does not hold a JSON object"),
    ("", "not valid JSON"),
]


@pytest.mark.parametrize("text,needle", BAD_CONFIGS)
def test_malformed_config_json(capsys, tmp_path, text, needle):
    path = _write(tmp_path, text)
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(path), "--context", "8"), needle, str(path)
    )


def test_config_json_field_problems(capsys, tmp_path):
    cfg = _official_config([0, 4, 128, 0])
    del cfg["q_lora_rank"]
    path = _write(tmp_path, cfg, "missing.json")
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(path), "--context", "8"), "q_lora_rank"
    )
    path = _write(tmp_path, _official_config([0, 8, 128, 0]), "ratio.json")
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(path), "--context", "8"), "unsupported"
    )
    path = _write(tmp_path, _official_config([0, 4, 128, 0], hidden_size="big"), "value.json")
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(path), "--context", "8"), "malformed"
    )
    path = _write(tmp_path, _official_config([0, 4, 128, 0], head_dim=256), "geometry.json")
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(path), "--context", "8"), "head_dim=256"
    )


def test_unreadable_config_paths(capsys, tmp_path):
    missing = tmp_path / "nope" / "config.json"
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(missing), "--context", "8"), "cannot read"
    )
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    _assert_one_line_failure(
        *run_main(capsys, "kv-plan", "--model", str(empty_dir), "--context", "8"), "cannot read"
    )
    if os.geteuid() != 0:  # root reads anything
        locked = _write(tmp_path, _official_config([0, 4, 128, 0]), "locked.json")
        locked.chmod(0)
        _assert_one_line_failure(
            *run_main(capsys, "kv-plan", "--model", str(locked), "--context", "8"), "cannot read"
        )


def test_tensor_parallel_plan_is_per_rank(capsys):
    rc, out, _ = run_main(capsys, "kv-plan", "--model", "v4-flash", "--context", "1M", "--json")
    one = json.loads(out)
    rc, out, _ = run_main(
        capsys,
        "kv-plan",
        "--model",
        "v4-flash",
        "--context",
        "1M",
        "--json",
        "--tensor-parallel-size",
        "8",
        "--enable-expert-parallel",
    )
    assert rc == 0
    eight = json.loads(out)
    assert eight["parallel"] == {
        **eight["parallel"],
        "tensor_parallel_size": 8,
        "expert_parallel": True,
        "kv_per_rank": "replicated",
    }
    # one shared KV head: each rank's cache is the whole one
    assert eight["bytes_per_sequence"] == one["bytes_per_sequence"]
    rc, out, _ = run_main(
        capsys, "kv-plan", "--model", "v4-flash", "--context", "128k", "--tensor-parallel-size", "2"
    )
    assert rc == 0 and "per rank of --tensor-parallel-size 2: one shared KV head" in out
