# SPDX-License-Identifier: Apache-2.0
"""The backend dispatch layer: one registry from op name to implementations per backend.

An implementation is registered with ``@register_op("rms_norm", "triton")``. Call sites never pick a
backend: they call ``ops.rms_norm(...)`` (see ``ops/__init__.py``), which resolves once per device
type and caches the choice. Resolution order:

1. a per-op override (``VLLM_DSV4_HW_OP_BACKENDS``) or the global one (``VLLM_DSV4_HW_BACKEND``):
   explicit requests must run, otherwise :class:`BackendUnavailableError` says why and what to do;
2. otherwise the device's preference order (``platform.device.DeviceAdaptor.backend_order``), where
   the first implementation whose backend is available on the device and whose required
   capabilities the device has wins; every skipped preferred backend is reported with one warning.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.ops import backends as _backends

logger = logging.getLogger(__name__)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve an op on this device."""


class UnknownOpError(KeyError):
    pass


@dataclass(frozen=True)
class OpImpl:
    op: str
    backend: str
    fn: Callable
    # Device capabilities this implementation needs (see DeviceCapabilities), e.g. {"fp8"}.
    requires: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Resolution:
    impl: OpImpl
    reason: str


def device_type_of(device: torch.device | str) -> str:
    """'cuda:1' -> 'cuda'. Strings are split by hand: torch.device('npu') needs torch_npu loaded."""
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":", 1)[0]


class OpRegistry:
    def __init__(self) -> None:
        self._impls: dict[str, dict[str, OpImpl]] = {}
        self._cache: dict[tuple[str, str], Resolution] = {}
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str, str]] = set()

    # -- registration -------------------------------------------------------------------------
    def register(self, op: str, backend: str, fn: Callable, requires: tuple[str, ...] = ()) -> None:
        if backend not in envs.BACKEND_NAMES:
            raise ValueError(f"unknown backend {backend!r}; known: {envs.BACKEND_NAMES}")
        with self._lock:
            self._impls.setdefault(op, {})[backend] = OpImpl(op, backend, fn, frozenset(requires))
            self._cache.clear()

    def ops(self) -> list[str]:
        return sorted(self._impls)

    def implementations(self, op: str) -> dict[str, OpImpl]:
        try:
            return dict(self._impls[op])
        except KeyError:
            raise UnknownOpError(
                f"no op named {op!r}; registered ops: {', '.join(self.ops())}"
            ) from None

    def clear_cache(self) -> None:
        """Forget resolved choices (after changing VLLM_DSV4_HW_* variables, e.g. in tests)."""
        with self._lock:
            self._cache.clear()
            self._warned.clear()
        _backends.clear_cache()

    # -- resolution ---------------------------------------------------------------------------
    def _why_not(self, impl: OpImpl, device_type: str, present: bool = False) -> str | None:
        ok, reason = _backends.backend_available(impl.backend, device_type)
        if not ok and not present:
            return reason
        caps = _backends.device_capabilities(device_type)
        missing = sorted(r for r in impl.requires if not caps.has(r))
        if missing:
            return f"device {device_type!r} lacks {', '.join(missing)}"
        return None

    def resolve(self, op: str, device: torch.device | str) -> Resolution:
        device_type = device_type_of(device)
        key = (op, device_type)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        res = self._resolve_uncached(op, device_type)
        with self._lock:
            self._cache[key] = res
        return res

    def _resolve_uncached(
        self, op: str, device_type: str, warn: bool = True, present: bool = False
    ) -> Resolution:
        impls = self.implementations(op)
        per_op = envs.op_backends()
        unknown = sorted(set(per_op) - set(self._impls))
        if unknown:
            raise UnknownOpError(
                f"VLLM_DSV4_HW_OP_BACKENDS names unknown op(s) {unknown}; "
                f"registered ops: {', '.join(self.ops())}"
            )
        requested, source = per_op.get(op), "VLLM_DSV4_HW_OP_BACKENDS"
        if requested is None and envs.backend() != "auto":
            requested, source = envs.backend(), "VLLM_DSV4_HW_BACKEND"
        if requested is not None:
            impl = impls.get(requested)
            if impl is None:
                raise BackendUnavailableError(
                    f"{source} asks for backend {requested!r} for op {op!r}, which has no "
                    f"{requested!r} implementation (it has: {', '.join(sorted(impls))}). "
                    f"Unset {source} or choose one of those."
                )
            why = self._why_not(impl, device_type, present)
            if why is not None:
                raise BackendUnavailableError(
                    f"{source} asks for backend {requested!r} for op {op!r} on device "
                    f"{device_type!r}, but it cannot run: {why}. Unset {source} to let the "
                    f"dispatcher pick an available backend."
                )
            return Resolution(impl, f"requested by {source}")

        skipped: list[str] = []
        for backend in _backends.backend_order(device_type):
            impl = impls.get(backend)
            if impl is None:
                continue  # not implemented for this op: expected, no warning
            why = self._why_not(impl, device_type, present)
            if why is None:
                reason = "best available on this device"
                if skipped:
                    reason = f"fallback ({'; '.join(skipped)})"
                    if warn:
                        self._warn_once(op, device_type, backend, skipped)
                return Resolution(impl, reason)
            skipped.append(f"{backend}: {why}")
        raise BackendUnavailableError(
            f"no implementation of op {op!r} can run on device {device_type!r} "
            f"({'; '.join(skipped) or 'none registered'})"
        )

    def _warn_once(self, op: str, device_type: str, chosen: str, skipped: list[str]) -> None:
        key = (op, device_type, chosen)
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "dsv4-hw: op %s on %s falls back to the %s backend (%s)",
            op,
            device_type,
            chosen,
            "; ".join(skipped),
        )

    def explain(
        self, device: torch.device | str, present: bool = False
    ) -> list[tuple[str, str, str]]:
        """(op, backend, reason) for every registered op on ``device``; errors become reasons.
        A report, not a dispatch: fallbacks are said in the reasons, not also as warnings.
        ``present``: as if the device were here (a report for a target this machine lacks: only
        its declared capabilities decide)."""
        rows = []
        for op in self.ops():
            try:
                res = self._resolve_uncached(
                    op, device_type_of(device), warn=False, present=present
                )
                rows.append((op, res.impl.backend, res.reason))
            except (BackendUnavailableError, UnknownOpError) as exc:
                rows.append((op, "-", f"error: {exc}"))
        return rows


REGISTRY = OpRegistry()


def register_op(
    op: str, backend: str, requires: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_op("rms_norm", "reference")``."""

    def deco(fn: Callable) -> Callable:
        REGISTRY.register(op, backend, fn, requires)
        return fn

    return deco


def get_op(op: str, device: torch.device | str) -> Callable:
    return REGISTRY.resolve(op, device).impl.fn
