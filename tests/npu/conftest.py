# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the npu backend on CPU: the torch_npu stub (tests/stubs/torch_npu) with controls."""

from __future__ import annotations

import importlib
import sys

import pytest

from vllm_dsv4_hw.ops.npu import _vendor
from vllm_dsv4_hw.ops.registry import REGISTRY


@pytest.fixture(autouse=True)
def _fresh_npu_state():
    """Every test starts with a quiet stub (no NPU visible, no injected failures) and every
    vendor path enabled, and leaves it that way."""
    ctl = importlib.import_module("torch_npu._control")
    npu = importlib.import_module("torch_npu.npu")
    ctl.reset()
    npu.reset_log()
    _vendor.reset_fallbacks()
    REGISTRY.clear_cache()
    yield
    ctl.reset()
    npu.reset_log()
    _vendor.reset_fallbacks()
    REGISTRY.clear_cache()


@pytest.fixture
def stub():
    """The stub module; ``stub._control`` sets availability, counts calls, injects failures."""
    import torch_npu

    assert getattr(torch_npu, "IS_STUB", False), "tests must run against tests/stubs/torch_npu"
    return torch_npu


@pytest.fixture
def npu_device(stub):
    """An 'Ascend host' whose NPU runs on CPU tensors: torch.npu.is_available() is True, so the
    dispatcher's npu probe passes and 'npu' resolves to the npu backend."""
    stub._control.available = True
    REGISTRY.clear_cache()
    yield stub
    stub._control.available = False
    REGISTRY.clear_cache()


@pytest.fixture
def no_torch_npu(monkeypatch):
    """A host without torch_npu: the import fails and find_spec finds nothing."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    REGISTRY.clear_cache()
    yield
    REGISTRY.clear_cache()


@pytest.fixture
def ascend_ops(stub):
    """vllm-ascend's custom ops 'loaded in this process': the CPU stubs of
    tests/stubs/vllm_ascend_ops_stub registered as torch.ops._C_ascend and the detection marker set
    (switched off again afterwards)."""
    import vllm_ascend_ops_stub

    with vllm_ascend_ops_stub.active(True):
        _vendor.reset_fallbacks()
        REGISTRY.clear_cache()
        yield vllm_ascend_ops_stub
    _vendor.reset_fallbacks()
    REGISTRY.clear_cache()
