# SPDX-License-Identifier: Apache-2.0
"""The conformance kit on the CPU: passes with the reference (TRITON_INTERPRET unset, so only the
reference runs by selection), writes JSON and markdown reports, fails (exit 1) on a deliberately
broken backend or layout, rejects bad arguments in one line, and imports nothing from vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.conformance import runner
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import REGISTRY, OpRegistry


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    """As on a plain CPU host: Triton is not runnable, so the kit selects the reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    REGISTRY.clear_cache()
    yield
    REGISTRY.clear_cache()


def _run(capsys, *argv):
    rc = main(["conformance", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cpu_small_passes_with_json_report(capsys, tmp_path):
    path = tmp_path / "cpu.json"
    t0 = time.perf_counter()
    rc, out, err = _run(capsys, "--device", "cpu", "--shapes", "small", "--report", str(path))
    elapsed = time.perf_counter() - t0
    assert rc == 0, out + err
    assert elapsed < 120
    assert "PASSED:" in out and "0 failed" in out and f"report (json): {path}" in out
    d = json.loads(path.read_text())
    assert d["summary"]["ok"] and d["summary"]["failed"] == 0
    assert d["device"]["type"] == "cpu" and d["shapes"] == "small"
    assert d["formats"]["main"] == "fp8" and d["formats"]["indexer"] == "mxfp4"
    rows = d["results"]
    checked_ops = {r["check"] for r in rows if r["ok"] is True and r["backend"] != "-"}
    assert checked_ops == set(api.ALL_OPS)  # every op of the contract, cpu has fp8
    # the dispatcher selects the reference on the CPU; the other backend that runs here is the
    # npu backend on CPU tensors through this session's torch_npu stub (tests/conftest.py)
    assert {r["backend"] for r in rows if r.get("selected")} == {"reference"}
    assert {r["backend"] for r in rows if r["backend"] != "-"} <= {"reference", "npu"}
    # layouts of every format cpu holds, for kv_insert and kv_gather
    layouts = {(r["check"], r["case"]) for r in rows if r["case"].startswith("layout")}
    for op in (api.KV_INSERT, api.KV_GATHER):
        for what in (
            "main fp8_ds_mla E=64",
            "main bf16 E=2",
            "indexer mxfp4 E=64",
            "indexer fp8_indexer E=64",
            "indexer bf16 E=64",
        ):
            assert (op, f"layout {what}") in layouts
    buckets = [r for r in rows if r["check"] == "buckets"]
    assert len(buckets) == 2 * 2 * 3 and all(r["ok"] for r in buckets)
    streams = [r for r in rows if r["check"] == "streams"]
    assert len(streams) == 1 and streams[0]["ok"] is None and "no streams" in streams[0]["detail"]
    assert d["seed"] == int(d["seed"]) and d["versions"]["torch"] == torch.__version__


def test_markdown_report_and_replay(capsys, tmp_path):
    path = tmp_path / "sub" / "cpu.md"
    rc, out, _ = _run(
        capsys,
        "--device",
        "cpu",
        "--ops",
        "rms_norm,sparse_attention",
        "--seed",
        "1234",
        "--report",
        str(path),
    )
    assert rc == 0
    md = path.read_text()
    assert md.startswith("# vllm-dsv4-hw conformance: cpu")
    assert "| result | check | backend | case | detail |" in md
    assert "| PASS | rms_norm | reference* |" in md and "| PASS | sparse_attention |" in md
    assert "seed 1234" in md and "`--seed 1234`" in md
    assert "buckets" not in md  # --ops restricts the run to those ops
    again = tmp_path / "again.md"
    _run(
        capsys,
        "--device",
        "cpu",
        "--ops",
        "rms_norm,sparse_attention",
        "--seed",
        "1234",
        "--report",
        str(again),
    )

    def table(text):
        return [ln.rsplit("(", 1)[0] for ln in text.splitlines() if ln.startswith("| PASS")]

    assert table(again.read_text()) == table(md)  # same seed: same inputs, same verdicts


def _registry_with(op: str, backend: str, fn) -> OpRegistry:
    reg = OpRegistry()
    for name in REGISTRY.ops():
        reg.register(name, "reference", REGISTRY.implementations(name)["reference"].fn)
    reg.register(op, backend, fn)
    return reg


def test_broken_backend_fails_the_run(capsys, tmp_path, monkeypatch):
    """A 'triton' rms_norm that is 1% off, runnable on the CPU through TRITON_INTERPRET=1."""
    ref = REGISTRY.implementations(api.RMS_NORM)["reference"].fn
    reg = _registry_with(api.RMS_NORM, "triton", lambda x, w, eps: ref(x, w, eps) * 1.01)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(runner, "default_registry", lambda: reg)
    path = tmp_path / "broken.json"
    rc, out, _ = _run(capsys, "--device", "cpu", "--ops", "rms_norm,rope", "--report", str(path))
    assert rc == 1
    assert "FAILED:" in out
    d = json.loads(path.read_text())
    bad = [r for r in d["results"] if r["ok"] is False]
    assert bad and all(r["check"] == "rms_norm" and r["backend"] == "triton" for r in bad)
    assert all(r["err_over_tol"] > 1 and "err/tol" in r["detail"] for r in bad)
    ok = [r for r in d["results"] if r["ok"]]
    assert {(r["check"], r["backend"]) for r in ok} == {
        ("rms_norm", "reference"),
        ("rope", "reference"),
    }
    assert any(ln.startswith("FAIL    rms_norm") and "triton" in ln for ln in out.splitlines())


def test_backend_that_writes_into_page_padding_fails(capsys, monkeypatch):
    ref = REGISTRY.implementations(api.KV_INSERT)["reference"].fn

    def sloppy(cache, slots, x, fmt):
        ref(cache, slots, x, fmt)
        cache[:, -1] = 0  # scribbles over the page padding

    reg = _registry_with(api.KV_INSERT, "reference", sloppy)
    monkeypatch.setattr(runner, "default_registry", lambda: reg)
    rc, out, _ = _run(capsys, "--device", "cpu", "--ops", "kv_insert")
    assert rc == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL ")]
    assert len(fails) == 7 and all("outside the written entries changed" in ln for ln in fails)


def test_backend_that_raises_is_a_failure_not_a_crash(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kernel launch failed")

    reg = _registry_with(api.ROPE, "reference", boom)
    monkeypatch.setattr(runner, "default_registry", lambda: reg)
    rc, out, _ = _run(capsys, "--device", "cpu", "--ops", "rope")
    assert rc == 1 and "raised RuntimeError: kernel launch failed" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--device", "tpu"], "use cpu, cuda or npu"),
        (["--device", "cuda"], "no CUDA device is visible"),
        (["--device", "npu"], "--device npu: torch_npu imports but no NPU is visible"),
        (["--report", "out.txt"], "must end in .json or .md"),
        (["--ops", "rms_norm,warp_drive"], "unknown op(s) ['warp_drive']"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_python_m_path_imports_nothing_from_vllm(tmp_path):
    """The command the H200 runs: python -m vllm_dsv4_hw conformance (vLLM is absent there)."""
    code = (
        "import sys, runpy\n"
        "sys.argv = ['vllm_dsv4_hw', 'conformance', '--device', 'cpu', '--ops', "
        "'rms_norm,indexer_topk', '--report', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('vllm_dsv4_hw', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "print('VLLM_MODULES', bad)\n"
        "raise SystemExit(rc)\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_DSV4_HW_") and k != "TRITON_INTERPRET"
    }
    report = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "-c", code, str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "VLLM_MODULES []" in p.stdout
    assert json.loads(report.read_text())["summary"]["ok"]
