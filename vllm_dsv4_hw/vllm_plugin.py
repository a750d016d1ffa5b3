"""vLLM entry points (``pyproject.toml``).

* ``vllm.general_plugins`` -> :func:`register` (runs in every vLLM process): registers our
  ``DeepseekV4ForCausalLM`` in vLLM's ``ModelRegistry`` (replacing the built-in architecture, which
  needs CUDA-only or AMX-only kernels) and our quantization config ``dsv4_hw_fp8`` (weights as
  shipped; it claims the DeepSeek V4 FP8 checkpoints before vLLM's CUDA-only ``deepseek_v4_fp8``).
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

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_CLASS = "vllm_dsv4_hw.model.vllm_model:DSV4ForCausalLM"
PLATFORM_CLASS = "vllm_dsv4_hw.platform.vllm_cpu.DSV4HwCpuPlatform"

_registered = False


def _route_logs_through_vllm() -> None:
    """vLLM configures handlers for the ``vllm`` logger namespace only; give our package's loggers
    the same handlers and level so that our INFO lines appear in the server log."""
    ours = logging.getLogger("vllm_dsv4_hw")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm import ModelRegistry

    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_dsv4_hw.quant.config import QUANT_METHOD, DSV4HwQuantConfig

    _route_logs_through_vllm()
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    register_quantization_config(QUANT_METHOD)(DSV4HwQuantConfig)
    if envs.trap_c_ops():
        from vllm_dsv4_hw.tools.c_op_trap import install
        install(envs.trap_c_ops())
    logger.debug("dsv4-hw: registered %s -> %s", ARCHITECTURE, MODEL_CLASS)


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
