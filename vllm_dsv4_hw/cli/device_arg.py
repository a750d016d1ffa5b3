# SPDX-License-Identifier: Apache-2.0
"""The ``--device`` argument of ``info`` and ``kv-plan``: a device type, or a CUDA target by its
compute capability (``cuda:8.0``), to report or plan for a device this machine does not have."""

from __future__ import annotations

import argparse
import os

DEVICE_TYPES = ("cpu", "cuda", "npu")
HELP_TARGETS = "cpu, cuda, npu, or cuda:MAJOR.MINOR (e.g. cuda:8.0 for an A100)"


def parse_device(raw: str) -> str:
    """argparse ``type``: the value as given, checked."""
    value = raw.strip().lower()
    if value in DEVICE_TYPES:
        return value
    if value.startswith("cuda:"):
        from vllm_dsv4_hw import envs

        try:
            envs.parse_capability("--device", value[len("cuda:") :])
        except envs.SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    raise argparse.ArgumentTypeError(f"unknown device {raw!r}; use {HELP_TARGETS}")


def apply_device(value: str | None) -> str | None:
    """The device type of ``value``; a ``cuda:M.m`` declares that capability for this process
    (``VLLM_DSV4_HW_CUDA_CAPABILITY``, the setting a run on real hardware would use)."""
    if value is None or not value.startswith("cuda:"):
        return value
    os.environ["VLLM_DSV4_HW_CUDA_CAPABILITY"] = value[len("cuda:") :]
    from vllm_dsv4_hw.ops.registry import REGISTRY
    from vllm_dsv4_hw.platform.device import adaptor_for

    adaptor_for.cache_clear()
    REGISTRY.clear_cache()
    return "cuda"
