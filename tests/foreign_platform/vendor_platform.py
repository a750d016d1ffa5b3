# SPDX-License-Identifier: Apache-2.0
"""``ForeignPlatform``: a vendor's out-of-tree vLLM platform (``PlatformEnum.OOT``) on the host CPU.

It implements the ``Platform`` interface the way a vendor would for its device, with nothing about
DeepSeek V4: whatever the model needs beyond this must come from the plugin itself (its model,
layers, KV cache specs and the config hook it registers), or be one of the documented requirements
on a vendor's platform (``docs/vendor-ci.md``): hybrid KV cache support, a worker, gloo / the
device's collectives, the quantization methods list.
"""

from __future__ import annotations

import os

import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import Platform, PlatformEnum

logger = init_logger("vllm.tests.foreign_platform")  # vLLM logs only its own namespace

WORKER = "tests.foreign_platform.worker.ForeignWorker"


class ForeignPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = "FOREIGN_VISIBLE_DEVICES"
    # A vendor lists its own quantization methods (vllm-ascend does); vLLM appends the ones plugins
    # register (our dsv4_hw_fp8) to this list itself.
    supported_quantization: list[str] = ["fp8", "deepseek_v4_fp8"]

    # The device is the host CPU: its compiled kernels and the C++ stand-ins for vLLM's core Triton
    # kernels (slot mapping) are vLLM's CPU ones, as a vendor's are its device's.
    import_kernels = classmethod(CpuPlatform.import_kernels.__func__)
    register_triton_kernel_overrides = classmethod(
        CpuPlatform.register_triton_kernel_overrides.__func__
    )

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "foreign-cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return 0.0

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        pass

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        pass

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        if parallel.distributed_executor_backend in (None, "uni"):
            parallel.distributed_executor_backend = "mp"
        vllm_config.scheduler_config.async_scheduling = False
        vllm_config.compilation_config.cudagraph_capture_sizes = []
        logger.info("foreign platform: worker %s", parallel.worker_cls)
