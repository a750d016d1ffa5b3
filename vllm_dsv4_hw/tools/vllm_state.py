"""vLLM's parallel state for one process, as a worker sets it up, for code that builds the model's
vLLM layers outside vLLM's engine (benchmarks, tests): vLLM's linear layers and parameters read
the tensor-parallel rank and size from it.

``single_rank()`` initializes vLLM's distributed environment with world size 1 (gloo: one rank
needs no device collective) and tensor / pipeline parallel size 1, once per process; later calls
are no-ops.
"""

from __future__ import annotations

import socket

_DONE = {"ok": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank() -> None:
    if _DONE["ok"]:
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        _DONE["ok"] = True
        return
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ps.ensure_model_parallel_initialized(1, 1)
    _DONE["ok"] = True
