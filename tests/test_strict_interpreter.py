# SPDX-License-Identifier: Apache-2.0
"""The interpreter rejects a launch keyword that a GPU launch rejects (tests/strict_interpreter)."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs only without a GPU"
)


@triton.jit
def _copy_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def test_unknown_constexpr_is_rejected():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros_like(x)
    with pytest.raises(TypeError, match="HIST_RELAXED"):
        _copy_kernel[(1,)](x, y, N=8, HIST_RELAXED=True)
    assert not y.any()  # nothing ran


def test_parameters_and_launch_options_pass():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros_like(x)
    _copy_kernel[(1,)](x, y, N=8, num_warps=1, num_stages=2, maxnreg=64)
    assert torch.equal(x, y)
