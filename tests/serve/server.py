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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

STARTUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
CKPT_SEED = 0

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",      # GiB of KV cache on CPU
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
# Test-process settings a server must not inherit (it gets them only through ``env``).
DROP_ENV_PREFIXES = ("VLLM_DSV4_HW_",)
DROP_ENV = ("TRITON_INTERPRET",)


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error status."""


class HTTPStatusError(ServerError):
    def __init__(self, status: int, body: str, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:2000]}")
        self.status = status
        self.body = body


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


_PRCTL = _load_prctl()      # resolved here: the child calls it between fork and exec


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launching thread's process dies, so
    a test process killed by a signal leaves no server behind (vLLM's API server then stops its
    engine and worker). Launch servers from the main thread: the signal follows the thread."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)     # PR_SET_PDEATHSIG


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


class VllmServer:
    """``vllm serve MODEL --host 127.0.0.1 --port P --enforce-eager --max-model-len L *args``.

    ``args``: extra CLI arguments; ``env``: extra environment (wins over :data:`BASE_ENV`);
    ``log_path``: where stdout + stderr go (default: a fresh temporary directory);
    ``--served-model-name`` in ``args`` names the ``model`` field requests carry (default: the
    model path); ``startup_timeout``: seconds from the launch to a healthy ``/health``;
    ``trap_c_ops``: record ``torch.ops._C*`` calls in ``trap_path`` (next to the log).
    """

    def __init__(self, model: str | os.PathLike, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 max_model_len: int = 2048, enforce_eager: bool = True, port: int | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S, name: str = "vllm",
                 trap_c_ops: bool = False) -> None:
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
        # VLLM_DSV4_HW_TRAP_C_OPS: every process appends its torch.ops._C* calls here.
        self.trap_path = self.log_path.parent / "c_ops.tsv" if trap_c_ops else None
        if self.trap_path is not None:
            self.extra_env.setdefault("VLLM_DSV4_HW_TRAP_C_OPS", str(self.trap_path))
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
        cmd = vllm_command() + [self.model, "--host", "127.0.0.1", "--port", str(self.port),
                                "--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + self.args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in DROP_ENV and not k.startswith(DROP_ENV_PREFIXES)}
        env.update(BASE_ENV)
        env["VLLM_CACHE_ROOT"] = str(self.log_path.parent / "vllm-cache")
        env.update(self.extra_env)
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
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.environment(),
                                     cwd=str(self.log_path.parent), start_new_session=True,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 (one prctl call)
        # If the test process ends without stop(), the group still goes down.
        self._finalizer = weakref.finalize(self, _kill_group, self.proc, 5.0)
        self._ready = threading.Event()
        self._healthy_at: float | None = None
        threading.Thread(target=self._watch_startup, name=f"{self.name}-startup",
                         daemon=True).start()
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
            raise ServerError(f"{self.name}: vllm serve exited with {code} before becoming "
                              f"healthy\n{self.log_tail()}")
        raise ServerError(f"{self.name}: not healthy {budget:.0f} s after its launch"
                          f"\n{self.log_tail()}")

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

    # ---- HTTP -------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        """(status, raw body); never raises for an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        """JSON response of a 200 answer; :class:`HTTPStatusError` for any other status."""
        status, raw = self.request("POST", path, body, timeout)
        if status != 200:
            raise HTTPStatusError(status, raw.decode(errors="replace"), self.url + path)
        return json.loads(raw)

    def get(self, path: str, timeout: float = 30) -> str:
        status, raw = self.request("GET", path, None, timeout)
        if status != 200:
            raise HTTPStatusError(status, raw.decode(errors="replace"), self.url + path)
        return raw.decode()

    def completion_body(self, prompt: str | list[int], **params) -> dict:
        """Defaults: greedy, 32 new tokens, token ids returned; ``params`` override them."""
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": 32,
                "temperature": 0.0, "return_token_ids": True}
        body.update(params)
        return body

    def complete(self, prompt: str | list[int], **params) -> dict:
        """The first choice of ``/v1/completions`` (``token_ids``, ``text``, ``logprobs``,
        ``prompt_logprobs`` ...) with the response's ``usage`` added under ``"usage"``."""
        out = self.post("/v1/completions", self.completion_body(prompt, **params))
        choice = dict(out["choices"][0])
        choice["usage"] = out.get("usage")
        return choice

    def chat(self, messages: list[dict], **params) -> dict:
        """The whole ``/v1/chat/completions`` response (greedy, 32 tokens unless overridden)."""
        body = {"model": self.served_model_name, "messages": messages, "max_tokens": 32,
                "temperature": 0.0, "return_token_ids": True}
        body.update(params)
        return self.post("/v1/chat/completions", body)

    def stream(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> Iterator[dict]:
        """Server-sent events of a streamed request, parsed; stops at ``data: [DONE]``."""
        body = dict(body, stream=True)
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise HTTPStatusError(e.code, e.read().decode(errors="replace"), self.url + path)
        with resp:
            done = False
            for raw in resp:
                line = raw.decode().strip()
                if not line or not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                yield json.loads(data)
            if not done:
                raise ServerError(f"stream from {self.url + path} ended without [DONE]")

    def stream_completion(self, prompt: str | list[int], **params) -> list[dict]:
        return list(self.stream("/v1/completions", self.completion_body(prompt, **params)))

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of ``/metrics`` by name, summed over label sets."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
        return out

    def metric(self, name: str) -> float:
        m = self.metrics()
        if name not in m:
            raise KeyError(f"{name} not in /metrics of {self.url}; has e.g. "
                           f"{sorted(k for k in m if k.startswith('vllm:'))[:40]}")
        return m[name]

    def model_config(self) -> dict:
        return json.loads((Path(self.model) / "config.json").read_text())

    @property
    def vocab_size(self) -> int:
        return int(self.model_config()["vocab_size"])


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve`` configuration. ``checkpoint``: "fp8" / "bf16" (the session's tiny-flash
    checkpoints) or a path; ``args`` / ``env``: extra CLI arguments / environment;
    ``trap_c_ops``: record ``torch.ops._C*`` calls (``server.trap_path``); ``extra``: further
    ``VllmServer`` keyword arguments."""

    name: str
    checkpoint: str = "fp8"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    max_model_len: int = 2048
    trap_c_ops: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        env = self.env.items() if isinstance(self.env, dict) else self.env
        object.__setattr__(self, "env", tuple(sorted((str(k), str(v)) for k, v in env)))


class ServerPool:
    """Named ``VllmServer`` processes of this session (logs under pytest's tmp directory)."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._checkpoints: dict[str, Path] = {}
        self.servers: dict[str, VllmServer] = {}
        self.specs: dict[str, ServerSpec] = {}
        self.plan: list[ServerSpec] = []        # first-use order of the selected tests
        self.startups: list[tuple[str, float, bool]] = []   # name, seconds, overlapped
        self._launched: set[str] = set()

    def checkpoint(self, which: str) -> Path:
        if which not in ("fp8", "bf16"):
            return Path(which)
        if which not in self._checkpoints:
            from vllm_dsv4_hw.tools import checkpoint as ck

            path = self._tmp.mktemp("ckpt") / f"tiny-flash-{which}"
            ck.make_checkpoint(path, "tiny-flash", which, CKPT_SEED, progress=lambda _m: None)
            self._checkpoints[which] = path
        return self._checkpoints[which]

    def launch(self, spec: ServerSpec) -> VllmServer:
        """Start ``spec``'s process if it is not running (no wait)."""
        if spec.name in self.servers:
            if self.specs[spec.name] != spec:
                raise ValueError(f"two server specs named {spec.name!r}")
            return self.servers[spec.name]
        log_dir = self._tmp.mktemp(f"serve-{spec.name}")
        server = VllmServer(self.checkpoint(spec.checkpoint), args=spec.args, env=dict(spec.env),
                            log_path=log_dir / "server.log", max_model_len=spec.max_model_len,
                            name=spec.name, trap_c_ops=spec.trap_c_ops, **spec.extra)
        self.servers[spec.name] = server
        self.specs[spec.name] = spec
        self._launched.add(spec.name)
        server.launch()
        return server

    def get(self, spec: ServerSpec | str, model=None, **kwargs) -> VllmServer:
        """The healthy server of ``spec`` (launched now unless already launched); then launches
        the next planned server in the background. Also ``get(name, checkpoint_path, args=[...],
        env={...}, max_model_len=..., trap_c_ops=..., **VllmServer_kwargs)``."""
        if not isinstance(spec, ServerSpec):
            own = {k: kwargs.pop(k) for k in ("args", "env", "max_model_len", "trap_c_ops")
                   if k in kwargs}
            spec = ServerSpec(spec, checkpoint=str(model), extra=kwargs, **own)
        overlapped = spec.name in self.servers
        server = self.launch(spec)
        if not server.alive and server.startup_s is not None:
            raise ServerError(f"server {spec.name!r} is no longer running\n{server.log_tail()}")
        if server.startup_s is None:
            try:
                server.wait_healthy()
            except BaseException:
                self.stop(spec.name)
                raise
            self.startups.append((spec.name, server.startup_s, overlapped))
        self._launch_next(spec.name)
        return server

    def _launch_next(self, name: str) -> None:
        names = [s.name for s in self.plan]
        if name not in names:
            return
        for nxt in self.plan[names.index(name) + 1:]:
            if nxt.name not in self._launched:
                self.launch(nxt)
                return
            if nxt.name in self.servers and self.servers[nxt.name].startup_s is None:
                return      # already starting

    def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)


def map_concurrently(fn, items: Iterable, workers: int | None = None) -> list:
    """``[fn(x) for x in items]`` with one thread per item (all requests in flight together)."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    with ThreadPoolExecutor(max_workers=workers or max(1, len(items))) as pool:
        return list(pool.map(fn, items))
