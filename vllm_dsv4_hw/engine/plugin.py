# SPDX-License-Identifier: Apache-2.0
"""vLLM entry points (``pyproject.toml``).

* ``vllm.general_plugins`` -> :func:`register` (runs in every vLLM process): with
  ``VLLM_DSV4_HW_MODEL_OWNER=ours`` (default) registers our ``DeepseekV4ForCausalLM`` in vLLM's
  ``ModelRegistry`` (replacing the built-in architecture, which needs CUDA-only or AMX-only
  kernels, and pinned against a vendor plugin loaded later: ``engine/registration.py``), our launch rules
  as vLLM's config hook for it (``engine/launch_rules.py``: what any platform then gets) and our
  quantization config ``dsv4_hw_fp8`` (weights as shipped; it claims the DeepSeek V4 FP8
  checkpoints before vLLM's CUDA-only ``deepseek_v4_fp8``); with ``vendor`` none of these.
* ``vllm.platform_plugins`` -> :func:`platform_plugin`: our CPU platform on machines without an
  accelerator (``VLLM_DSV4_HW_PLATFORM=auto``), None elsewhere so that vLLM's built-in or the
  vendor's platform stays; ``on`` / ``off`` force it.

Neither function imports heavy modules at call time beyond what it registers: vLLM calls the
platform plugin while resolving ``current_platform``, so it must not import ``vllm.platforms``.
"""

from __future__ import annotations

import logging

from vllm_dsv4_hw import envs

logger = logging.getLogger(__name__)

ARCHITECTURE = (
    "DeepseekV4ForCausalLM"  # the names live in engine/registration.py; kept here for callers
)
MODEL_CLASS = "vllm_dsv4_hw.engine.model:DSV4ForCausalLM"
PLATFORM_CLASS = "vllm_dsv4_hw.engine.cpu_platform.DSV4HwCpuPlatform"

_registered = False


class _ToVllmHandlers(logging.Handler):
    """Hands our records to the ``vllm`` logger's handlers at emit time: vLLM (re)configures its
    handlers after plugins load in some processes (the API server's), so copies would go stale."""

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if record.levelno >= theirs.getEffectiveLevel():
            theirs.handle(record)


def _route_logs_through_vllm() -> None:
    """vLLM configures handlers for the ``vllm`` logger namespace only; route our package's loggers
    to them (at vLLM's level) so that our INFO lines appear in the server log of every process."""
    ours = logging.getLogger("vllm_dsv4_hw")
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(logging.getLogger("vllm").level or logging.INFO)
    ours.propagate = False


def _config_map():
    """vLLM's per-architecture config hooks (None where this vLLM has no such table)."""
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    except ImportError:
        logger.warning(
            "dsv4-hw: this vLLM has no MODELS_CONFIG_MAP; the launch rules are checked "
            "when the model is built (in the worker), not in the first process"
        )
        return None
    return MODELS_CONFIG_MAP


def _register_quant() -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_dsv4_hw.quant.config import QUANT_METHOD, DSV4HwQuantConfig

    register_quantization_config(QUANT_METHOD)(DSV4HwQuantConfig)


def register() -> None:
    global _registered
    if _registered:
        return
    owner = envs.model_owner()  # a bad value stops here, in one line
    _registered = True
    from vllm import ModelRegistry

    from vllm_dsv4_hw.engine.registration import install

    _route_logs_through_vllm()
    install(owner, ModelRegistry, _config_map() if owner == "ours" else None, _register_quant)


def platform_plugin() -> str | None:
    mode = envs.platform()
    if mode == "off":
        return None
    if mode == "on":
        return PLATFORM_CLASS
    from vllm_dsv4_hw.platform.device import detect_device_type

    device = detect_device_type()
    if device == "npu":
        from vllm_dsv4_hw.platform.npu import choose_npu_platform

        choice = choose_npu_platform()
        if choice.mode != "cooperate":
            logger.warning("dsv4-hw: %s", choice.reason)
        return choice.platform_class
    return PLATFORM_CLASS if device == "cpu" else None
