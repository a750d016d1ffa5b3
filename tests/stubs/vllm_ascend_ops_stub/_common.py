# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the vllm-ascend operator stubs: constraint checks and call counting."""

from __future__ import annotations

from torch_npu import _control


def need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg} (vllm-ascend stub enforces the documented constraint)")


def called(op: str) -> None:
    """Count the call and raise an injected failure (``torch_npu._control.fail``)."""
    _control.maybe_fail(op)
