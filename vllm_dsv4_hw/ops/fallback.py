# SPDX-License-Identifier: Apache-2.0
"""What happens when a backend's kernel cannot run here, found only at run time.

Some failures are only known when a kernel first runs on the device: Triton compiles a kernel for
the GPU it meets (``type fp8e4nv not supported in this architecture`` on sm_80, shared memory
beyond the device's, a ptxas error), and a torch_npu operator may raise on a given CANN build.
Such a failure says "this backend cannot serve this op here", not "the inputs are wrong", so:

* under automatic selection the op logs **one warning** (backend, op, error) and falls back
  **permanently** (for this process) to its reference implementation, which also serves the failed
  call: the caller gets a correct result and nothing is half-written (kernels fail before they
  launch);
* it raises :class:`KernelFailedError` instead when the backend was requested explicitly
  (``VLLM_DSV4_HW_BACKEND`` / ``VLLM_DSV4_HW_OP_BACKENDS``: an explicit request must run) or
  ``VLLM_DSV4_HW_KERNEL_FAILURES=raise`` (vendor CI, the GPU test tier: a fallback would hide the
  kernel under test).

Which exceptions count is the backend's declaration (:func:`guard`'s ``failures``); anything else
(our input validation, a wrong result, the Triton interpreter's errors) propagates unchanged.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

from vllm_dsv4_hw import envs

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_DISABLED: dict[tuple[str, str], str] = {}  # (backend, op) -> the error that disabled it


class KernelFailedError(RuntimeError):
    """A backend's kernel failed where no fallback is allowed (explicit request or ``raise``)."""


def no_fallback_reason(op: str, backend: str) -> tuple[str, str] | None:
    """(variable, why) when a failure of ``backend`` for ``op`` must raise, else None."""
    if envs.op_backends().get(op) == backend:
        return (
            "VLLM_DSV4_HW_OP_BACKENDS",
            f"VLLM_DSV4_HW_OP_BACKENDS requests the {backend} backend for it",
        )
    if op not in envs.op_backends() and envs.backend() == backend:
        return "VLLM_DSV4_HW_BACKEND", f"VLLM_DSV4_HW_BACKEND requests the {backend} backend for it"
    if envs.KERNEL_FAILURES.get() == "raise":
        return "VLLM_DSV4_HW_KERNEL_FAILURES", "VLLM_DSV4_HW_KERNEL_FAILURES=raise"
    return None


def disabled(backend: str) -> dict[str, str]:
    """Ops of ``backend`` that failed in this process (op -> error), now served by the reference."""
    with _LOCK:
        return {op: err for (b, op), err in _DISABLED.items() if b == backend}


def reset(backend: str | None = None) -> None:
    """Re-enable the failed ops (tests; a long-lived process after a driver fix)."""
    with _LOCK:
        for key in [k for k in _DISABLED if backend in (None, k[0])]:
            del _DISABLED[key]


def _name_and_message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def guard(
    op: str,
    backend: str,
    reference: Callable,
    failures: tuple[type[BaseException], ...],
    what: str,
    error_cls: type[KernelFailedError] = KernelFailedError,
    describe: Callable[[BaseException], str] = _name_and_message,
) -> Callable[[Callable], Callable]:
    """Decorator: the policy of the module docstring around ``backend``'s implementation of
    ``op``; ``failures`` are the exceptions that mean "cannot run here", ``what`` names the thing
    that failed in messages ("Triton kernel", "vendor operator") and ``describe`` the error."""

    def deco(fn: Callable) -> Callable:
        key = (backend, op)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if key in _DISABLED:
                return reference(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except failures as exc:
                err = " ".join(describe(exc).split())
                strict = no_fallback_reason(op, backend)
                if strict is not None:
                    var, why = strict
                    raise error_cls(
                        f"{backend} op {op}: {what} {err}. {why}, so there is no fallback; unset "
                        f"{var} (or choose another backend) to fall back to the reference "
                        f"implementation."
                    ) from exc
                with _LOCK:
                    first = key not in _DISABLED
                    _DISABLED.setdefault(key, err)
                if first:
                    logger.warning(
                        "dsv4-hw: %s op %s: %s %s; op %s now uses the reference "
                        "implementation for the rest of this process",
                        backend,
                        op,
                        what,
                        err,
                        op,
                    )
                return reference(*args, **kwargs)

        wrapper.unguarded = (
            fn  # marks the op as guarded; the raw implementation, without the policy
        )
        return wrapper

    return deco
