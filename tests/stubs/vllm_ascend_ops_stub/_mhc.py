# SPDX-License-Identifier: Apache-2.0
"""``torch.ops._C_ascend.npu_hc_pre_v2`` and ``npu_hc_post`` (DeepSeek V4 mHC), in PyTorch.

Read from vllm-ascend ``csrc/torch_binding.cpp`` (schemas, shape checks) and its DeepSeek V4 model
(``hc_pre`` / ``hc_post`` call them with the layer's ``hc_{attn,ffn}_{fn,scale,base}``):

* pre: x ``[T, hc, D]`` bf16, hc_fn ``[(2 + hc) hc, hc D]``, hc_scale ``[3]``, hc_base
  ``[(2 + hc) hc]`` fp32 -> (y ``[T, D]`` in x's dtype = sum_j pre_j x_j before any norm, post
  ``[T, hc]``, comb ``[T, hc, hc]`` fp32); mixes = hc_fn z / rms(z) (``norm_eps``), pre =
  sigmoid + ``hc_eps``, post = 2 sigmoid, comb = softmax over the last axis + ``hc_eps`` then
  ``hc_sinkhorn_iters`` column and ``hc_sinkhorn_iters - 1`` row normalisations (column first);
* post: x ``[B, T, D]``, residual ``[B, T, hc, D]`` (same dtype), post ``[B, T, hc]``, comb
  ``[B, T, hc, hc]`` -> ``[B, T, hc, D]`` in the residual's dtype, ``out_j = post_j x + sum_i
  comb[i, j] residual_i`` in fp32.

Enforced: hc_mult 4, D 4096 or 7168 (the operators' tiling), fp32 mix tensors.
"""

from __future__ import annotations

import torch

from vllm_ascend_ops_stub._common import called, need

PRE_SCHEMA = (
    "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
    "int hc_sinkhorn_iters, float norm_eps, float hc_eps) -> (Tensor, Tensor, Tensor)"
)
POST_SCHEMA = "(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor"
_DIMS = (4096, 7168)


def npu_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    op = "npu_hc_pre_v2"
    called(op)
    need(hc_mult == 4, op, f"hc_mult {hc_mult} (only 4)")
    need(
        x.dim() == 3 and x.shape[1] == hc_mult and x.shape[2] in _DIMS,
        op,
        f"x {tuple(x.shape)}: [T, 4, 4096 or 7168]",
    )
    need(x.dtype == torch.bfloat16, op, f"x dtype {x.dtype} (bf16)")
    nmix = (2 + hc_mult) * hc_mult
    need(tuple(hc_fn.shape) == (nmix, hc_mult * x.shape[2]), op, f"hc_fn {tuple(hc_fn.shape)}")
    need(tuple(hc_scale.shape) == (3,) and tuple(hc_base.shape) == (nmix,), op, "scale / base")
    need(all(t.dtype == torch.float32 for t in (hc_fn, hc_scale, hc_base)), op, "fp32 mixes")
    t, c = x.shape[0], hc_mult
    z = x.reshape(t, -1).float()
    mix = (z @ hc_fn.T) * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix[:, :c] * hc_scale[0] + hc_base[:c]) + hc_eps
    post = torch.sigmoid(mix[:, c : 2 * c] * hc_scale[1] + hc_base[c : 2 * c]) * 2
    logits = mix[:, 2 * c :].reshape(t, c, c) * hc_scale[2] + hc_base[2 * c :].reshape(c, c)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    for step in range(2 * hc_sinkhorn_iters - 1):  # column, row, column, ...
        axis = -2 if step % 2 == 0 else -1
        comb = comb / (comb.sum(axis, keepdim=True) + hc_eps)
    y = torch.einsum("tc,tcd->td", pre, x.float()).to(x.dtype)
    return y, post, comb


def npu_hc_post(x, residual, post, comb):
    op = "npu_hc_post"
    called(op)
    need(
        residual.dim() == 4 and residual.shape[2] == 4 and residual.shape[3] in _DIMS,
        op,
        f"residual {tuple(residual.shape)}: [B, T, 4, 4096 or 7168]",
    )
    need(x.dtype == residual.dtype, op, f"x dtype {x.dtype} != residual dtype {residual.dtype}")
    need(tuple(x.shape) == tuple(residual.shape[:2]) + (residual.shape[3],), op, "x shape")
    need(tuple(post.shape) == tuple(residual.shape[:3]), op, f"post {tuple(post.shape)}")
    need(tuple(comb.shape) == tuple(residual.shape[:3]) + (4,), op, f"comb {tuple(comb.shape)}")
    mixed = torch.einsum("btij,btid->btjd", comb.float(), residual.float())
    return (mixed + post.float().unsqueeze(-1) * x.float().unsqueeze(-2)).to(residual.dtype)
