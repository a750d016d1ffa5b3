# SPDX-License-Identifier: Apache-2.0
"""What the Triton launch plans take from the device's declared capabilities
(``platform/capabilities.py``), so no kernel caller tests the device type itself:

* :func:`program_cap`: how many programs one launch may have. ``max_grid`` always (triton-ascend
  refuses grids above 65535); where the grid is bound to the physical cores (``grid_cores``:
  Ascend, whose guide launches one program per core and loops inside), also the core count: AI
  (cube) cores for kernels with ``tl.dot``, vector cores for the others. The kernels given such a
  cap have grid-stride loops.
* :func:`grid_limit`: the hard bound alone, for kernels with one program per tile (the launcher
  runs programs beyond the core count in turns); their callers split larger calls into several
  launches (MoE by tokens, the FP8 linear by rows), which only devices with a small bound take.
* :func:`dot_dim`: a tl.dot dimension padded up to the device's smallest one (``dot_min``).
* :func:`cdiv` / :func:`next_pow2`: host integer helpers. ``triton.cdiv`` and
  ``triton.next_power_of_2`` are constexpr functions in recent Triton (3.9 here): 2-3 us a host
  call, against 0.04-0.06 us for plain Python, and an op makes several per call (eager steps,
  the peer table, prefill are host-bound at decode sizes).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_dsv4_hw.platform.capabilities import DeviceCapabilities
from vllm_dsv4_hw.platform.device import adaptor_for

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (``triton.cdiv``'s value, without its call cost)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, 0 for n <= 0 (``triton.next_power_of_2``'s values)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def capabilities(device: torch.device) -> DeviceCapabilities:
    """The device's declared capabilities (its adaptor's, cached per device type; a function-
    level import here cost ~2 us a call, and every launch plan asks)."""
    return adaptor_for(device.type).capabilities


@functools.lru_cache(maxsize=None)
def physical_cores(device: torch.device, cube: bool) -> int | None:  # pragma: no cover - Ascend
    """AI (cube) or vector core count of an Ascend device, from triton-ascend's driver (the count
    its launcher binds programs to); None when it cannot tell (the grid then stays <= max_grid)."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["num_aicore" if cube else "num_vectorcore"])
    except Exception as exc:
        logger.warning(
            "dsv4-hw: cannot read the %s core count of %s (%s); grids are capped at the "
            "declared maximum only",
            "cube" if cube else "vector",
            device,
            exc,
        )
        return None


def program_cap(device: torch.device, cube: bool = False) -> int:
    """Programs one launch of a grid-strided kernel may have on ``device`` (``cube``: it uses
    tl.dot, so it runs on the AI cores)."""
    caps = capabilities(device)
    cap = caps.max_grid
    if caps.grid_cores:
        cores = physical_cores(device, cube)
        if cores:
            cap = min(cap, cores)
    return max(1, cap)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA / ROCm device (cached per device index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def grid_limit(device: torch.device) -> int:
    """Programs one launch of a kernel without a grid-stride loop may have (``max_grid``)."""
    return max(1, capabilities(device).max_grid)


def dot_dim(n: int, device: torch.device) -> int:
    """``n`` (a power of two) padded up to the device's smallest tl.dot dimension."""
    return max(n, capabilities(device).dot_min)
