# SPDX-License-Identifier: Apache-2.0
"""``swiglu`` (the shared expert's clamped SwiGLU on a merged gate | up projection) on every CPU
backend against a float64 oracle per element: clamp active and not, strided rows, no tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.ops.api import SWIGLU

# relative to each value, plus a floor relative to the largest (one rounding to the dtype)
TOL = {torch.float64: 1e-14, torch.float32: 2e-6, torch.bfloat16: 2**-8}


def _oracle(h, limit):
    t, two_i = h.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float64)
    for r in range(t):
        for c in range(two_i // 2):
            g, u = float(h[r, c]), float(h[r, c + two_i // 2])
            if limit is not None and limit > 0:
                g, u = min(g, limit), max(-limit, min(u, limit))
            out[r, c] = g / (1 + math.exp(-g)) * u
    return out


@pytest.mark.parametrize("backend", cpu_backends(SWIGLU))
@pytest.mark.parametrize("t,inter", [(0, 8), (1, 64), (5, 96), (3, 1500)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [10.0, None])
def test_swiglu_matches_oracle(backend, t, inter, dtype, limit, gen):
    wide = torch.randn(t, 2 * inter + 6, generator=gen, dtype=torch.float64) * 6
    h = wide.to(dtype)[:, 3 : 3 + 2 * inter]  # strided rows, as a slice of a wider projection
    got = impl(SWIGLU, backend)(h, limit)
    want = _oracle(h.double(), limit)
    assert got.dtype == dtype and got.shape == (t, inter)
    if t:
        err = (got.double() - want).abs()
        bound = TOL[dtype] * (want.abs() + 1e-3 * want.abs().max())
        assert bool((err <= bound).all()), float((err / bound).max())
    if limit and t:  # the clamp was active somewhere
        assert float(h.double().abs().max()) > limit


@pytest.mark.parametrize("backend", cpu_backends(SWIGLU))
def test_odd_width_is_named(backend):
    with pytest.raises(ValueError, match="2I"):
        impl(SWIGLU, backend)(torch.zeros(2, 7), 10.0)
