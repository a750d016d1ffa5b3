# SPDX-License-Identifier: Apache-2.0
"""Test controls of the stub: device visibility, call counts, failure injection.

Not part of torch_npu's API: tests reach it as ``torch_npu._control`` (``tests/npu/conftest.py``
wraps it in fixtures).
"""

from __future__ import annotations

import collections
from typing import Callable

# torch.npu.is_available() answer. False by default, so that merely having the stub importable
# (the whole test session) never makes this process look like an Ascend machine.
available = False
device_count = 1
soc_name = "Ascend910B2 (stub)"

# operator name -> number of calls (tests assert that the vendor path really ran)
calls: collections.Counter = collections.Counter()

# operator name -> (exception factory, remaining count or None = forever)
_failures: dict[str, list] = {}


def fail(
    name: str, exc: BaseException | Callable[[], BaseException], times: int | None = None
) -> None:
    """Make operator ``name`` raise ``exc`` on its next ``times`` calls (None: every call)."""
    _failures[name] = [exc, times]


def maybe_fail(name: str) -> None:
    calls[name] += 1
    entry = _failures.get(name)
    if entry is None:
        return
    exc, times = entry
    if times is not None:
        if times <= 0:
            del _failures[name]
            return
        entry[1] = times - 1
    raise exc() if callable(exc) and not isinstance(exc, BaseException) else exc


def reset() -> None:
    global available, device_count, soc_name
    available = False
    device_count = 1
    soc_name = "Ascend910B2 (stub)"
    calls.clear()
    _failures.clear()
