# SPDX-License-Identifier: Apache-2.0
"""npu ``hc_pre``, ``hc_seam`` and ``hc_post`` through vllm-ascend's mHC operators where loaded.

* ``npu_hc_pre_v2(x [T, hc, D], hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps,
  hc_eps) -> (y [T, D], post [T, hc], comb [T, hc, hc])``: the mixes and the pre-mix y (x's
  dtype), before the sub-block's RMSNorm, which the npu ``rms_norm`` (``npu_rms_norm``) applies;
* ``npu_hc_post(x [B, T, D], residual [B, T, hc, D], post [B, T, hc], comb [B, T, hc, hc])``: the
  new streams ``post_k x + sum_j comb[j, k] residual_j`` in the residual's dtype; our y is rounded
  to the streams' dtype first (the contract's rounding) and gets the batch axis of 1;
* ``hc_seam`` is the two in sequence, as in the reference.

The operators take hc 4 and D 4096 or 7168 (V4-Flash, V4-Pro) with bf16 streams and fp32 mix
parameters (docs/npu-ops.md); other calls, and every call where vllm-ascend is not loaded, run the
reference composition (no torch_npu operator computes the mixes).
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import HC_POST, HC_PRE, HC_SEAM
from vllm_dsv4_hw.ops.checks import check_hc_args, check_hc_post_args
from vllm_dsv4_hw.ops.npu._vendor import call_fn, npu_op, vllm_ascend_op
from vllm_dsv4_hw.ops.npu.norm import rms_norm
from vllm_dsv4_hw.ops.reference import mhc as ref
from vllm_dsv4_hw.ops.registry import register_op

PRE, POST = "npu_hc_pre_v2", "npu_hc_post"
HC_MULT = 4
DIMS = (4096, 7168)


def fits(h: torch.Tensor, *mix: torch.Tensor) -> bool:
    """Streams and mix tensors the operators take."""
    return (
        h.dtype == torch.bfloat16
        and h.shape[1] == HC_MULT
        and h.shape[2] in DIMS
        and all(t.dtype == torch.float32 for t in mix)
    )


@register_op(HC_PRE, "npu")
@npu_op(HC_PRE, ref.hc_pre)
def hc_pre(h, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps):
    check_hc_args(h, fn, scale, base, norm_w)
    op = vllm_ascend_op(PRE)
    if op is None or not fits(h, fn, scale, base):
        return ref.hc_pre(h, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)
    y, post, comb = call_fn(
        PRE, op, h.contiguous(), fn, scale, base, HC_MULT, int(sinkhorn_iters), eps, hc_eps
    )
    return rms_norm(y, norm_w, eps), post, comb


@register_op(HC_POST, "npu")
@npu_op(HC_POST, ref.hc_post)
def hc_post(y, h, post, comb):
    check_hc_post_args(y, h, post, comb)
    op = vllm_ascend_op(POST)
    if op is None or not fits(h, post, comb):
        return ref.hc_post(y, h, post, comb)
    out = call_fn(
        POST,
        op,
        y.to(h.dtype).contiguous().unsqueeze(0),
        h.contiguous().unsqueeze(0),
        post.contiguous().unsqueeze(0),
        comb.contiguous().unsqueeze(0),
    )
    return out.squeeze(0)


@register_op(HC_SEAM, "npu")
def hc_seam(y, h, post, comb, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps):
    h2 = hc_post(y, h, post, comb)
    x, post2, comb2 = hc_pre(h2, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)
    return h2, x, post2, comb2
