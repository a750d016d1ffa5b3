# SPDX-License-Identifier: Apache-2.0
"""Which backend can run on which device type, and why not (answers are cached per process)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from vllm_dsv4_hw.platform.capabilities import DeviceCapabilities
from vllm_dsv4_hw.platform.device import adaptor_for


def _triton_available(device_type: str) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed (pip install triton)"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device is visible"
        return True, "triton with a CUDA device"
    if device_type == "npu":
        # triton-ascend installs itself as `triton` and only offers the ascend backend.
        try:
            from importlib.metadata import PackageNotFoundError, version

            import triton.backends  # noqa: F401

            try:
                version("triton-ascend")
            except PackageNotFoundError:
                return False, "the installed triton is not triton-ascend"
        except Exception as exc:  # pragma: no cover - depends on vendor install
            return False, f"triton-ascend is unusable: {exc}"
        return True, "triton-ascend"
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, "Triton interpreter (TRITON_INTERPRET=1): correct but slow"
        return False, "Triton needs a GPU here; set TRITON_INTERPRET=1 to run kernels on CPU"
    return False, f"no Triton backend for device {device_type!r}"


def _npu_available(device_type: str) -> tuple[bool, str]:
    if device_type != "npu":
        return False, (
            f"the npu backend runs on Ascend NPUs only (torch_npu operators), not on "
            f"{device_type!r}"
        )
    # One sentence naming what is missing (torch_npu, CANN, a visible device) and what to do.
    from vllm_dsv4_hw.platform.npu import probe_torch_npu

    ok, why = probe_torch_npu()
    if not ok:
        return False, why
    return True, f"torch_npu vendor operators ({why})"


def _reference_available(device_type: str) -> tuple[bool, str]:
    return True, "PyTorch reference runs on every device"


# Every backend, declared once: its name (``envs.BACKEND_NAMES`` lists the same names for the
# settings, a test checks both agree) and how to tell whether it runs on a device type. Which one
# a device prefers is its adaptor's ``backend_order`` (``platform/device.py``).
BACKENDS: dict[str, Callable[[str], tuple[bool, str]]] = {
    "reference": _reference_available,
    "triton": _triton_available,
    "npu": _npu_available,
}

_AVAILABILITY: dict[tuple[str, str], tuple[bool, str]] = {}


def backend_available(backend: str, device_type: str) -> tuple[bool, str]:
    """(can run, why), probed once per (backend, device type) and process."""
    key = (backend, device_type)
    if key not in _AVAILABILITY:
        _AVAILABILITY[key] = _probe(backend, device_type)
    return _AVAILABILITY[key]


def _probe(backend: str, device_type: str) -> tuple[bool, str]:
    probe = BACKENDS.get(backend)
    if probe is None:
        return False, f"unknown backend {backend!r}"
    return probe(device_type)


def backend_order(device_type: str) -> tuple[str, ...]:
    return adaptor_for(device_type).backend_order


def device_capabilities(device_type: str) -> DeviceCapabilities:
    return adaptor_for(device_type).capabilities


def clear_cache() -> None:
    _AVAILABILITY.clear()
