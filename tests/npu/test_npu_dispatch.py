# SPDX-License-Identifier: Apache-2.0
"""Dispatch on 'npu': the npu backend where a torch_npu operator fits, the probe's messages, and
missing torch_npu / CANN / device (fallback with one warning; a clear error when requested)."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.backends import backend_available
from vllm_dsv4_hw.ops.registry import REGISTRY, BackendUnavailableError
from vllm_dsv4_hw.platform.npu import probe_torch_npu

VENDOR_OPS = {
    api.RMS_NORM,
    api.QKV_RMS_NORM,
    api.ROPE,
    api.KV_INSERT,
    api.KV_GATHER,
    api.QNORM_ROPE_KV_INSERT,
    api.COMPRESSOR_STORE,
    api.SPARSE_ATTENTION,
    api.INDEXER_TOPK,
    api.INV_ROPE_FP8_QUANT,
    api.HC_PRE,
    api.HC_SEAM,
    api.HC_POST,
}


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_npu_backend_registers_without_importing_torch_npu():
    import subprocess

    code = (
        "import sys, vllm_dsv4_hw.ops as o; "
        "print('torch_npu' in sys.modules, sorted(op for op in o.REGISTRY.ops() "
        "if 'npu' in o.REGISTRY.implementations(op)))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    imported, ops = p.stdout.strip().split(" ", 1)
    assert imported == "False"
    assert set(eval(ops)) == VENDOR_OPS


def test_npu_device_selects_npu_where_an_operator_fits(npu_device, caplog):
    rows = {op: (b, why) for op, b, why in REGISTRY.explain("npu")}
    assert not _warnings(caplog), "explain() is a report: the reasons are in its rows"
    with caplog.at_level(logging.WARNING):
        for op in REGISTRY.ops():  # dispatching warns once per fallback
            REGISTRY.resolve(op, "npu")
    for op in VENDOR_OPS - {api.INV_ROPE_FP8_QUANT}:
        assert rows[op][0] == "npu", (op, rows[op])
        assert rows[op][1] == "best available on this device"
        assert "torch_npu 0.0.0+stub with 1 NPU(s)" in backend_available("npu", "npu")[1]
    # fp8 epilogue: the npu implementation needs fp8, which Ascend A2/A3 lack
    b, why = rows[api.INV_ROPE_FP8_QUANT]
    assert b == "reference" and "npu: device 'npu' lacks fp8" in why
    # no torch_npu operator: the next backends (triton-ascend absent here -> reference)
    for op in (api.COMPRESSOR_POOL,):
        assert rows[op][0] == "reference"
        assert "npu" not in REGISTRY.implementations(op)
    # one warning per op that skipped a preferred backend (its npu implementation, or the triton
    # one: triton-ascend is absent here), none for the npu-served ops
    warned = {r.getMessage().split()[2] for r in _warnings(caplog)}
    skipped_triton = {
        op
        for op in REGISTRY.ops()
        if op not in VENDOR_OPS and "triton" in REGISTRY.implementations(op)
    }
    assert api.FP8_BLOCK_LINEAR in skipped_triton and api.DECODE_METADATA in skipped_triton
    assert warned == {api.INV_ROPE_FP8_QUANT} | skipped_triton


def test_missing_torch_npu_falls_back_with_one_warning(no_torch_npu, caplog):
    ok, why = backend_available("npu", "npu")
    assert not ok and "torch_npu is not installed" in why and "CANN" in why
    with caplog.at_level(logging.WARNING):
        first = REGISTRY.resolve(api.RMS_NORM, "npu")
        REGISTRY._cache.clear()  # resolve again: the warning must not repeat
        second = REGISTRY.resolve(api.RMS_NORM, "npu")
    assert first.impl.backend == second.impl.backend == "reference"
    assert "npu: torch_npu is not installed" in first.reason
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "rms_norm on npu falls back to the reference backend" in msg
    assert "torch_npu is not installed" in msg


def test_missing_torch_npu_explicit_request_is_a_clear_error(no_torch_npu, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError) as exc:
        REGISTRY.resolve(api.SPARSE_ATTENTION, "npu")
    msg = str(exc.value)
    assert "VLLM_DSV4_HW_BACKEND" in msg and "'npu'" in msg and "Unset" in msg
    assert "torch_npu is not installed" in msg


def test_npu_op_called_without_torch_npu_says_why(no_torch_npu):
    import torch

    from tests.backends import impl
    from vllm_dsv4_hw.ops.npu import NpuUnavailableError

    with pytest.raises(NpuUnavailableError, match="torch_npu is not installed"):
        impl(api.RMS_NORM, "npu")(torch.ones(2, 4), None, 1e-6)


def test_torch_npu_without_cann_is_named(tmp_path, monkeypatch):
    """torch_npu present but its import fails on a CANN library: the message says so and how."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent("""
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    """)
    )
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, why = probe_torch_npu()
    assert not ok
    assert "torch_npu is installed but does not import" in why and "libhccl.so" in why
    assert "set_env.sh" in why


def test_no_visible_npu_is_named(stub):
    stub._control.available = False
    ok, why = probe_torch_npu()
    assert not ok and "no NPU is visible" in why and "ASCEND_RT_VISIBLE_DEVICES" in why
    REGISTRY.clear_cache()
    res = REGISTRY.resolve(api.ROPE, "npu")
    assert res.impl.backend == "reference" and "no NPU is visible" in res.reason


def test_npu_backend_never_runs_on_other_devices():
    ok, why = backend_available("npu", "cuda")
    assert not ok and "Ascend NPUs only" in why
    assert REGISTRY.resolve(api.RMS_NORM, "cpu").impl.backend == "reference"
