# SPDX-License-Identifier: Apache-2.0
"""Ops: the dispatch registry, the op contracts (``api``) and their backends.

Importing this package registers the reference backend for every op, then whichever accelerated
backends import on this machine (their availability on a device is decided at resolution time).
"""

from vllm_dsv4_hw.ops import npu as _npu  # noqa: F401  (registers; imports torch_npu only when used)
from vllm_dsv4_hw.ops import reference as _reference  # noqa: F401  (registers implementations)
from vllm_dsv4_hw.ops import triton as _triton  # noqa: F401  (registers kernels if triton imports)
from vllm_dsv4_hw.ops.api import *  # noqa: F401,F403
from vllm_dsv4_hw.ops.api import ALL_OPS
from vllm_dsv4_hw.ops.registry import REGISTRY, BackendUnavailableError, get_op, register_op

__all__ = ["ALL_OPS", "REGISTRY", "BackendUnavailableError", "get_op", "register_op"]
