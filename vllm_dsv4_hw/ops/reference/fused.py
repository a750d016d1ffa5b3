"""Reference fused prologue / epilogue ops: each is the plain composition of the reference ops that
its contract (``ops.api``) names, with fp32 intermediates. Accelerated backends fuse them."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats.fp8_ds_mla import FP8_E4M3_MAX, ceil_log2, pow2
from vllm_dsv4_hw.ops.api import (
    INV_ROPE_FP8_QUANT,
    O_QUANT_AMAX_FLOOR,
    O_QUANT_GROUP,
    QKV_RMS_NORM,
    QNORM_ROPE_KV_INSERT,
)
from vllm_dsv4_hw.ops.checks import check_inv_rope_fp8_quant_args, check_qkv_rms_norm_args, check_qnorm_rope_kv_insert_args
from vllm_dsv4_hw.ops.reference.rms_norm import rms_norm
from vllm_dsv4_hw.ops.reference.rope import rope
from vllm_dsv4_hw.ops.registry import register_op


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_op(QNORM_ROPE_KV_INSERT, "reference")
def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, eps: float, window_cache: torch.Tensor,
                         window_slots: torch.Tensor, fmt) -> torch.Tensor:
    check_qnorm_rope_kv_insert_args(q, kv, fmt)
    md = _math_dtype(q.dtype)
    q_out = rope(rms_norm(q.to(md), None, eps), positions, cos_sin).to(q.dtype)
    k = rope(kv.to(md), positions, cos_sin)
    paged.insert_rows(window_cache, window_slots, k, fmt)
    return q_out


@register_op(INV_ROPE_FP8_QUANT, "reference")
def inv_rope_fp8_quant(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       inverse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    check_inv_rope_fp8_quant_args(o, O_QUANT_GROUP)
    t, h, d = o.shape
    x = rope(o.float(), positions, cos_sin, inverse=inverse)
    xg = x.reshape(t, h, d // O_QUANT_GROUP, O_QUANT_GROUP)
    amax = xg.abs().amax(dim=-1).clamp_min(O_QUANT_AMAX_FLOOR)
    scales = pow2(ceil_log2(amax / FP8_E4M3_MAX))  # exact powers of two, [T, H, D/128] fp32
    q = (xg / scales.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).reshape(t, h, d), scales


@register_op(QKV_RMS_NORM, "reference")
def qkv_rms_norm(q_r: torch.Tensor, q_w: torch.Tensor, kv: torch.Tensor, kv_w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_qkv_rms_norm_args(q_r, kv)
    return rms_norm(q_r, q_w, eps), rms_norm(kv, kv_w, eps)
