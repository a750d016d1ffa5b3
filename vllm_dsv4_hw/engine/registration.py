# SPDX-License-Identifier: Apache-2.0
"""Whose ``DeepseekV4ForCausalLM`` serves, decided by ``VLLM_DSV4_HW_MODEL_OWNER`` (default ours).

vLLM runs every ``vllm.general_plugins`` entry point in each process, in the order
``importlib.metadata`` lists the installed distributions (directory order: not something to rely
on), and ``ModelRegistry.register_model`` keeps the last class registered for an architecture.
vllm-ascend's ``ascend_model`` plugin registers its own ``DeepseekV4ForCausalLM`` (and its
``deepseek_v4_fp8`` quantization config), so without a rule the later plugin would win.

* ``ours``: our class is registered and pinned: the registry's table is wrapped so that a later
  ``register_model`` of this one architecture (e.g. vllm-ascend's) is logged and not taken, whatever
  the load order; every other architecture it registers stays. Our ``dsv4_hw_fp8`` quantization
  config and our launch rules (``engine.launch_rules``, vLLM's config hook for the architecture) are
  registered; vLLM appends ``dsv4_hw_fp8`` to the platform's ``supported_quantization`` list itself.
* ``vendor``: none of that is registered: the vendor's class (or vLLM's built-in one when no vendor
  plugin registers it) and its quantization config serve untouched.

:func:`install` takes vLLM's registries as arguments, so tests run it on fresh ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_CLASS = "vllm_dsv4_hw.engine.model:DSV4ForCausalLM"


def describe(entry) -> str:
    """``module:Class`` of a vLLM registry entry (lazy or imported)."""
    module = getattr(entry, "module_name", None)
    name = getattr(entry, "class_name", None)
    if module and name:
        return f"{module}:{name}"
    return str(getattr(entry, "interfaces", None) and entry.interfaces.architecture or entry)


class PinnedModels(dict):
    """vLLM's ``ModelRegistry.models`` with one architecture pinned to our entry."""

    def __init__(self, models: MutableMapping, arch: str, ours) -> None:
        super().__init__(models)
        self.arch, self.ours = arch, ours
        dict.__setitem__(self, arch, ours)

    def __setitem__(self, key, value) -> None:
        if key == self.arch and value is not self.ours:
            logger.info(
                "dsv4-hw: %s -> %s registered after ours; not taken "
                "(VLLM_DSV4_HW_MODEL_OWNER=ours; vendor serves that class)",
                key,
                describe(value),
            )
            return
        super().__setitem__(key, value)


def install(
    owner: str, registry, config_map: MutableMapping | None, register_quant: Callable[[], None]
) -> str:
    """Apply ``owner`` to vLLM's ``ModelRegistry`` (``registry``), its per-architecture config hooks
    (``config_map``; None where this vLLM has none) and quantization registry
    (``register_quant`` registers ours). Returns the log line it wrote."""
    if owner == "vendor":
        current = registry.models.get(ARCHITECTURE)
        line = (
            f"dsv4-hw: {ARCHITECTURE} is left to the vendor's registration "
            f"(VLLM_DSV4_HW_MODEL_OWNER=vendor): vllm-ascend's when its plugin loads, else "
            f"vLLM's built-in (now {describe(current) if current else 'none'}); ours, its "
            f"launch rules and dsv4_hw_fp8 are not registered"
        )
        logger.info(line)
        return line
    from vllm_dsv4_hw.engine.launch_rules import config_hook

    registry.register_model(ARCHITECTURE, MODEL_CLASS)
    if not isinstance(registry.models, PinnedModels):
        registry.models = PinnedModels(registry.models, ARCHITECTURE, registry.models[ARCHITECTURE])
    register_quant()
    hook = "no per-architecture config hooks in this vLLM: checked when the model is built"
    if config_map is not None:
        previous = config_map.get(ARCHITECTURE)
        if getattr(previous, "__name__", "") != "DSV4HwLaunchRules":
            config_map[ARCHITECTURE] = config_hook(previous)
        hook = "launch rules in vLLM's config hook"
    line = (
        f"dsv4-hw: {ARCHITECTURE} is served by vllm_dsv4_hw ({MODEL_CLASS}; "
        f"VLLM_DSV4_HW_MODEL_OWNER=ours: a later registration of it, e.g. vllm-ascend's, is "
        f"not taken; {hook})"
    )
    logger.info(line)
    return line
