# SPDX-License-Identifier: Apache-2.0
"""What DeepSeek V4 on this plugin needs from vLLM's configuration, applied on any vLLM platform.

The plugin registers :func:`config_hook` as vLLM's per-architecture config hook for
``DeepseekV4ForCausalLM`` (``vllm.model_executor.models.config.MODELS_CONFIG_MAP``, the table vLLM
consults in ``VllmConfig.__post_init__`` for every platform, before the platform's own
``check_and_update_config``). So the rules below hold under the plugin's CPU platform, vLLM's stock
platforms and a vendor's out-of-tree platform alike, and a bad launch stops in the first process in
one line:

* the launch checks of ``serve_checks`` (config.json, tensors, flags, the KV cache's size where it
  is already known);
* 256-position logical blocks (``--block-size 256``; any other value is refused, naming the fix);
  vLLM later takes the block size from our KV cache specs, whatever a platform set in between;
* the hybrid KV cache manager: ``--disable-hybrid-kv-cache-manager`` is refused, and so is a
  platform whose ``support_hybrid_kv_cache()`` is False (vLLM would turn the manager off: each cache
  kind must be its own KV cache group). That one is a requirement on the vendor's platform.
"""

from __future__ import annotations

import logging

from vllm_dsv4_hw.engine.serve_checks import (
    ServeSettings,
    UnsupportedSettingError,
    check_kv_capacity,
    check_serve_settings,
)

__all__ = ["BLOCK_SIZE", "LaunchConfigError", "config_hook", "settle_launch"]

logger = logging.getLogger(__name__)

BLOCK_SIZE = 256
# Set on cache_config once the rules held: vLLM re-verifies configs in the engine process after the
# KV cache init has set block_size from the smallest cache group's page.
_SETTLED = "_dsv4_hw_launch_settled"


class LaunchConfigError(UnsupportedSettingError):
    """A vLLM setting, or a property of the active platform, DeepSeek V4 cannot run with here."""


def _platform_name() -> tuple[str, bool]:
    from vllm.platforms import current_platform

    return type(current_platform).__name__, bool(current_platform.support_hybrid_kv_cache())


def settle_launch(vllm_config) -> ServeSettings:
    """Check the launch and set what DeepSeek V4 needs (see the module docstring)."""
    settings = check_serve_settings(vllm_config)
    cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
    settled = getattr(cache, _SETTLED, False)
    if cache.user_specified_block_size and cache.block_size != BLOCK_SIZE and not settled:
        raise LaunchConfigError(
            f"DeepSeek V4 on vllm-dsv4-hw needs --block-size {BLOCK_SIZE} (one logical block of "
            f"256 token positions for every cache kind); got --block-size {cache.block_size}. "
            f"Drop the flag or pass --block-size {BLOCK_SIZE}."
        )
    if sched.disable_hybrid_kv_cache_manager:
        raise LaunchConfigError(
            "DeepSeek V4 on vllm-dsv4-hw needs the hybrid KV cache manager (window, compressed "
            "and compressor-state caches are separate KV cache groups); remove "
            "--disable-hybrid-kv-cache-manager."
        )
    name, hybrid = _platform_name()
    if not hybrid:
        raise LaunchConfigError(
            f"DeepSeek V4 on vllm-dsv4-hw needs the hybrid KV cache manager, which the active vLLM "
            f"platform {name} does not support (support_hybrid_kv_cache() is False): the "
            f"platform must return True there (docs/vendor-ci.md)"
        )
    if getattr(sched, "max_num_batched_tokens", None):
        check_kv_capacity(vllm_config, settings)
    if not settled:
        cache.block_size = BLOCK_SIZE
        setattr(cache, _SETTLED, True)
        logger.info(
            "dsv4-hw: DeepSeek V4 launch rules hold on platform %s: block size %d, hybrid "
            "KV cache manager, %s main / %s indexer cache",
            name,
            BLOCK_SIZE,
            settings.main_format,
            settings.indexer_format,
        )
    return settings


def config_hook(previous: type | None) -> type:
    """A ``MODELS_CONFIG_MAP`` entry: ``previous`` (vLLM's DeepSeek V4 hook, which maps the FP8
    checkpoints' quantization name) and then :func:`settle_launch`."""
    if previous is None:
        from vllm.model_executor.models.config import VerifyAndUpdateConfig as previous

    class DSV4HwLaunchRules(previous):
        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            previous.verify_and_update_config(vllm_config)
            settle_launch(vllm_config)

    return DSV4HwLaunchRules
