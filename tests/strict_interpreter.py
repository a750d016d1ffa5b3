# SPDX-License-Identifier: Apache-2.0
"""The Triton interpreter, as strict about launch keywords as a GPU launch.

A GPU launch rejects a keyword that is neither a parameter of the kernel nor a compile / launch
option ("Keyword argument X was specified but unrecognised"); the interpreter drops it silently
(``GridExecutor.__call__`` filters keywords by the kernel's signature). A constexpr passed to a
kernel that does not take it therefore passed the CPU suite and failed on the H200 (2026-12-04,
the radix top-k's ``HIST_RELAXED``). ``install()`` makes the interpreter raise as the GPU does.
"""

from __future__ import annotations

import dataclasses
import inspect

# compile and launch options a GPU launch takes besides the kernel's parameters
_BACKEND_OPTIONS = (
    ("triton.backends.nvidia.compiler", "CUDAOptions"),
    ("triton.backends.amd.compiler", "HIPOptions"),
)


def launch_options() -> frozenset[str]:
    import importlib

    names: set[str] = set()
    for module, cls in _BACKEND_OPTIONS:
        try:
            names |= {
                f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))
            }
        except (ImportError, AttributeError):
            continue
    return frozenset(names)


def unknown_keywords(fn, kwargs, options: frozenset[str]) -> list[str]:
    """Keywords of a launch of ``fn`` that a GPU launch would reject."""
    spec = inspect.getfullargspec(fn)
    params = set(spec.args) | set(spec.kwonlyargs)
    return sorted(k for k in kwargs if k not in params and k not in options)


def install():
    """Patch the interpreter's launcher; returns a function that undoes it (None: no interpreter
    in this Triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    executor = getattr(interpreter, "GridExecutor", None)
    if executor is None:
        return None
    real = executor.__call__
    options = launch_options()

    def strict_call(self, *args, **kwargs):
        bad = unknown_keywords(self.fn, kwargs, options)
        if bad:
            raise TypeError(
                f"{self.fn.__name__}: keyword argument(s) {', '.join(bad)} are not "
                f"parameters of the kernel (a GPU launch rejects them; the "
                f"interpreter would drop them)"
            )
        return real(self, *args, **kwargs)

    executor.__call__ = strict_call

    def undo():
        executor.__call__ = real

    return undo
