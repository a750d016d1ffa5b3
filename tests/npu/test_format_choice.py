# SPDX-License-Identifier: Apache-2.0
"""Cache formats from device capabilities: auto picks the most compact one the device holds (one
log line saying which and why); an explicit format the device cannot hold is a clear error; the
CLI's --device plans and reports for another device than the local one."""

from __future__ import annotations

import json
import logging
import os

import pytest

from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.kv_cache import format_choice
from vllm_dsv4_hw.kv_cache.format_choice import (
    FormatUnsupportedError,
    choose_formats,
    supported_formats,
)
from vllm_dsv4_hw.ops.registry import REGISTRY
from vllm_dsv4_hw.platform.capabilities import CPU, NPU_A2_A3, cuda_capabilities


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch):
    monkeypatch.setattr(format_choice, "_LOGGED", set())


@pytest.mark.parametrize(
    "device,main_fmt,idx_fmt",
    [("cpu", "fp8", "mxfp4"), ("cuda", "fp8", "mxfp4"), ("npu", "bf16", "bf16")],
)
def test_auto_takes_the_best_the_device_holds(device, main_fmt, idx_fmt):
    c = choose_formats(device, log=False)
    assert (c.main, c.indexer) == (main_fmt, idx_fmt)
    assert c.main_source == c.indexer_source == "auto"


def test_npu_reason_names_the_missing_capabilities(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_hw"):
        c = choose_formats("npu")
        choose_formats("npu")  # same choice again: no second line
    lines = [r.getMessage() for r in caplog.records if "KV cache formats" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    assert "npu" in line and "main bf16, indexer bf16" in line
    assert "lacks fp8 (e4m3) storage" in line and "MXFP4" in line
    assert c.reason in line


def test_ampere_keeps_the_compact_formats():
    """sm_80 has no e4m3 conversion instructions; the kernels' integer paths keep fp8 entries."""
    caps = cuda_capabilities(8, 0)
    assert caps.fp8 and not caps.fp8_cvt
    assert cuda_capabilities(8, 9).fp8_cvt and cuda_capabilities(12, 0).fp8_cvt
    assert supported_formats("main", caps) == ("fp8", "bf16")
    assert supported_formats("indexer", caps) == ("mxfp4", "fp8", "bf16")
    c = choose_formats("cuda", caps=caps, log=False)
    assert (c.main, c.indexer) == ("fp8", "mxfp4")


def test_supported_formats_per_device():
    assert supported_formats("main", CPU) == ("fp8", "bf16")
    assert supported_formats("indexer", NPU_A2_A3) == ("bf16",)
    with pytest.raises(ValueError):
        supported_formats("window", CPU)


@pytest.mark.parametrize(
    "var,value,kind",
    [
        ("VLLM_DSV4_HW_KV_FORMAT", "fp8", "main KV"),
        ("VLLM_DSV4_HW_INDEXER_FORMAT", "mxfp4", "indexer key"),
        ("VLLM_DSV4_HW_INDEXER_FORMAT", "fp8", "indexer key"),
    ],
)
def test_unsupported_explicit_format_is_a_clear_error(monkeypatch, var, value, kind):
    monkeypatch.setenv(var, value)
    with pytest.raises(FormatUnsupportedError) as exc:
        choose_formats("npu")
    msg = str(exc.value)
    assert f"{var}={value}" in msg and "device 'npu'" in msg and f"{value} {kind}" in msg
    assert "lacks" in msg and f"Use {var}=bf16" in msg and "auto" in msg


def test_explicit_supported_format_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_KV_FORMAT", "bf16")
    monkeypatch.setenv("VLLM_DSV4_HW_INDEXER_FORMAT", "fp8")
    c = choose_formats("cuda", log=False)
    assert (c.main, c.indexer) == ("bf16", "fp8")
    assert c.main_source == "VLLM_DSV4_HW_KV_FORMAT" and "requested by" in c.reason


# -- CLI ------------------------------------------------------------------------------------------
def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_kv_plan_defaults_follow_the_device(capsys):
    rc, out, err = _run(
        capsys, "kv-plan", "--model", "v4-flash", "--context", "1M", "--device", "npu", "--json"
    )
    assert rc == 0, err
    d = json.loads(out)
    assert d["device"] == "npu"
    assert (d["main_format"], d["indexer_format"]) == ("bf16", "bf16")
    assert (
        round((d["breakdown"]["compressed_kv"] + d["breakdown"]["indexer_keys"]) / 2**30, 3)
        == 6.719
    )  # spec section 7, V4-Flash bf16 / bf16
    rc, out, _ = _run(
        capsys, "kv-plan", "--model", "v4-flash", "--context", "1M", "--device", "cuda", "--json"
    )
    d = json.loads(out)
    assert d["main_format"] == "fp8" and d["indexer_format"] == "mxfp4"


def test_kv_plan_text_says_why(capsys):
    rc, out, _ = _run(
        capsys, "kv-plan", "--model", "v4-pro", "--context", "128k", "--device", "npu"
    )
    assert rc == 0
    assert "main bf16, indexer bf16" in out
    assert "formats for npu (Ascend NPU): main bf16: the device lacks fp8" in out


def test_kv_plan_unsupported_format_for_device_is_one_line(capsys):
    rc, out, err = _run(
        capsys,
        "kv-plan",
        "--model",
        "v4-pro",
        "--context",
        "1M",
        "--device",
        "npu",
        "--indexer-format",
        "mxfp4",
    )
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--indexer-format=mxfp4" in err and "device 'npu'" in err
    assert "--indexer-format=bf16" in err


def test_info_for_another_device(capsys):
    rc, out, err = _run(capsys, "info", "--device", "npu", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["device"]["type"] == "npu"
    assert d["device"]["capabilities"]["fp8"] is False
    assert d["device"]["backend_order"] == ["npu", "triton", "reference"]
    assert d["device"]["formats"]["main"] == "bf16"
    rows = {r["op"]: r for r in d["ops"]}
    # this test session has the stub with no NPU visible: every op falls back and says why
    assert all(r["backend"] == "reference" for r in rows.values())
    assert "no NPU is visible" in rows["sparse_attention"]["reason"]
    rc, out, _ = _run(capsys, "info", "--device", "npu")
    assert "device: npu (Ascend NPU)" in out and "cache formats: main bf16, indexer bf16" in out


def test_info_for_npu_with_an_npu(capsys, npu_device):
    d = json.loads(_run(capsys, "info", "--device", "npu", "--json")[1])
    rows = {r["op"]: r["backend"] for r in d["ops"]}
    assert rows["sparse_attention"] == rows["indexer_topk"] == rows["rms_norm"] == "npu"
    assert rows["compressor_pool"] == "reference"


@pytest.fixture
def _declared_capability_restored(monkeypatch):
    """``--device cuda:M.m`` declares the capability for the process; undo it after the test."""
    from vllm_dsv4_hw.platform.device import adaptor_for

    monkeypatch.delenv("VLLM_DSV4_HW_CUDA_CAPABILITY", raising=False)
    yield
    os.environ.pop("VLLM_DSV4_HW_CUDA_CAPABILITY", None)
    adaptor_for.cache_clear()
    REGISTRY.clear_cache()


@pytest.mark.parametrize(
    "target,cvt",
    [("cuda:8.0", False), ("cuda:8.6", False), ("cuda:8.9", True), ("cuda:12.0", True)],
)
def test_targets_by_compute_capability(capsys, _declared_capability_restored, target, cvt):
    """Every CUDA target keeps the compact formats (3.432 GiB per 1M-token V4-Flash sequence);
    below sm_89 there is no e4m3 conversion instruction, and every CUDA target decodes e4m3 in the
    hot kernels with the packed PTX decode; the ops get the triton backend there."""
    rc, out, err = _run(
        capsys, "kv-plan", "--model", "v4-flash", "--context", "1M", "--device", target, "--json"
    )
    assert rc == 0, err
    d = json.loads(out)
    assert (d["main_format"], d["indexer_format"]) == ("fp8", "mxfp4")
    assert round(d["compressed_plus_indexer_gib"], 3) == 3.432
    rc, out, err = _run(capsys, "info", "--device", target, "--json")
    assert rc == 0, err
    dev = json.loads(out)["device"]
    assert dev["capabilities"]["fp8"] and dev["capabilities"]["fp8_cvt"] is cvt
    assert f"declared sm_{target[5:].replace('.', '')}" in dev["name"]
    assert dev["capabilities"]["ptx_inline"]
    assert dev["e4m3"].startswith("packed PTX integer decode in sparse_attention")
    assert {r["backend"] for r in json.loads(out)["ops"]} == {"triton"}


@pytest.mark.parametrize("bad", ["cuda:8", "cuda:x.y", "cuda:13.0", "tpu"])
def test_bad_device_targets_are_one_line(capsys, bad):
    assert main(["info", "--device", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --device" in err[0], err
