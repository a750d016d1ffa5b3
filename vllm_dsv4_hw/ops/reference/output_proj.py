"""Reference grouped low-rank output projection (``wo_a`` per group, then ``wo_b``)."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.api import GROUPED_O_PROJ
from vllm_dsv4_hw.ops.registry import register_op


@register_op(GROUPED_O_PROJ, "reference")
def grouped_o_proj(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor:
    """o [T, H, D]; wo_a [G, r, (H/G)*D]; wo_b [hidden, G*r] -> [T, hidden] in o's dtype.

    Group g takes heads g*H/G .. (g+1)*H/G - 1 (contiguous), flattened head-major.
    Math in fp32 (float64 for float64 inputs); the intermediate y is not rounded.
    """
    if o.dim() != 3:
        raise ValueError(f"grouped_o_proj: o must be [T, H, D], got {tuple(o.shape)}")
    t, h, d = o.shape
    g, r, k = wo_a.shape
    if h % g or k != (h // g) * d:
        raise ValueError(f"grouped_o_proj: wo_a {tuple(wo_a.shape)} does not fit o {tuple(o.shape)} "
                         f"(need [G, r, (H/G)*D] with G dividing H)")
    if wo_b.dim() != 2 or wo_b.shape[1] != g * r:
        raise ValueError(f"grouped_o_proj: wo_b {tuple(wo_b.shape)} must be [hidden, {g * r}]")
    md = torch.float64 if o.dtype == torch.float64 else torch.float32
    og = o.to(md).reshape(t, g, k)
    y = torch.einsum("tgk,grk->tgr", og, wo_a.to(md))
    out = y.reshape(t, g * r) @ wo_b.to(md).t()
    return out.to(o.dtype)
