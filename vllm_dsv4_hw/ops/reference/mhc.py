# SPDX-License-Identifier: Apache-2.0
"""Reference mHC: the hyper-connections of DeepSeek V4 (``hc_pre``, ``hc_post``, ``hc_seam``).

The residual of every decoder layer is ``hc_mult`` (4) parallel streams ``h [T, hc, D]``. Around
each sub-block (attention, then MoE) of a layer:

* ``hc_pre`` derives three mixes per token from the flattened streams
  ``z = h.flatten(-2)`` (fp32) through one projection ``fn [(2 + hc) * hc, hc * D]`` applied to the
  weightless RMS-normalised ``z`` (eps = ``rms_norm_eps``), split into ``pre`` (hc), ``post`` (hc)
  and ``comb`` (hc x hc) logits, each scaled by its own ``scale`` entry and shifted by ``base``:

  - ``pre  = sigmoid(pre_logits) + hc_eps``; the sub-block input is ``sum_j pre_j * h_j``
    (fp32 sum, rounded once to the stream dtype);
  - ``post = 2 * sigmoid(post_logits)``;
  - ``comb = softmax(comb_logits, over the last axis) + hc_eps``, then Sinkhorn: one column
    normalisation, then ``hc_sinkhorn_iters - 1`` rounds of (row, column) normalisation, each
    dividing by ``sum + hc_eps``.

* ``hc_post`` rebuilds the streams from the sub-block output ``y [T, D]``:
  ``h'_k = post_k * y + sum_j comb[j, k] * h_j`` (``comb`` is applied transposed), in fp32,
  rounded once to the stream dtype.

* ``hc_pre`` also applies the next sub-block's RMSNorm to ``x`` (rounded first); ``hc_seam`` is
  ``hc_post`` then ``hc_pre``, the composition every seam inside the network runs.

The normalisation is folded into the projection (``fn z * rsqrt(mean(z^2) + eps)``), which is the
same value as projecting the normalised ``z``. All mix arithmetic is fp32 (fp64 when the streams
are fp64, for oracle tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_dsv4_hw.ops.api import HC_POST, HC_PRE, HC_SEAM
from vllm_dsv4_hw.ops.checks import check_hc_args, check_hc_post_args
from vllm_dsv4_hw.ops.reference.norm import rms_norm
from vllm_dsv4_hw.ops.registry import register_op


def hc_math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the mixes are computed in for streams of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def hc_mix_logits(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``fn @ RMSNorm(h.flatten(-2))`` for streams ``h [T, hc, D]`` -> ``[T, fn.shape[0]]`` (fp32)."""
    md = hc_math_dtype(h.dtype)
    z = h.flatten(-2).to(md)
    if fn.shape[-1] != z.shape[-1]:
        raise ValueError(
            f"hc fn is {tuple(fn.shape)}; the flattened streams have {z.shape[-1]} features"
        )
    inv_rms = torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + norm_eps)
    return F.linear(z, fn.to(md)) * inv_rms


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over the last axis of ``logits [..., hc, hc]`` (+eps), then Sinkhorn normalisation
    towards a doubly-stochastic matrix (column first; ``iters`` column and ``iters - 1`` row steps).
    """
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def mixes(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, D] in h's dtype, post [T, hc], comb [T, hc, hc])`` of the sub-block after ``h``;
    ``x`` is the sub-block input before its RMSNorm."""
    hc = h.shape[1]
    md = hc_math_dtype(h.dtype)
    mix = hc_mix_logits(h, fn, norm_eps)
    s = scale.to(md)
    b = base.to(md)
    pre = torch.sigmoid(mix[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    comb_logits = mix[:, 2 * hc :].unflatten(-1, (hc, hc)) * s[2] + b[2 * hc :].view(hc, hc)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    x = (pre.unsqueeze(-1) * h.to(md)).sum(dim=1).to(h.dtype)
    return x, post, comb


@register_op(HC_PRE, "reference")
def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_w: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_hc_args(h, fn, scale, base, norm_w)
    x, post, comb = mixes(h, fn, scale, base, sinkhorn_iters, hc_eps, eps)
    return rms_norm(x, norm_w, eps), post, comb


@register_op(HC_POST, "reference")
def hc_post(
    y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    check_hc_post_args(y, h, post, comb)
    md = post.dtype
    mixed = torch.matmul(comb.transpose(-1, -2), h.to(md))
    y = y.to(h.dtype).to(md)  # a sub-block output in a wider dtype is rounded as the streams are
    return (post.unsqueeze(-1) * y.unsqueeze(-2) + mixed).to(h.dtype)


@register_op(HC_SEAM, "reference")
def hc_seam(
    y: torch.Tensor,
    h: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_w: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h2 = hc_post(y, h, post, comb)
    x, post2, comb2 = hc_pre(h2, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)
    return h2, x, post2, comb2
