# SPDX-License-Identifier: Apache-2.0
"""dense_linear (every CPU-runnable backend) against a float64 oracle on fresh random inputs: M = 1
.. 40 (across the Triton kernel's 16-row limit), N and K that are no multiples of its tiles, K below
one tile, bf16 / fp32 outputs, fp32 weights; the Triton kernel's split-K summed inside the launch
against the separate sum (same bits); argument errors.

Tolerance (rigorous, so no seed can fail it): bf16 x bf16 products are exact in fp32, so the only
errors are the accumulation and the one rounding: ``|got - want| <= 2^-p |want| + (K + 4) u A``
(``2^-p`` half an ulp of the output dtype, ``u = 2^-24``, ``A = |x| @ |w|^T``).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.ops.api import DENSE_LINEAR

BACKENDS = cpu_backends(DENSE_LINEAR)
_HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
triton_only = pytest.mark.skipif("triton" not in BACKENDS, reason="no triton backend here")


def _inputs(gen, m, n, k, w_dtype=torch.bfloat16):
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype)
    return x, w


def assert_close(got, x, w, out_dtype):
    xd, wd = x.double(), w.double()
    want = xd @ wd.t()
    a = xd.abs() @ wd.abs().t()
    bound = _HALF_ULP[out_dtype] * want.abs() + (x.shape[1] + 4) * 2.0**-24 * a + 1e-300
    assert got.dtype == out_dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max err / bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 2048, 256), (1, 96, 130), (3, 64, 4096), (16, 200, 200), (17, 40, 300), (40, 33, 40)],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle(backend, m, n, k, out_dtype, gen):
    x, w = _inputs(gen, m, n, k)
    assert_close(impl(DENSE_LINEAR, backend)(x, w, out_dtype), x, w, out_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_weight_and_default_dtype(backend, gen):
    """An fp32 weight (x is cast to it, as F.linear needs); no out_dtype: x's."""
    x, w = _inputs(gen, 2, 48, 160, torch.float32)
    got = impl(DENSE_LINEAR, backend)(x, w)
    assert got.dtype == torch.bfloat16
    assert_close(got, x.float(), w, torch.bfloat16)


@triton_only
@pytest.mark.parametrize("m,n,k,split", [(1, 200, 300, 3), (5, 96, 512, 2)])
def test_triton_serial_split_k_same_bits(m, n, k, split, gen):
    """The split-K partials summed by each tile's last split inside the launch give the bits of
    the separate sum launch, and the oracle's values."""
    from vllm_dsv4_hw.ops.triton.linear import dense as td

    x, w = _inputs(gen, m, n, k)
    serial = td.dense_linear(x, w, torch.float32, split_k=split, block_n=32, serial=True)
    two = td.dense_linear(x, w, torch.float32, split_k=split, block_n=32, serial=False)
    assert torch.equal(serial, two)
    assert_close(serial, x, w, torch.float32)


@triton_only
def test_triton_takes_decode_rows_only(gen):
    """Past MAX_ROWS rows, or with an fp32 weight, the Triton op is the reference GEMM."""
    from vllm_dsv4_hw.ops.reference import linear as rd
    from vllm_dsv4_hw.ops.triton.linear import dense as td

    x, w = _inputs(gen, td.MAX_ROWS + 1, 64, 256)
    assert not td.takes(x, w) and td.takes(x[: td.MAX_ROWS], w)
    assert not td.takes(x[:1], w.float())
    assert torch.equal(td.dense_linear(x, w, torch.float32), rd.dense_linear(x, w, torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    f = impl(DENSE_LINEAR, backend)
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[N, K\]"):
        f(x, torch.zeros(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        f(x.view(1, 2, 8), w)
    with pytest.raises(ValueError, match="weight must be one of"):
        f(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        f(x, w, torch.int32)
