# SPDX-License-Identifier: Apache-2.0
"""npu ``rope`` and ``inv_rope_fp8_quant``.

RoPE goes through ``torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")``: output =
x * cos + rotate(x) * sin with rotate((a, b) pairs) = (-b, a), i.e. GPT-J pairs (2j, 2j+1) when
cos / sin hold each angle twice (``repeat_interleave(2)``). The rotated part ``x[..., D-R:]`` is
laid out as vllm-ascend does it: [T, 1, N, R] with cos / sin [T, 1, 1, R] float32 (SBND with r1
S11D, one of the interleave mode's documented layouts); the inverse rotation passes -sin. Math is
fp32 (the part is upcast), one rounding on the way back, as the contract asks.

When this process has vllm-ascend's ``inplace_partial_rotary_mul`` loaded (a vLLM process with
vllm-ascend as the platform), bf16 / fp16 inputs use it instead: the same rotation, in place on the
slice [D-R, D) of a copy of x. float64 inputs (the tests' oracle path; Ascend has no fp64) are
served by the reference.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.numerics import FP8_E4M3_MAX, ceil_log2, pow2
from vllm_dsv4_hw.ops.api import INV_ROPE_FP8_QUANT, O_QUANT_AMAX_FLOOR, O_QUANT_GROUP, ROPE
from vllm_dsv4_hw.ops.checks import check_rope_args
from vllm_dsv4_hw.ops.npu._vendor import call, call_fn, npu_op, vllm_ascend_op
from vllm_dsv4_hw.ops.reference import rope as ref_rope
from vllm_dsv4_hw.ops.registry import register_op

_VENDOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cos_sin_pairs(
    cos_sin: torch.Tensor, positions: torch.Tensor, device: torch.device, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of every token as [T, 1, 1, R] float32, each angle repeated for its pair."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions.to(device=cos_sin.device, dtype=torch.long)].to(
        device=device, dtype=torch.float32
    )
    cos = cs[:, :half].repeat_interleave(2, dim=-1)
    sin = cs[:, half:].repeat_interleave(2, dim=-1)
    if inverse:
        sin = -sin
    return cos[:, None, None, :], sin[:, None, None, :]


@register_op(ROPE, "npu")
@npu_op(ROPE, ref_rope.rope)
def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    check_rope_args(x, positions, cos_sin)
    if x.dtype not in _VENDOR_DTYPES:
        return ref_rope.rope(x, positions, cos_sin, inverse)
    t, d, r = x.shape[0], x.shape[-1], cos_sin.shape[-1]
    if t == 0 or x.numel() == 0:
        return x.clone()
    cos, sin = cos_sin_pairs(cos_sin, positions, x.device, inverse)
    partial = vllm_ascend_op("inplace_partial_rotary_mul") if x.dtype != torch.float32 else None
    if partial is not None:
        out = x.contiguous().clone()
        call_fn(
            "inplace_partial_rotary_mul",
            partial,
            out.reshape(t, 1, -1, d),
            cos,
            sin,
            rotary_mode="interleave",
            partial_slice=[d - r, d],
        )
        return out
    part = x[..., d - r :].reshape(t, 1, -1, r).float().contiguous()  # [T, 1, N, R]
    rotated = call("npu_rotary_mul", part, cos, sin, rotary_mode="interleave")
    out = x.clone()
    out[..., d - r :] = rotated.reshape(x.shape[:-1] + (r,)).to(x.dtype)
    return out


@register_op(INV_ROPE_FP8_QUANT, "npu", requires=("fp8",))
def inv_rope_fp8_quant(
    o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse RoPE through npu_rotary_mul (fp32), then the power-of-two FP8 group quantization.

    Needs fp8 tensors, so the dispatcher skips it on Ascend A2/A3 (capability ``fp8``): no
    torch_npu quantizer there produces e4m3 (npu_quantize / npu_dynamic_quant give int8).
    """
    if o.dim() != 3 or o.shape[-1] % O_QUANT_GROUP:
        return ref_rope.inv_rope_fp8_quant(o, positions, cos_sin, inverse)  # raises the error
    t, h, d = o.shape
    x = rope(o.float(), positions, cos_sin, inverse=inverse)
    xg = x.reshape(t, h, d // O_QUANT_GROUP, O_QUANT_GROUP)
    amax = xg.abs().amax(dim=-1).clamp_min(O_QUANT_AMAX_FLOOR)
    scales = pow2(ceil_log2(amax / FP8_E4M3_MAX))
    q = (xg / scales.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).reshape(t, h, d), scales
