"""Reference ``dense_linear``: ``y = x @ weight^T`` with fp32 accumulation and one rounding.

One GEMM with fp32 output where the device's ``torch.mm`` takes ``out_dtype`` (CUDA bf16 / fp16),
else the operands upcast to fp32 (CPU: exact products, fp32 sums); float64 in float64.
:func:`check_dense_linear_args` is the shared argument check of every backend of the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_dsv4_hw.ops.api import DENSE_LINEAR
from vllm_dsv4_hw.ops.registry import register_op

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_MM_OUT_DTYPE: dict[str, bool] = {}   # per device type: does torch.mm take out_dtype=fp32


def check_dense_linear_args(x: torch.Tensor, weight: torch.Tensor,
                            out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.dtype]:
    """Validate (one ValueError naming the tensor, expected and got); returns (x in weight's
    dtype, the output dtype)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dense_linear: {name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"dense_linear: out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"dense_linear: x must be [M, K] and weight [N, K], got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.dtype == torch.float64 or weight.dtype == torch.float64:
        return x.double(), out_dtype
    return x.to(weight.dtype), out_dtype


def linear_acc(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T (same dtype) with fp32 accumulation and fp32 result (float64 for float64)."""
    if x.dtype in (torch.float32, torch.float64):
        return x @ w.to(x.dtype).t()
    dev = x.device.type
    if _MM_OUT_DTYPE.get(dev, True):
        try:
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE[dev] = True
            return y
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[dev] = False  # this device's mm has no fp32 output for these dtypes
    return x.float() @ w.float().t()


@register_op(DENSE_LINEAR, "reference")
def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    x, out_dtype = check_dense_linear_args(x, weight, out_dtype)
    if out_dtype == x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return F.linear(x, weight)  # fp32 accumulation inside, one rounding, one launch
    return linear_acc(x, weight).to(out_dtype)
