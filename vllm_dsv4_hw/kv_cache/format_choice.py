# SPDX-License-Identifier: Apache-2.0
"""Which cache entry formats a device can hold, and the main / indexer formats a run uses.

``VLLM_DSV4_HW_KV_FORMAT`` (main KV: ``auto``, ``fp8``, ``bf16``) and
``VLLM_DSV4_HW_INDEXER_FORMAT`` (indexer keys: ``auto``, ``mxfp4``, ``fp8``, ``bf16``) pick the
formats; ``auto`` takes the most compact one the device's capabilities
(``platform/capabilities.py``) allow:

========== ================ =================== ==========================================
device     main (auto)      indexer (auto)      why
========== ================ =================== ==========================================
cuda       fp8 (584 B)      mxfp4 (68 B)        fp8 and MXFP4 decode in the kernels (integer
                                                e4m3 paths below sm_89)
cpu        fp8              mxfp4               the reference codecs run anywhere
npu A2/A3  bf16 (1024 B)    bf16 (256 B)        no fp8 / MXFP4 storage on Ascend A2/A3
========== ================ =================== ==========================================

The choice is logged once per process (one INFO line saying which and why). An explicit request
for a format the device cannot hold raises :class:`FormatUnsupportedError`, naming the device,
the format and the fix.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.platform.capabilities import DeviceCapabilities

logger = logging.getLogger(__name__)

# Most compact first: auto takes the first one the device holds.
MAIN_PREFERENCE = ("fp8", "bf16")
INDEXER_PREFERENCE = ("mxfp4", "fp8", "bf16")
# The capability each format needs.
NEEDS = {"fp8": "fp8", "mxfp4": "mxfp4", "bf16": "bf16"}
_WHAT = {
    "fp8": "fp8 (e4m3) storage",
    "mxfp4": "MXFP4 (e2m1 + ue8m0) storage",
    "bf16": "bf16 storage",
}
_KIND_NAME = {"main": "main KV", "indexer": "indexer key"}


class FormatUnsupportedError(ValueError):
    """An explicitly requested cache format that the device cannot hold."""


@dataclass(frozen=True)
class FormatChoice:
    device_type: str
    device_name: str
    main: str
    indexer: str
    main_source: str  # "auto" or where the explicit request came from
    indexer_source: str
    reason: str

    def log_line(self) -> str:
        return (
            f"dsv4-hw: KV cache formats on {self.device_type} ({self.device_name}): "
            f"main {self.main}, indexer {self.indexer} ({self.reason})"
        )


def supported_formats(kind: str, caps: DeviceCapabilities) -> tuple[str, ...]:
    """Formats of cache ``kind`` ("main" / "indexer") the device holds, most compact first."""
    pref = {"main": MAIN_PREFERENCE, "indexer": INDEXER_PREFERENCE}.get(kind)
    if pref is None:
        raise ValueError(f"unknown cache kind {kind!r}; use 'main' or 'indexer'")
    return tuple(f for f in pref if caps.has(NEEDS[f]))


def _adaptor(device_type: str):
    from vllm_dsv4_hw.platform.device import adaptor_for

    return adaptor_for(device_type)


def _pick(
    kind: str, requested: str, source: str, caps: DeviceCapabilities, device: str, device_name: str
) -> tuple[str, str]:
    """(format, why) for one cache kind."""
    held = supported_formats(kind, caps)
    pref = MAIN_PREFERENCE if kind == "main" else INDEXER_PREFERENCE
    if requested == "auto":
        if not held:
            raise FormatUnsupportedError(
                f"device {device!r} ({device_name}) holds no "
                f"{_KIND_NAME[kind]} format (needs one of {pref})"
            )
        best = held[0]
        skipped = [f for f in pref[: pref.index(best)]]
        if skipped:
            lacks = ", ".join(_WHAT[NEEDS[f]] for f in skipped)
            why = f"{kind} {best}: the device lacks {lacks}"
        else:
            why = f"{kind} {best}: the most compact the device holds"
        return best, why
    if requested not in pref:
        raise FormatUnsupportedError(
            f"{source}={requested!r} is not a {_KIND_NAME[kind]} format; "
            f"use one of: auto, {', '.join(pref)}"
        )
    if requested not in held:
        fix = held[0] if held else None
        raise FormatUnsupportedError(
            f"{source}={requested}: device {device!r} ({device_name}) cannot hold "
            f"{requested} {_KIND_NAME[kind]} entries: it lacks {_WHAT[NEEDS[requested]]}. "
            + (
                f"Use {source}={fix} (or auto, which picks {fix} on this device)."
                if fix
                else "No format fits this device."
            )
        )
    return requested, f"{kind} {requested}: requested by {source}"


_LOGGED: set[tuple] = set()
_LOCK = threading.Lock()


def choose_formats(
    device_type: str,
    kv_format: str | None = None,
    indexer_format: str | None = None,
    *,
    caps: DeviceCapabilities | None = None,
    main_source: str = "VLLM_DSV4_HW_KV_FORMAT",
    indexer_source: str = "VLLM_DSV4_HW_INDEXER_FORMAT",
    log: bool = True,
) -> FormatChoice:
    """The main and indexer formats for ``device_type`` ("cpu", "cuda", "npu").

    ``kv_format`` / ``indexer_format`` default to the ``VLLM_DSV4_HW_*`` variables (``auto`` when
    unset); ``*_source`` names where an explicit value came from (for the error message, e.g. a CLI
    flag). Logs one INFO line per distinct choice and process; raises
    :class:`FormatUnsupportedError` for an explicit format the device cannot hold.
    """
    adaptor = _adaptor(device_type)
    caps = caps if caps is not None else adaptor.capabilities
    main_req = (envs.kv_format() if kv_format is None else kv_format).lower()
    idx_req = (envs.indexer_format() if indexer_format is None else indexer_format).lower()
    main, main_why = _pick("main", main_req, main_source, caps, device_type, adaptor.name)
    idx, idx_why = _pick("indexer", idx_req, indexer_source, caps, device_type, adaptor.name)
    choice = FormatChoice(
        device_type,
        adaptor.name,
        main,
        idx,
        "auto" if main_req == "auto" else main_source,
        "auto" if idx_req == "auto" else indexer_source,
        f"{main_why}; {idx_why}",
    )
    if log:
        key = (device_type, main, idx, choice.reason)
        with _LOCK:
            first = key not in _LOGGED
            _LOGGED.add(key)
        if first:
            logger.info("%s", choice.log_line())
    return choice
