# SPDX-License-Identifier: Apache-2.0
"""A ``vllm serve`` process for tests, and a small HTTP client for it (standard library only).

    with VllmServer(ckpt, args=["--dtype", "float32"], env={"VLLM_DSV4_HW_INDEXER_FORMAT": "bf16"},
                    log_path=tmp_path / "server.log") as server:
        out = server.complete([17, 42, 99], max_tokens=8)      # first choice (+ "usage")
        print(out["token_ids"], server.metrics()["vllm:prefix_cache_hits_total"])

The server runs in its own session (``start_new_session``): :meth:`VllmServer.stop` signals the
whole process group (API server, engine core, worker), SIGTERM then SIGKILL, and waits for it; a
finalizer does the same if the test process exits without calling ``stop``. Every wait is bounded.
The log (stdout + stderr) goes to a file; :meth:`VllmServer.log_tail` is what a failing test prints.

Environment: the caller's, minus test-process settings that must not leak into the server
(``TRITON_INTERPRET``, ``VLLM_DSV4_HW_*``), plus :data:`BASE_ENV` (KV space, offline hub, no usage
stats, a cache root next to the log), plus ``env``.

The code lives by concern: the process (``process.py``: :class:`VllmServer`, its environment and
process-group handling), its requests (``client.py``: ``ServerClient``, the errors,
``map_concurrently``) and the session's servers (``pool.py``: ``ServerSpec``, ``ServerPool``); this
module names them all.
"""

from tests.serve.client import (  # noqa: F401 (the public names of the serve-test servers)
    REQUEST_TIMEOUT_S,
    HTTPStatusError,
    ServerClient,
    ServerError,
    map_concurrently,
)
from tests.serve.pool import CKPT_SEED, ServerPool, ServerSpec  # noqa: F401
from tests.serve.process import (  # noqa: F401
    BASE_ENV,
    DROP_ENV,
    DROP_ENV_PREFIXES,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VllmServer,
    free_port,
    vllm_command,
)

__all__ = [
    "BASE_ENV",
    "CKPT_SEED",
    "DROP_ENV",
    "DROP_ENV_PREFIXES",
    "REQUEST_TIMEOUT_S",
    "STARTUP_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "HTTPStatusError",
    "ServerClient",
    "ServerError",
    "ServerPool",
    "ServerSpec",
    "VllmServer",
    "free_port",
    "map_concurrently",
    "vllm_command",
]
