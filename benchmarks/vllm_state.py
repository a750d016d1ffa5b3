# SPDX-License-Identifier: Apache-2.0
"""vLLM's parallel state for one process, as a worker sets it up, for code that builds the model's
vLLM layers outside vLLM's engine (benchmarks, tests): vLLM's linear layers and parameters read
the tensor-parallel rank and size from it. Not part of the runtime package (the served path gets
its state from vLLM's workers); here, where both its users may import it (tests import
benchmarks, never the other way round).

``single_rank()`` initializes vLLM's distributed environment with world size 1 (gloo: one rank
needs no device collective) and tensor / pipeline parallel size 1, once per process; later calls
are no-ops. ``tensor_parallel_rank(world, rank, init_method)`` does what a vLLM worker of a
``--tensor-parallel-size world`` server does: rank ``rank`` of one tensor-parallel group, whose
collectives go through the communicator vLLM's platform provides (gloo / shared memory on CPU,
NCCL with ``backend="nccl"``).
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
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        ps.ensure_model_parallel_initialized(1, 1)
    _DONE["ok"] = True


def tensor_parallel_rank(
    world: int, rank: int, init_method: str, backend: str = "gloo", local_rank: int | None = None
) -> None:
    """Join a ``world``-rank tensor-parallel group as ``rank`` (every rank calls it)."""
    import os
    import zlib

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    # vLLM's CPU executor names the group's shared-memory segment (the same on every rank).
    os.environ.setdefault("VLLM_DIST_IDENT", f"dsv4hw-{zlib.crc32(init_method.encode()):08x}")
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            local_rank=rank if local_rank is None else local_rank,
            backend=backend,
            distributed_init_method=init_method,
        )
        ps.ensure_model_parallel_initialized(world, 1)
    _DONE["ok"] = True
