# SPDX-License-Identifier: Apache-2.0
"""The foreign platform's worker: vLLM's CPU worker minus its built-in-platform assumptions.

vLLM's ``Worker`` asks ``current_platform.is_cpu()`` / ``is_cuda_alike()`` / ``is_xpu()`` to pick the
weights' memory pool and otherwise asks for a sleep-mode allocator, which only CUDA / XPU have
("Sleep mode allocator is not available on platform ..."): an OOT platform's worker owns its memory,
as vllm-ascend's NPU worker does. Everything else (threads, KV cache sizing, the CPU model runner)
is vLLM's CPU worker, since this platform's device is the host CPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from vllm.v1.worker.cpu_worker import CPUWorker


class ForeignWorker(CPUWorker):
    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        return nullcontext()  # plain host allocations: this platform has no sleep mode
