# SPDX-License-Identifier: Apache-2.0
"""Record every call of a vLLM compiled operator (``torch.ops._C*``) in a served process.

A test aid, not part of the runtime package: a ``vllm serve`` started by the tests gets it through
a test-only distribution, ``installed/c_op_trap/*.dist-info``, whose ``vllm.general_plugins``
entry point is :func:`entry_point` (vLLM runs every such entry point in each of its processes).
:func:`server_env` puts that directory and the repository root on the server's ``PYTHONPATH`` and
names the record file in ``DSV4_TEST_TRAP_C_OPS``; nothing is pip-installed, and a process
without that variable is left untouched.

Each call appends ``phase<TAB>namespace.op<TAB>pid`` to the file; the phase is ``model`` while
our model loads weights or runs (:func:`install` wraps the model class's ``forward``,
``compute_logits`` and ``load_weights`` in :func:`model_phase`; the served code knows nothing of
the trap), ``engine`` otherwise (vLLM's own worker code). The serve tests assert that no
``model`` line exists: a vendor fork of vLLM ships none of these operators.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path

import torch

ENV = "DSV4_TEST_TRAP_C_OPS"  # the record file; unset: the entry point does nothing
HERE = Path(__file__).resolve().parent
INSTALLED = HERE / "installed" / "c_op_trap"
REPO_ROOT = HERE.parents[1]

NAMESPACES = (
    "_C",
    "_C_cache_ops",
    "_C_utils",
    "_C_custom_ar",
    "_C_cpu",
    "_moe_C",
    "_rocm_C",
    "_C_AVX512",
    "_C_AVX2",
)
_state = threading.local()
_path: str | None = None
_lock = threading.Lock()


def _phase() -> str:
    return getattr(_state, "phase", "engine")


@contextlib.contextmanager
def model_phase():
    prev = _phase()
    _state.phase = "model"
    try:
        yield
    finally:
        _state.phase = prev


def _record(name: str) -> None:
    if _path is None:
        return
    with _lock, open(_path, "a") as f:
        f.write(f"{_phase()}\t{name}\t{os.getpid()}\n")


class _TrappedOp:
    def __init__(self, name: str, op) -> None:
        self._name = name
        self._op = op

    def __call__(self, *args, **kwargs):
        _record(self._name)
        return self._op(*args, **kwargs)

    def __getattr__(self, item):  # overloads (.default) and packet attributes
        attr = getattr(self._op, item)
        if isinstance(attr, torch._ops.OpOverload):
            return _TrappedOp(f"{self._name}.{item}", attr)
        return attr


class _TrappedNamespace:
    def __init__(self, name: str, real) -> None:
        self._name = name
        self._real = real

    def __getattr__(self, item):
        return _TrappedOp(f"{self._name}.{item}", getattr(self._real, item))


MODEL_METHODS = ("forward", "compute_logits", "load_weights")


def _in_model_phase(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with model_phase():
            return fn(*args, **kwargs)

    wrapped.__dsv4_trapped__ = True
    return wrapped


def install(path: str) -> None:
    global _path
    _path = path
    for ns in NAMESPACES:
        real = getattr(torch.ops, ns)
        if not isinstance(real, _TrappedNamespace):
            setattr(torch.ops, ns, _TrappedNamespace(ns, real))
    from vllm_dsv4_hw.engine.model import DSV4ForCausalLM

    for name in MODEL_METHODS:
        fn = getattr(DSV4ForCausalLM, name)
        if not getattr(fn, "__dsv4_trapped__", False):
            setattr(DSV4ForCausalLM, name, _in_model_phase(fn))


def entry_point() -> None:
    """The test distribution's ``vllm.general_plugins`` entry point: install the trap in this
    process when ``DSV4_TEST_TRAP_C_OPS`` names a file."""
    path = os.environ.get(ENV, "").strip()
    if path:
        install(path)


def server_env(path: str | os.PathLike, pythonpath: str | None = None) -> dict[str, str]:
    """Environment that arms the trap in a ``vllm serve`` (every process it starts), recording to
    ``path``: the test distribution and the repository root (for ``tests.support``) ahead of
    ``pythonpath`` (the server's own, kept)."""
    parts = [str(INSTALLED), str(REPO_ROOT)] + ([pythonpath] if pythonpath else [])
    return {"PYTHONPATH": os.pathsep.join(parts), ENV: str(path)}
