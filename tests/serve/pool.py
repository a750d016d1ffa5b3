# SPDX-License-Identifier: Apache-2.0
"""The servers of a serve-test session: :class:`ServerSpec` (one ``vllm serve`` configuration) and
:class:`ServerPool` (named servers on the session's tiny-flash checkpoints, the next planned one
launched in the background while a test runs), sharing one vLLM cache directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.serve.client import ServerError
from tests.serve.process import VllmServer

CKPT_SEED = 0


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
        self.plan: list[ServerSpec] = []  # first-use order of the selected tests
        self.startups: list[tuple[str, float, bool]] = []  # name, seconds, overlapped
        self._launched: set[str] = set()
        self._cache_root: Path | None = None

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
        if self._cache_root is None:
            self._cache_root = self._tmp.mktemp("vllm-cache")
        # One VLLM_CACHE_ROOT for the session's servers: vLLM inspects the model class in a
        # subprocess on a cold cache (about 7 s of a 30 s start on 2 cores) and stores the result
        # keyed by the model module's hash; later starts read it, as a machine's second start does.
        # A spec's own VLLM_CACHE_ROOT wins.
        env = {"VLLM_CACHE_ROOT": str(self._cache_root), **dict(spec.env)}
        server = VllmServer(
            self.checkpoint(spec.checkpoint),
            args=spec.args,
            env=env,
            log_path=log_dir / "server.log",
            max_model_len=spec.max_model_len,
            name=spec.name,
            trap_c_ops=spec.trap_c_ops,
            **spec.extra,
        )
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
            own = {
                k: kwargs.pop(k)
                for k in ("args", "env", "max_model_len", "trap_c_ops")
                if k in kwargs
            }
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
        for nxt in self.plan[names.index(name) + 1 :]:
            if nxt.name not in self._launched:
                self.launch(nxt)
                return
            if nxt.name in self.servers and self.servers[nxt.name].startup_s is None:
                return  # already starting

    def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)
