# SPDX-License-Identifier: Apache-2.0
"""A Triton kernel that cannot compile for the GPU it meets (ops/fallback.py): under automatic
selection one warning and the reference from then on (the failed call served too); an explicit
request or ``VLLM_DSV4_HW_KERNEL_FAILURES=raise`` raises with what to do; errors that are not
compile failures (validation, the interpreter's) propagate unchanged.

The failure is Triton's own ``CompilationError`` with the message sm_80 gives for an e4m3 store,
raised where the kernel is launched (the interpreter compiles nothing, so it is injected)."""

from __future__ import annotations

import logging

import pytest
import torch
from triton.compiler.errors import CompilationError

from tests.backends import impl
from vllm_dsv4_hw.ops import api, fallback
from vllm_dsv4_hw.ops.fallback import KernelFailedError
from vllm_dsv4_hw.ops.registry import REGISTRY
from vllm_dsv4_hw.ops.triton import norm as triton_norm

SM80 = (
    "type fp8e4nv not supported in this architecture. The supported fp8 dtypes are "
    "('fp8e4b15', 'fp8e5')"
)


class _Kernel:
    """Stands for a @triton.jit kernel: ``kernel[grid](...)`` raises ``error``; counts launches."""

    def __init__(self, error: BaseException):
        self.error, self.launches = error, 0

    def __getitem__(self, _grid):
        def launch(*_args, **_kwargs):
            self.launches += 1
            raise self.error

        return launch


@pytest.fixture(autouse=True)
def _fresh():
    fallback.reset()
    REGISTRY.clear_cache()
    yield
    fallback.reset()
    REGISTRY.clear_cache()


@pytest.fixture
def broken_kernel(monkeypatch):
    kernel = _Kernel(CompilationError("def _rms_norm_kernel(...)", None, SM80))
    monkeypatch.setattr(triton_norm, "_rms_norm_kernel", kernel)
    return kernel


def _inputs(gen):
    return torch.randn(5, 512, generator=gen), torch.rand(512, generator=gen) + 0.5


def test_compile_failure_falls_back_once_with_one_warning(broken_kernel, gen, caplog):
    x, w = _inputs(gen)
    want = impl(api.RMS_NORM, "reference")(x, w, 1e-6)
    with caplog.at_level(logging.WARNING):
        first = impl(api.RMS_NORM, "triton")(x, w, 1e-6)
        later = [impl(api.RMS_NORM, "triton")(x, w, 1e-6) for _ in range(3)]
    assert torch.equal(first, want) and all(torch.equal(y, want) for y in later)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "triton op rms_norm: Triton kernel CompilationError" in warnings[0]
    assert "fp8e4nv not supported" in warnings[0] and "reference implementation" in warnings[0]
    assert "\n" not in warnings[0]
    assert broken_kernel.launches == 1  # never tried again in this process
    assert set(fallback.disabled("triton")) == {api.RMS_NORM}
    # the other ops keep their kernels
    assert fallback.disabled("npu") == {}


@pytest.mark.parametrize(
    "var,value",
    [
        ("VLLM_DSV4_HW_BACKEND", "triton"),
        ("VLLM_DSV4_HW_OP_BACKENDS", "rms_norm=triton"),
        ("VLLM_DSV4_HW_KERNEL_FAILURES", "raise"),
    ],
)
def test_no_fallback_when_asked_for(broken_kernel, gen, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    x, w = _inputs(gen)
    with pytest.raises(KernelFailedError) as exc:
        impl(api.RMS_NORM, "triton")(x, w, 1e-6)
    msg = str(exc.value)
    assert msg.startswith("triton op rms_norm: Triton kernel CompilationError"), msg
    assert "fp8e4nv" in msg and "no fallback" in msg and f"unset {var}" in msg
    assert "\n" not in msg
    assert fallback.disabled("triton") == {}


def test_other_errors_propagate(monkeypatch, gen):
    """Not a compile failure: a bug of ours or of the kernel must not turn into a fallback."""
    monkeypatch.setattr(triton_norm, "_rms_norm_kernel", _Kernel(IndexError("out of bounds")))
    x, w = _inputs(gen)
    with pytest.raises(IndexError, match="out of bounds"):
        impl(api.RMS_NORM, "triton")(x, w, 1e-6)
    with pytest.raises(ValueError, match="weight shape"):  # our validation, before any launch
        impl(api.RMS_NORM, "triton")(x, torch.ones(7), 1e-6)
    assert fallback.disabled("triton") == {}


def test_every_kernel_is_under_the_policy():
    for op in REGISTRY.ops():
        kernel = REGISTRY.implementations(op).get("triton")
        if kernel is not None:
            assert hasattr(kernel.fn, "unguarded"), op


def test_reset_reenables_the_kernel(broken_kernel, gen):
    x, w = _inputs(gen)
    impl(api.RMS_NORM, "triton")(x, w, 1e-6)
    assert api.RMS_NORM in fallback.disabled("triton")
    fallback.reset("triton")
    assert fallback.disabled("triton") == {}
    impl(api.RMS_NORM, "triton")(x, w, 1e-6)
    assert broken_kernel.launches == 2  # tried again (and, still broken, disabled again)
