# SPDX-License-Identifier: Apache-2.0
"""``torch.ops._C_ascend.inplace_partial_rotary_mul(x, r1, r2, rotary_mode, partial_slice)``.

Read from vllm-ascend ``csrc/torch_binding.cpp`` (``inplace_partial_rotary_mul_npu``) and its call
sites in ``vllm_ascend/attention/dsa_v1.py``: in place on ``x[..., lo:hi]`` (``partial_slice =
[lo, hi]``), ``x * r1 + rotate(x) * r2`` with rotate as torch_npu's rotary_mul modes; x must be
4-D (BSND, e.g. [T, 1, N, D]); an unknown ``rotary_mode`` makes the binding return without doing
anything, which the stub models too (a misspelt mode shows up as wrong numbers, not an error).
The stub models the 'interleave' and 'half' modes.
"""

from __future__ import annotations

import torch

from vllm_ascend_ops_stub._common import called, need

SCHEMA = "(Tensor(a!) x, Tensor r1, Tensor r2, str rotary_mode, int[] partial_slice) -> ()"
_MODES = ("half", "interleave", "quarter", "interleave-half")


def inplace_partial_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str, partial_slice: list[int]
) -> None:
    op = "inplace_partial_rotary_mul"
    called(op)
    if rotary_mode not in _MODES:
        return  # the binding's behaviour: silently nothing
    need(rotary_mode in ("half", "interleave"), op, "the stub models half / interleave only")
    need(x.dim() == 4, op, f"x must be 4-D, got {x.dim()}-D")
    need(len(partial_slice) == 2, op, "partial_slice must be [lo, hi]")
    lo, hi = int(partial_slice[0]), int(partial_slice[1])
    need(0 <= lo < hi <= x.shape[-1], op, f"partial_slice {partial_slice} outside [0, D]")
    need(
        r1.shape == r2.shape and r1.shape[-1] == hi - lo and r1.dim() == 4,
        op,
        f"r1 / r2 must be 4-D [..., {hi - lo}], got {tuple(r1.shape)} / {tuple(r2.shape)}",
    )
    part = x[..., lo:hi].float()
    if rotary_mode == "interleave":
        rot = torch.stack((-part[..., 1::2], part[..., ::2]), dim=-1).flatten(-2)
    else:
        a, b = part.chunk(2, dim=-1)
        rot = torch.cat((-b, a), dim=-1)
    x[..., lo:hi] = (part * r1.float() + rot * r2.float()).to(x.dtype)
