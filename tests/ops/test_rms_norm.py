# SPDX-License-Identifier: Apache-2.0
"""rms_norm conformance: weighted and weightless forms against a float64 oracle."""

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import rms_norm_oracle
from vllm_dsv4_hw.ops.api import RMS_NORM

# Relative error budget of the returned value per output dtype (fp32 math, one final rounding).
_TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float64: 1e-12}


def _check(out, x, weight, eps):
    ref = rms_norm_oracle(x, weight, eps)  # oracle on the exact input values
    assert out.dtype == x.dtype and out.shape == x.shape
    tol = _TOL[x.dtype]
    err = (out.double() - ref).abs()
    assert torch.all(err <= tol * ref.abs() + tol * 1e-3), float(err.max())


@pytest.mark.parametrize("backend", cpu_backends(RMS_NORM))
@pytest.mark.parametrize("shape", [(1, 4), (5, 7), (3, 4, 128), (4, 512), (2, 8, 512), (3, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_oracle(backend, shape, dtype, weighted, gen):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0).to(dtype)
    w = (
        (torch.rand(shape[-1], generator=gen, dtype=torch.float64) * 2 - 0.5).to(dtype)
        if weighted
        else None
    )
    eps = 1e-6
    _check(impl(RMS_NORM, backend)(x, w, eps), x, w, eps)


@pytest.mark.parametrize("backend", cpu_backends(RMS_NORM))
def test_rms_norm_uses_fp32_math_for_half_inputs(backend, gen):
    # x^2 of these values overflows fp16 (max 65504): only wider math gives the right answer.
    x = (torch.randn(6, 256, generator=gen) * 400.0).to(torch.float16)
    out = impl(RMS_NORM, backend)(x, None, 1e-6)
    assert torch.isfinite(out).all()
    _check(out, x, None, 1e-6)
    # The rms of the output is 1 (weightless form).
    assert torch.allclose(out.float().square().mean(-1), torch.ones(6), rtol=5e-3)


@pytest.mark.parametrize("backend", cpu_backends(RMS_NORM))
def test_rms_norm_eps_matters_for_tiny_inputs(backend, gen):
    x = torch.randn(3, 64, generator=gen) * 1e-4
    out = impl(RMS_NORM, backend)(x, None, 1e-6)
    _check(out, x, None, 1e-6)
    # With eps dominating, the output is far below unit rms.
    assert float(out.square().mean()) < 0.1
