# SPDX-License-Identifier: Apache-2.0
"""Calling torch_npu (and vllm-ascend) operators: lazy import, run-time failure policy, logging.

* ``torch_npu`` is imported on the first call of an npu op, never at package import
  (:func:`torch_npu`); without it an npu op raises :class:`NpuUnavailableError` saying why (the
  dispatcher never selects the backend then: ``ops/backends.py`` probes the same way).
* Every vendor operator goes through :func:`call`, which turns any exception it raises into
  :class:`VendorOpError` naming the operator.
* :func:`npu_op` wraps each registered op with the run-time failure policy of
  ``ops/fallback.py``: the first :class:`VendorOpError` of an op logs **one warning** (op,
  operator, error) and the op falls back **permanently** (for this process) to its reference
  implementation, which also serves the failed call; an explicit request of the npu backend (or
  ``VLLM_DSV4_HW_KERNEL_FAILURES=raise``) raises :class:`NpuOpFailedError` instead, with the
  operator's message and how to get the fallback.

  Input validation errors (``ValueError``) are ours, raised before any vendor call, and are never
  turned into a fallback.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Callable

from vllm_dsv4_hw.ops import fallback

logger = logging.getLogger(__name__)


class NpuUnavailableError(RuntimeError):
    """An npu op was called where torch_npu cannot be imported."""


class VendorOpError(RuntimeError):
    """A torch_npu / vllm-ascend operator raised at run time."""

    def __init__(self, operator: str, cause: BaseException) -> None:
        self.operator = operator
        self.cause = cause
        super().__init__(
            f"{operator} failed: {type(cause).__name__}: {' '.join(str(cause).split())}"
        )


class NpuOpFailedError(fallback.KernelFailedError):
    """A vendor operator failed while the npu backend was requested explicitly (no fallback)."""


def torch_npu():
    """The torch_npu module (imported on first use)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:
        from vllm_dsv4_hw.platform.npu import probe_torch_npu

        _, why = probe_torch_npu()
        raise NpuUnavailableError(f"the npu backend needs torch_npu: {why}") from exc


def call(operator: str, *args, **kwargs):
    """``torch_npu.<operator>(*args, **kwargs)``; any failure becomes :class:`VendorOpError`."""
    mod = torch_npu()
    fn = getattr(mod, operator, None)
    if fn is None:
        raise VendorOpError(
            operator,
            AttributeError(
                f"this torch_npu ({getattr(mod, '__version__', '?')}) has no operator {operator}"
            ),
        )
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise VendorOpError(operator, exc) from exc


def call_fn(operator: str, fn: Callable, *args, **kwargs):
    """Call a vendor callable found elsewhere (a vllm-ascend op) under the same error policy."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise VendorOpError(operator, exc) from exc


# -- vllm-ascend ops -------------------------------------------------------------------------------
_ASCEND_LOGGED = False
_LOCK = threading.Lock()


def vllm_ascend_op(name: str):
    """The vllm-ascend op ``name`` when this process has loaded it, else None (logged once)."""
    global _ASCEND_LOGGED
    from vllm_dsv4_hw.platform import npu as npu_platform

    found = npu_platform.vllm_ascend_ops()
    with _LOCK:
        first = not _ASCEND_LOGGED
        _ASCEND_LOGGED = True
    if first:
        if found:
            logger.info(
                "dsv4-hw: npu backend uses vllm-ascend ops: %s",
                ", ".join(f"{n} ({npu_platform.VLLM_ASCEND_OPS[n]})" for n in sorted(found)),
            )
        else:
            logger.info(
                "dsv4-hw: npu backend uses torch_npu operators only (no vllm-ascend ops "
                "loaded in this process)"
            )
    return found.get(name)


# -- run-time failure policy (ops/fallback.py) ------------------------------------------------------
def disabled_ops() -> dict[str, str]:
    """Ops whose vendor path failed in this process (op -> error), now served by the reference."""
    return fallback.disabled("npu")


def reset_fallbacks() -> None:
    """Re-enable every vendor path (tests; a long-lived process after a driver fix)."""
    global _ASCEND_LOGGED
    fallback.reset("npu")
    with _LOCK:
        _ASCEND_LOGGED = False


def npu_op(op: str, reference: Callable) -> Callable[[Callable], Callable]:
    """Decorator: the run-time failure policy of ``ops/fallback.py`` around an npu op; a vendor
    operator's error (:class:`VendorOpError`) is what counts as "cannot run here"."""
    return fallback.guard(
        op,
        "npu",
        reference,
        (VendorOpError,),
        "vendor operator",
        error_cls=NpuOpFailedError,
        describe=str,
    )
