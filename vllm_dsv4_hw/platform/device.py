# SPDX-License-Identifier: Apache-2.0
"""Device detection and the device adaptor: the one place that knows how device types differ.

``DeviceAdaptor`` is chosen once per device type (like vllm-ascend's ``DeviceOperator``): it holds the
capabilities, the backend preference order and the stream module. The model and the ops never branch
on the device type themselves.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass

import torch

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.platform.capabilities import CPU, NPU_A2_A3, DeviceCapabilities, cuda_capabilities

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceAdaptor:
    device_type: str
    name: str
    capabilities: DeviceCapabilities
    backend_order: tuple[str, ...]  # most preferred first

    @property
    def stream_module(self):
        """torch.cuda / torch.npu, or None where work runs inline (CPU)."""
        if not self.capabilities.streams:
            return None
        return getattr(torch, self.device_type, None)


def npu_available() -> bool:
    """True only when torch_npu imports and sees a device; never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception as exc:  # CANN missing, driver missing...
        logger.debug("torch_npu present but unusable: %s", exc)
        return False


@functools.lru_cache(maxsize=None)
def adaptor_for(device_type: str) -> DeviceAdaptor:
    if device_type == "cuda":
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            name = torch.cuda.get_device_name()
        else:
            major, minor, name = 9, 0, "cuda (not present)"
        declared = envs.CUDA_CAPABILITY.get()
        if declared is not None and declared != (major, minor):
            name = f"{name}, declared sm_{declared[0]}{declared[1]} by VLLM_DSV4_HW_CUDA_CAPABILITY"
            major, minor = declared
        hip = getattr(torch.version, "hip", None) is not None  # ROCm builds answer to "cuda"
        return DeviceAdaptor(
            "cuda", name, cuda_capabilities(major, minor, hip=hip), ("triton", "reference")
        )
    if device_type == "npu":
        return DeviceAdaptor("npu", "Ascend NPU", NPU_A2_A3, ("npu", "triton", "reference"))
    if device_type == "cpu":
        return DeviceAdaptor("cpu", "cpu", CPU, ("reference",))
    raise ValueError(
        f"device type {device_type!r} is not supported by vllm-dsv4-hw; supported: cpu, cuda, npu"
    )


def detect_device_type() -> str:
    """The accelerator this process would use: cuda, then npu, else cpu."""
    forced = envs.device()
    if forced != "auto":
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def current_adaptor() -> DeviceAdaptor:
    return adaptor_for(detect_device_type())
