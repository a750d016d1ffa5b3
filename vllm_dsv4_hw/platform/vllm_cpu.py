"""The plugin's vLLM platform for CPU-only machines (``vllm.platform_plugins``).

vLLM's own CPU platform would run DeepSeek V4 on its compiled CPU kernels (``_C`` AMX / AVX-512
BF16 operators), which machines without those instructions, and vendor forks of vLLM, do not have.
This platform keeps everything of vLLM's CPU platform (worker, memory, threads) and changes only
what DeepSeek V4 through this plugin needs:

* 256-position logical blocks (``--block-size 256``; anything else is rejected, naming the fix);
* the hybrid KV cache manager on (each cache kind is its own KV cache group);
* chunked prefill and prefix caching stay as the user set them: vLLM's CPU platform turns both off
  for MLA models because its CPU MLA kernels lack them; our ops support both;
* the checkpoint's config.json and the launch flags are validated here, in the first process
  (``model.serve_checks``), so a bad setting stops ``vllm serve`` in one line within seconds.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_dsv4_hw.model.serve_checks import (UnsupportedSettingError, check_kv_capacity,
                                             check_serve_settings)

logger = init_logger(__name__)

BLOCK_SIZE = 256
_VALIDATED = "_dsv4_hw_block_size_validated"


class PlatformConfigError(UnsupportedSettingError):
    """A vLLM setting that cannot work with DeepSeek V4 on this plugin."""


def is_deepseek_v4(vllm_config) -> bool:
    mc = vllm_config.model_config
    return mc is not None and getattr(mc.hf_config, "model_type", None) == "deepseek_v4"


class DSV4HwCpuPlatform(CpuPlatform):
    device_name: str = "cpu"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if not is_deepseek_v4(vllm_config):
            super().check_and_update_config(vllm_config)
            return
        # config.json and the flags, checked here in the first process (one line, within seconds)
        settings = check_serve_settings(vllm_config)
        sched = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        # vLLM re-runs this check in the engine process after the KV cache init has set the block
        # size from the smallest cache group's page: validate the user's value once.
        if (cache.user_specified_block_size and cache.block_size != BLOCK_SIZE
                and not getattr(cache, _VALIDATED, False)):
            raise PlatformConfigError(
                f"DeepSeek V4 on vllm-dsv4-hw needs --block-size {BLOCK_SIZE} (one logical block of "
                f"256 token positions for every cache kind); got --block-size {cache.block_size}. "
                f"Drop the flag or pass --block-size {BLOCK_SIZE}.")
        if sched.disable_hybrid_kv_cache_manager:
            raise PlatformConfigError(
                "DeepSeek V4 on vllm-dsv4-hw needs the hybrid KV cache manager (window, compressed "
                "and compressor-state caches are separate KV cache groups); remove "
                "--disable-hybrid-kv-cache-manager.")
        saved = (sched.enable_chunked_prefill, cache.enable_prefix_caching,
                 sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)
        sched.enable_chunked_prefill, cache.enable_prefix_caching, \
            sched.max_num_batched_tokens = saved
        check_kv_capacity(vllm_config, settings)  # vLLM's hook above read VLLM_CPU_KVCACHE_SPACE
        cache.block_size = BLOCK_SIZE
        setattr(cache, _VALIDATED, True)
        sched.disable_hybrid_kv_cache_manager = False
        logger.info("dsv4-hw: DeepSeek V4 on the plugin's CPU platform: block size %d, hybrid KV "
                    "cache manager, chunked prefill %s, prefix caching %s", BLOCK_SIZE,
                    sched.enable_chunked_prefill, cache.enable_prefix_caching)
