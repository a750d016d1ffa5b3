# SPDX-License-Identifier: Apache-2.0
"""npu ``rms_norm`` and ``qkv_rms_norm`` through ``torch_npu.npu_rms_norm``.

``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`` normalizes over gamma's dims with fp32 statistics
and returns y in x's dtype (float16 / bfloat16 / float32; gamma of x's dtype). The weightless form
passes a ones gamma (exact). float64 inputs (no fp64 on Ascend: only the tests' oracle path) and
a weight of another dtype than x are served by fp32 math: the reference, resp. an fp32 call.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import QKV_RMS_NORM, RMS_NORM
from vllm_dsv4_hw.ops.npu._vendor import call, npu_op
from vllm_dsv4_hw.ops.reference import norm as ref_norm
from vllm_dsv4_hw.ops.registry import register_op

_VENDOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ONES: dict[tuple, torch.Tensor] = {}


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, str(device))
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(n, dtype=dtype, device=device)
    return t


@register_op(RMS_NORM, "npu")
@npu_op(RMS_NORM, ref_norm.rms_norm)
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} != last dim {x.shape[-1]} of x"
        )
    if x.dtype not in _VENDOR_DTYPES:
        return ref_norm.rms_norm(x, weight, eps)
    if x.numel() == 0:
        return torch.empty_like(x)
    xv = x if x.is_contiguous() else x.contiguous()
    if xv.dim() == 1:
        xv = xv.unsqueeze(0)
    if weight is None:
        gamma = _ones(x.shape[-1], x.dtype, x.device)
    elif weight.dtype == x.dtype:
        gamma = weight.to(x.device)
    else:  # mixed dtypes: one fp32 call, one rounding at the end
        xv = xv.float()
        gamma = weight.to(device=x.device, dtype=torch.float32)
    y, _ = call("npu_rms_norm", xv, gamma, epsilon=float(eps))
    return y.reshape(x.shape).to(x.dtype)


@register_op(QKV_RMS_NORM, "npu")
def qkv_rms_norm(
    q_r: torch.Tensor, q_w: torch.Tensor, kv: torch.Tensor, kv_w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two npu_rms_norm launches (each under rms_norm's failure policy)."""
    if q_r.dim() != 2 or kv.dim() != 2 or q_r.shape[0] != kv.shape[0]:
        # same message as the contract's reference
        return ref_norm.qkv_rms_norm(q_r, q_w, kv, kv_w, eps)
    return rms_norm(q_r, q_w, eps), rms_norm(kv, kv_w, eps)
