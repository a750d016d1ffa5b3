# SPDX-License-Identifier: Apache-2.0
"""Which implementations of an op the CPU suite runs: every registered backend that can execute
here (the reference always; Triton kernels under TRITON_INTERPRET=1; the npu backend with the stub).

Conformance tests are parametrized with ``@pytest.mark.parametrize("backend", cpu_backends(OP))``
and call ``impl(OP, backend)``, so a new backend is tested by the same assertions as the reference.
"""

from __future__ import annotations

import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
from vllm_dsv4_hw.ops.registry import REGISTRY

CPU_RUNNABLE = ("reference", "triton", "npu")


def cpu_backends(op: str) -> list[str]:
    impls = REGISTRY.implementations(op)
    return [b for b in CPU_RUNNABLE if b in impls]


def impl(op: str, backend: str):
    return REGISTRY.implementations(op)[backend].fn
