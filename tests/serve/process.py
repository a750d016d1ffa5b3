# SPDX-License-Identifier: Apache-2.0
"""A ``vllm serve`` process for tests: launch in its own session, wait for ``/health``, stop the whole
process group, read the log (:class:`VllmServer`; its requests: ``client.ServerClient``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tests.serve.client import ServerClient, ServerError
from tests.support import c_op_trap

if TYPE_CHECKING:
    from typing import Self

STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
# Test-process settings a server must not inherit (it gets them only through ``env``).
DROP_ENV_PREFIXES = ("VLLM_DSV4_HW_",)
DROP_ENV = ("TRITON_INTERPRET", c_op_trap.ENV)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    """``vllm`` next to this interpreter (the venv's CLI), else the OpenAI server module."""
    cli = Path(sys.executable).with_name("vllm")
    if cli.exists():
        return [str(cli), "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved here: the child calls it between fork and exec


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launching thread's process dies, so
    a test process killed by a signal leaves no server behind (vLLM's API server then stops its
    engine and worker). Launch servers from the main thread: the signal follows the thread."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group of ``proc`` (its own session), then SIGKILL; bounded waits."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # Children (engine core, worker) may outlive the API server: clear the group in any case.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class VllmServer(ServerClient):
    """``vllm serve MODEL --host 127.0.0.1 --port P --enforce-eager --max-model-len L *args``.

    ``args``: extra CLI arguments; ``env``: extra environment (wins over :data:`BASE_ENV`);
    ``log_path``: where stdout + stderr go (default: a fresh temporary directory);
    ``--served-model-name`` in ``args`` names the ``model`` field requests carry (default: the
    model path); ``startup_timeout``: seconds from the launch to a healthy ``/health``;
    ``trap_c_ops``: record ``torch.ops._C*`` calls in ``trap_path`` (next to the log), through the
    test-only entry point of ``tests.support.c_op_trap`` (its distribution on ``PYTHONPATH``).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        max_model_len: int = 2048,
        enforce_eager: bool = True,
        port: int | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        name: str = "vllm",
        trap_c_ops: bool = False,
    ) -> None:
        self.model = str(model)
        self.args = [str(a) for a in args]
        self.extra_env = dict(env or {})
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.port = port
        self.startup_timeout = startup_timeout
        self.name = name
        self._tmpdir = None
        if log_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix=f"{name}-")
            log_path = Path(self._tmpdir) / "server.log"
        self.log_path = Path(log_path)
        # tests.support.c_op_trap: every process appends its torch.ops._C* calls here.
        self.trap_path = self.log_path.parent / "c_ops.tsv" if trap_c_ops else None
        self.proc: subprocess.Popen | None = None
        self._launched_at = 0.0
        self._log_file = None
        self._finalizer = None
        self.startup_s: float | None = None
        self.served_model_name = self.model
        if "--served-model-name" in self.args:
            self.served_model_name = self.args[self.args.index("--served-model-name") + 1]

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = vllm_command() + [
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
        ]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + self.args

    def environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in DROP_ENV and not k.startswith(DROP_ENV_PREFIXES)
        }
        env.update(BASE_ENV)
        env["VLLM_CACHE_ROOT"] = str(self.log_path.parent / "vllm-cache")
        env.update(self.extra_env)
        if self.trap_path is not None:  # ahead of the PYTHONPATH the server has otherwise
            env.update(c_op_trap.server_env(self.trap_path, env.get("PYTHONPATH")))
        return env

    def start(self) -> Self:
        """Launch and wait until ``/health`` answers (stopped again if it does not)."""
        self.launch()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> Self:
        """Start the process without waiting for it (:meth:`wait_healthy` waits)."""
        if self.proc is not None:
            raise ServerError(f"{self.name}: already started")
        if self.port is None:
            self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs)
        cmd = self.command()
        self._log_file.write(f"$ {' '.join(cmd)}\n".encode())
        self._log_file.flush()
        self._launched_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            cwd=str(self.log_path.parent),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # noqa: PLW1509 (one prctl call)
        # If the test process ends without stop(), the group still goes down.
        self._finalizer = weakref.finalize(self, _kill_group, self.proc, 5.0)
        self._ready = threading.Event()
        self._healthy_at: float | None = None
        threading.Thread(
            target=self._watch_startup, name=f"{self.name}-startup", daemon=True
        ).start()
        return self

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _watch_startup(self) -> None:
        """Background thread from the launch: notes when ``/health`` first answers 200 (so the
        startup time is right even when nobody waits), or gives up when the process exits or
        ``startup_timeout`` passes."""
        deadline = self._launched_at + self.startup_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._health_ok():
                self._healthy_at = time.monotonic()
                break
            time.sleep(0.5)
        self._ready.set()

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Until ``/health`` answers 200; :class:`ServerError` with the log tail as soon as the
        process exits, or once ``startup_timeout`` (counted from the launch) has passed."""
        if self.proc is None:
            raise ServerError(f"{self.name}: not launched")
        if self.startup_s is not None:
            return
        budget = self.startup_timeout if timeout is None else timeout
        self._ready.wait(max(0.0, self._launched_at + budget - time.monotonic()) + 1.0)
        if self._healthy_at is not None:
            self.startup_s = self._healthy_at - self._launched_at
            return
        code = self.proc.poll()
        if code is not None:
            raise ServerError(
                f"{self.name}: vllm serve exited with {code} before becoming "
                f"healthy\n{self.log_tail()}"
            )
        raise ServerError(
            f"{self.name}: not healthy {budget:.0f} s after its launch\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        _kill_group(self.proc, STOP_TIMEOUT_S)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        """Remove the temporary directory this server made for its log (if it made one)."""
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ---- log --------------------------------------------------------------------------------

    def log_text(self) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log_text().splitlines() if needle in line]

    def model_config(self) -> dict:
        return json.loads((Path(self.model) / "config.json").read_text())

    @property
    def vocab_size(self) -> int:
        return int(self.model_config()["vocab_size"])
