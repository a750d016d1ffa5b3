# SPDX-License-Identifier: Apache-2.0
"""The plugin's vLLM platform for CPU-only machines (``vllm.platform_plugins``).

vLLM's own CPU platform would run DeepSeek V4 on its compiled CPU kernels (``_C`` AMX / AVX-512
BF16 operators), which machines without those instructions, and vendor forks of vLLM, do not have.
This platform keeps everything of vLLM's CPU platform (worker, memory, threads). What DeepSeek V4
needs on any platform (the launch checks, 256-position blocks, the hybrid KV cache manager) is
``engine.launch_rules``, which vLLM applies through the config hook the plugin registers; this class
applies them once more (idempotent) and changes only what vLLM's CPU platform does differently:

* chunked prefill and prefix caching stay as the user set them: vLLM's CPU platform turns both off
  for MLA models because its CPU MLA kernels lack them; our ops support both;
* the KV cache's size set by ``VLLM_CPU_KVCACHE_SPACE`` (read by vLLM's CPU hook) is checked against
  one request of ``--max-model-len`` right after that hook, still in the first process.

With ``VLLM_DSV4_HW_MODEL_OWNER=vendor`` the model is not ours, so it is vLLM's CPU platform as is.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.engine.launch_rules import BLOCK_SIZE, LaunchConfigError, settle_launch
from vllm_dsv4_hw.engine.serve_checks import check_kv_capacity

logger = init_logger(__name__)

PlatformConfigError = LaunchConfigError  # the name callers and tests know


def is_deepseek_v4(vllm_config) -> bool:
    mc = vllm_config.model_config
    return mc is not None and getattr(mc.hf_config, "model_type", None) == "deepseek_v4"


class DSV4HwCpuPlatform(CpuPlatform):
    device_name: str = "cpu"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if not is_deepseek_v4(vllm_config) or envs.model_owner() != "ours":
            super().check_and_update_config(vllm_config)
            return
        # the rules every platform gets through the model's config hook (it ran already in the
        # first process; here again for vLLMs without that hook, and for unit tests)
        settings = settle_launch(vllm_config)
        sched = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        saved = (
            sched.enable_chunked_prefill,
            cache.enable_prefix_caching,
            sched.max_num_batched_tokens,
        )
        super().check_and_update_config(vllm_config)
        sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = (
            saved
        )
        check_kv_capacity(vllm_config, settings)  # vLLM's hook above read VLLM_CPU_KVCACHE_SPACE
        cache.block_size = BLOCK_SIZE
        sched.disable_hybrid_kv_cache_manager = False
        logger.info(
            "dsv4-hw: DeepSeek V4 on the plugin's CPU platform: block size %d, hybrid KV "
            "cache manager, chunked prefill %s, prefix caching %s",
            BLOCK_SIZE,
            sched.enable_chunked_prefill,
            cache.enable_prefix_caching,
        )
