# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels' integer e4m3 codec (``ops/triton/common/quant.py``: ``e4m3_bits_to_f32``,
``f32_to_e4m3_bits``), the path every target without e4m3 conversion instructions (sm_80 / sm_86)
takes and every cache encoder uses everywhere: bit-exact against torch's ``float8_e4m3fn`` over all
256 codes, and over fresh random fp32 values across the whole range with the cases that decide
exactness: subnormals, the midpoints between codes (ties to even), +-0, saturation above 448
(Inf included: torch saturates too) and NaN of both signs. Under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from vllm_dsv4_hw.ops.triton.common.quant import e4m3_bits_to_f32, f32_to_e4m3_bits  # noqa: E402


@triton.jit
def _decode_kernel(c_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, e4m3_bits_to_f32(tl.load(c_ptr + i, mask=i < n)), mask=i < n)


@triton.jit
def _encode_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, f32_to_e4m3_bits(tl.load(v_ptr + i, mask=i < n)), mask=i < n)


def _run(kernel, x, out_dtype):
    out = torch.empty(x.numel(), dtype=out_dtype)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def test_decode_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    got = _run(_decode_kernel, codes, torch.float32)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert int(nan.sum()) == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0.0 too


def _values(gen: torch.Generator) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties between neighbouring codes
    wide = torch.randn(20000, generator=gen) * torch.exp2(
        torch.randint(-24, 12, (20000,), generator=gen).float()
    )
    sub = (torch.rand(4000, generator=gen) - 0.5) * 2**-5  # the subnormal range (< 2^-6)
    big = torch.tensor(
        [448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 1e4, 3.4e38, float("inf"), float("nan")]
    )
    special = torch.tensor([0.0, -0.0, 2.0**-9, 2.0**-10, 2.0**-11, 1e-30, 2.0**-6])
    v = torch.cat(
        [
            finite,
            mids,
            mids.nextafter(torch.tensor(float("inf"))),
            mids.nextafter(torch.tensor(float("-inf"))),
            wide,
            sub,
            big,
            special,
        ]
    )
    return torch.cat([v, -v])


def test_encode_random_values_bit_exact(gen):
    v = _values(gen)
    got = _run(_encode_kernel, v, torch.uint8)
    want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:10]]
    assert set(got[v.isnan()].tolist()) == {0x7F, 0xFF}  # NaN of both signs
    assert int(got[v == float("inf")][0]) == 0x7E  # saturated like torch


def test_round_trip_of_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    back = _run(_encode_kernel, _run(_decode_kernel, codes, torch.float32), torch.uint8)
    assert torch.equal(back, codes)
