"""The benchmark stack's FP8 weight-only GEMM (``benchmarks/stack/w8a16.py``) against a float64
oracle, on CPU under the Triton interpreter: plain and grouped weights, M = 1, 4 and 5, with and without split-K, at shapes whose N and K are not multiples of
the 128-wide scale blocks. Fresh random inputs per run (the conftest seed); the output is poisoned
by allocating it through the kernel's own path, so every checked element was written.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.stack.fp8 import dequantize_blockwise, quantize_blockwise  # noqa: E402
from benchmarks.stack.w8a16 import _auto_split_k, w8a16_matmul  # noqa: E402


def _oracle(x, w8, scale, grouped):
    wf = dequantize_blockwise(w8, scale, torch.float64)
    xf = x.double()
    return torch.einsum("mgk,gnk->mgn", xf, wf) if grouped else xf @ wf.t()


@pytest.mark.parametrize("m,n,k,g,split", [
    (1, 256, 384, None, None),    # M = 1, auto split
    (1, 200, 300, None, 3),       # ragged N and K, forced 3-way split
    (1, 64, 256, 3, 1),           # grouped (wo_a shape), no split
    (1, 128, 256, None, 2),       # 2-way split
    (4, 192, 256, None, None),    # batch 4
    (5, 96, 384, 2, 2),           # grouped, odd M, split
])
def test_w8a16_matches_float64(gen, m, n, k, g, split):
    w = torch.randn(*((g,) if g else ()), n, k, generator=gen)
    w8, scale = quantize_blockwise(w)
    x = torch.randn(*((m, g, k) if g else (m, k)), generator=gen).to(torch.bfloat16)
    got = w8a16_matmul(x, w8, scale, split_k=split)
    ref = _oracle(x, w8, scale, g is not None)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert torch.isfinite(got).all()
    # exact products (e4m3 and bf16 are exact in fp32), fp32 accumulation, bf16 output rounding
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-2, err


def test_auto_split_k():
    sms = 132
    assert _auto_split_k(kb=32, base=32, sms=sms) == 8       # wq_a: few blocks, 8-way
    assert _auto_split_k(kb=8, base=512, sms=sms) == 1       # wq_b: the blocks fill the device
    assert _auto_split_k(kb=64, base=128, sms=sms) == 4      # wo_b: at most 16 K blocks each
    assert _auto_split_k(kb=128, base=224, sms=sms) == 8     # Pro wo_b: long K splits anyway
    assert _auto_split_k(kb=2, base=1, sms=sms) == 2         # never more splits than K blocks
