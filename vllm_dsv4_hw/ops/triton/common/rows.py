# SPDX-License-Identifier: Apache-2.0
"""Small shared pieces of the row-wise Triton kernels (norms, RoPE, inserts, fused prologue/epilogue).

Conventions (portable to triton-ascend and to the CPU interpreter):

* math in fp32 (fp64 only when the inputs are fp64: the tests' exact-oracle path); bf16 values are
  loaded, then converted with ``.to(tl.float32)`` before any arithmetic;
* results stored to a bf16 tensor are first rounded to the nearest-even bf16 value in fp32
  (:func:`to_out`), so the final fp32 -> bf16 store conversion is exact everywhere (the interpreter's
  own conversion truncates);
* rows of a head are held as *pairs* ``xe`` / ``xo`` (dims 2j, 2j+1), the GPT-J RoPE layout, so a
  rotation needs no shuffles (no ``tl.split`` / ``tl.interleave``, no partner loads);
* 1-D grids with a grid-stride loop over rows: ``grid_1d`` caps the program count by the device's
  declared grid bound (``launch.program_cap``: on Ascend one program per vector core).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops import tuning
from vllm_dsv4_hw.ops.triton.common.launch import program_cap, sm_count
from vllm_dsv4_hw.ops.triton.common.quant import round_to_bf16

MAX_PROGRAMS = 2**31 - 1  # on top of the device's cap (tests lower it to exercise the loops)


def grid_1d(n_rows: int, device: torch.device) -> tuple[int]:
    cap = min(MAX_PROGRAMS, program_cap(device))
    per_sm = tuning.current().rows.cuda_programs_per_sm  # a tuning choice, not a limit
    if device.type == "cuda" and per_sm is not None:
        cap = min(cap, sm_count(device) * per_sm)
    return (max(1, min(n_rows, cap)),)


def is_f64(*tensors: torch.Tensor) -> bool:
    return any(t.dtype == torch.float64 for t in tensors)


def out_is_bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def row_view(x: torch.Tensor, last: int) -> torch.Tensor:
    """``x`` as rows ``[M, last]`` with unit inner stride (a copy only when needed)."""
    x2 = x.reshape(-1, last)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


@triton.jit
def to_math(x, F64: tl.constexpr):
    if F64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def to_out(y, OUT_BF16: tl.constexpr):
    """Round fp32 ``y`` to the bf16 grid when the destination is bf16 (exact store afterwards)."""
    if OUT_BF16:
        return round_to_bf16(y.to(tl.float32))
    else:
        return y


@triton.jit
def rope_pairs(
    xe,
    xo,
    cs_ptr,
    pidx,
    FIRST_PAIR: tl.constexpr,
    HALF: tl.constexpr,
    INVERSE: tl.constexpr,
    F64: tl.constexpr,
):
    """GPT-J rotation of pairs ``(xe, xo)`` whose pair index ``pidx`` >= FIRST_PAIR (the rest pass
    through). ``cs_ptr`` points at the table row of the position: HALF cos values, then HALF sin.
    Pair j = pidx - FIRST_PAIR rotates by angle j; ``INVERSE`` rotates by the negated angle."""
    j = pidx - FIRST_PAIR
    is_rope = j >= 0
    jj = tl.where(is_rope, j, 0)
    c = to_math(tl.load(cs_ptr + jj, mask=is_rope, other=1.0), F64)
    s = to_math(tl.load(cs_ptr + HALF + jj, mask=is_rope, other=0.0), F64)
    if INVERSE:
        s = -s
    ye = xe * c - xo * s
    yo = xo * c + xe * s
    return tl.where(is_rope, ye, xe), tl.where(is_rope, yo, xo)
