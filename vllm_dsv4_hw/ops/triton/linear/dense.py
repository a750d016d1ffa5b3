# SPDX-License-Identifier: Apache-2.0
"""Triton ``dense_linear`` for decode-sized calls: the FP8 GEMM's kernel (``fp8_linear``) on a
16-bit weight read as it lies (``W16``: no decode, no scales), with its split-K and the split sum
inside the launch.

Why: at M = 1 cuBLAS runs these GEMMs as a split-K kernel plus a separate reduction, and the
fp32-output form adds a cast: several times the time of their weight bytes (evidence:
docs/tuning.md, Dense linear for decode).

Up to ``MAX_ROWS`` rows with x and weight in one 16-bit dtype; everything else (prefill, fp32
weights) is the reference's cuBLAS / torch GEMM, which is at its best there.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import DENSE_LINEAR
from vllm_dsv4_hw.ops.reference import linear as ref
from vllm_dsv4_hw.ops.reference.linear import Fp8LinearArgs
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.linear import block as fp8_linear

MAX_ROWS = 16
K_BLOCK = 128  # split-K unit (the kernel's K tile)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel runs this call (else the reference GEMM)."""
    return (
        x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
    )


@register_op(DENSE_LINEAR, "triton")
def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, **knobs
) -> torch.Tensor:
    """The op contract (``ops.api.dense_linear``); ``knobs``: ``fp8_linear.launch``'s."""
    xc, out_dtype = ref.check_dense_linear_args(x, weight, out_dtype)
    if not takes(xc, weight):
        return ref.dense_linear(x, weight, out_dtype)
    m, k = xc.shape
    n = weight.shape[0]
    w3 = weight.unsqueeze(0)
    a = Fp8LinearArgs(False, m, 1, n, k, K_BLOCK, K_BLOCK, xc.unsqueeze(1), w3, w3, out_dtype)
    return fp8_linear.launch(a, w16=True, **knobs)
