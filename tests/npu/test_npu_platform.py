# SPDX-License-Identifier: Apache-2.0
"""The NPU platform decision (standalone / cooperating with vllm-ascend / none) and the stream layer
on torch.npu (the stub's recording streams and events)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from vllm_dsv4_hw.platform import npu as npu_platform
from vllm_dsv4_hw.platform.device import adaptor_for
from vllm_dsv4_hw.platform.npu import choose_npu_platform, vllm_ascend_ops, vllm_ascend_plugin
from vllm_dsv4_hw.platform.streams import AuxStreams, stream_module

USABLE = (True, "torch_npu 2.13.0 with 8 NPU(s)")


def test_no_npu_activates_no_platform():
    c = choose_npu_platform((False, "torch_npu is not installed"), (True, True, "x"))
    assert c.platform_class is None and c.mode == "none"
    assert "torch_npu is not installed" in c.reason


def test_vllm_ascend_present_means_cooperate():
    c = choose_npu_platform(USABLE, (True, True, "vllm-ascend platform plugin 'ascend'"))
    assert c.platform_class is None and c.mode == "cooperate"
    assert "NPUPlatform is the active platform" in c.reason and "only one" in c.reason


@pytest.mark.parametrize(
    "plugin",
    [
        (False, False, "vllm-ascend is not installed"),
        (True, False, "VLLM_PLUGINS does not enable it"),
    ],
)
def test_without_active_vllm_ascend_no_platform_and_the_fix_is_named(plugin):
    c = choose_npu_platform(USABLE, plugin)
    assert c.platform_class is None and c.mode == "unsupported"
    assert plugin[2] in c.reason and "install vllm-ascend" in c.reason


class _EP:
    def __init__(self, name, value):
        self.name, self.value = name, value


@pytest.mark.parametrize(
    "allowed,expect", [(None, True), ("ascend,dsv4_hw", True), ("dsv4_hw", False)]
)
def test_vllm_plugins_allowlist_is_respected(monkeypatch, allowed, expect):
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: (
            [_EP("ascend", "vllm_ascend:register")] if group == "vllm.platform_plugins" else []
        ),
    )
    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    installed, ok, detail = vllm_ascend_plugin()
    assert installed and ok is expect
    if not expect:
        assert "VLLM_PLUGINS" in detail


def test_this_machine_has_no_vllm_ascend():
    installed, _, detail = vllm_ascend_plugin()
    assert not installed and "not installed" in detail
    assert vllm_ascend_ops() == {}  # vllm_ascend is not loaded: nothing is looked up
    assert choose_npu_platform().mode == "none"  # the stub reports no NPU by default


def test_stub_reports_an_npu_when_asked(npu_device):
    ok, why = npu_platform.probe_torch_npu()
    assert ok and "1 NPU(s)" in why
    assert choose_npu_platform().mode == "unsupported"


# -- streams on torch.npu -----------------------------------------------------------------------
def test_npu_stream_module_is_torch_npu(stub):
    assert adaptor_for("npu").capabilities.streams
    assert stream_module("npu") is torch.npu is stub.npu
    assert stream_module("cpu") is None


def test_aux_streams_on_npu_order_branches_with_events(npu_device):
    log = npu_device.npu.log
    aux = AuxStreams("npu", 2)
    assert aux.parallel
    seen = []
    with aux.branch(0):
        seen.append(torch.npu.current_stream().name)
    with aux.branch(1):
        seen.append(torch.npu.current_stream().name)
    seen.append(torch.npu.current_stream().name)
    aux.join()
    assert seen == ["aux0", "aux1", "default0"]
    ordered = [e for e in log if e[0] not in ("new_stream",)]
    assert ordered == [
        ("wait_stream", "aux0", "default0"),
        ("record", "aux0"),
        ("wait_stream", "aux1", "default0"),
        ("record", "aux1"),
        ("wait_event", "default0", "aux0"),
        ("wait_event", "default0", "aux1"),
    ]


def test_aux_streams_on_npu_respect_the_multi_stream_setting(npu_device, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_MULTI_STREAM", "0")
    aux = AuxStreams("npu", 2)
    assert not aux.parallel
    with aux.branch(0):
        pass
    aux.join()
    assert [e for e in npu_device.npu.log if e[0] != "new_stream"] == []
