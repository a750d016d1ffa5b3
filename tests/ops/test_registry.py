# SPDX-License-Identifier: Apache-2.0
"""Dispatch: selection per device, overrides, fallback with one warning, explicit-request errors."""

import logging

import pytest

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.registry import REGISTRY, BackendUnavailableError, OpRegistry, UnknownOpError


def _reg():
    reg = OpRegistry()
    reg.register("toy", "reference", lambda: "reference")
    reg.register("toy", "triton", lambda: "triton")
    return reg


def test_every_op_has_a_reference_implementation():
    for op in api.ALL_OPS:
        assert "reference" in REGISTRY.implementations(op), op


def test_triton_backend_set_is_pinned():
    """Where triton imports, every op has its triton implementation: a kernel module that fails
    to import (ops/triton/__init__.py only logs it, so that the reference path survives a broken
    install) must fail the suite rather than shrink the parametrized tests silently."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here")
    missing = [op for op in api.ALL_OPS if "triton" not in REGISTRY.implementations(op)]
    assert not missing, f"ops without a triton implementation: {missing}"


def test_cpu_selects_reference_without_warning(caplog):
    reg = _reg()
    with caplog.at_level(logging.WARNING):
        res = reg.resolve("toy", "cpu")
    assert res.impl.backend == "reference"
    assert res.reason == "best available on this device"
    assert not caplog.records


def test_cuda_without_gpu_falls_back_with_one_warning(caplog):
    reg = _reg()
    with caplog.at_level(logging.WARNING):
        first = reg.resolve("toy", "cuda")
        reg._cache.clear()  # force a second resolution; the warning must not repeat
        second = reg.resolve("toy", "cuda")
    assert first.impl.backend == second.impl.backend == "reference"
    assert "fallback" in first.reason and "triton" in first.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "falls back to the reference backend" in warnings[0].getMessage()
    assert "no CUDA device is visible" in warnings[0].getMessage()


def test_cuda_prefers_triton_when_available(monkeypatch):
    from vllm_dsv4_hw.ops import backends

    monkeypatch.setattr(
        backends,
        "backend_available",
        lambda b, d: (True, "ok") if b in ("triton", "reference") else (False, "no"),
    )
    reg = _reg()
    assert reg.resolve("toy", "cuda").impl.fn() == "triton"


def test_missing_capability_skips_an_implementation(monkeypatch):
    from vllm_dsv4_hw.ops import backends

    monkeypatch.setattr(backends, "backend_available", lambda b, d: (True, "ok"))
    reg = OpRegistry()
    reg.register("toy", "reference", lambda: "reference")
    reg.register("toy", "npu", lambda: "npu", requires=("fp8",))
    res = reg.resolve("toy", "npu")  # Ascend A2/A3 declare no fp8
    assert res.impl.backend == "reference"
    assert "lacks fp8" in res.reason


def test_per_op_override_wins_over_global(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "triton")
    monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", "toy=reference")
    reg = _reg()
    res = reg.resolve("toy", "cuda")
    assert res.impl.backend == "reference"
    assert "VLLM_DSV4_HW_OP_BACKENDS" in res.reason


def test_explicit_request_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "triton")
    reg = _reg()
    with pytest.raises(BackendUnavailableError) as exc:
        reg.resolve("toy", "cpu")
    msg = str(exc.value)
    assert "VLLM_DSV4_HW_BACKEND" in msg and "TRITON_INTERPRET=1" in msg and "Unset" in msg


def test_explicit_request_for_missing_implementation_is_an_error(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", "toy=npu")
    with pytest.raises(BackendUnavailableError, match="has no 'npu' implementation"):
        _reg().resolve("toy", "cpu")


def test_explicit_triton_on_cpu_with_interpreter_runs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "triton")
    reg = _reg()
    reg.clear_cache()
    assert reg.resolve("toy", "cpu").impl.fn() == "triton"


def test_unknown_op_in_override_is_named(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", "no_such_op=reference")
    with pytest.raises(UnknownOpError, match="no_such_op"):
        _reg().resolve("toy", "cpu")


@pytest.mark.parametrize(
    "var,value,needle",
    [
        ("VLLM_DSV4_HW_BACKEND", "cuda", "use one of: auto, reference, triton, npu"),
        ("VLLM_DSV4_HW_OP_BACKENDS", "rms_norm", "op=backend"),
        ("VLLM_DSV4_HW_OP_BACKENDS", "rms_norm=fast", "backend 'fast'"),
        ("VLLM_DSV4_HW_MULTI_STREAM", "maybe", "not a boolean"),
        ("VLLM_DSV4_HW_KV_FORMAT", "fp4", "use one of: auto, bf16, fp8"),
        ("VLLM_DSV4_HW_WEIGHT_PREFETCH", "-1", "whole number >= 0"),
        ("VLLM_DSV4_HW_WEIGHT_PREFETCH", "2k", "whole number >= 0"),
    ],
)
def test_bad_setting_names_variable_and_choices(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(envs.SettingError) as exc:
        for v in envs.ALL_VARS:
            v.get()
    assert var in str(exc.value) and needle in str(exc.value)


def test_resolution_is_cached_per_device_type(monkeypatch):
    from vllm_dsv4_hw.ops import backends

    calls = []

    def avail(b, d):
        calls.append((b, d))
        return True, "ok"

    monkeypatch.setattr(backends, "backend_available", avail)
    reg = _reg()
    for _ in range(5):
        reg.resolve("toy", "cpu")
    assert calls == [("reference", "cpu")]


def test_explain_lists_every_op():
    rows = REGISTRY.explain("cpu")
    assert {r[0] for r in rows} >= set(api.ALL_OPS)
    assert all(r[1] == "reference" for r in rows if r[0] in api.ALL_OPS)


def test_every_backend_is_declared_once_and_named_in_the_settings():
    from vllm_dsv4_hw import envs
    from vllm_dsv4_hw.ops import backends
    from vllm_dsv4_hw.platform.device import adaptor_for

    assert tuple(backends.BACKENDS) == envs.BACKEND_NAMES
    for device_type in ("cpu", "cuda", "npu"):
        order = adaptor_for(device_type).backend_order
        assert set(order) <= set(backends.BACKENDS), (device_type, order)
        assert order[-1] == "reference", f"{device_type}: the reference must be the last resort"
    assert backends._probe("nope", "cpu") == (False, "unknown backend 'nope'")
