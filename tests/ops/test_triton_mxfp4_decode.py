# SPDX-License-Identifier: Apache-2.0
"""The Triton MXFP4 key decode (``quant.load_entry_pairs``, used by the indexer's score kernel)
against the format's own codec, exhaustively: every data byte (two e2m1 codes) under every scale
byte 0..254, bit for bit (fp32, subnormal results included), under the Triton interpreter.

The decode builds the scaled value from integer ops (the scale folded into the exponent,
``quant.e2m1_scaled_f32``) for scale bytes 2..252 and clamps the others into that range with a
power-of-two correction; both must equal e2m1 value x 2^(scale byte - 127) exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm_dsv4_hw.numerics import e2m1_decode  # noqa: E402
from vllm_dsv4_hw.ops.triton.common import quant  # noqa: E402

PAIRS = 16  # one 32-dim scale block per key
KEYS = 4096  # 255 scale bytes x 16 keys (all 256 data bytes each), padded with scale 127


@triton.jit
def _decode_kernel(
    cache_ptr,
    even_ptr,
    odd_ptr,
    S: tl.constexpr,
    P: tl.constexpr,
    SCALE_BASE: tl.constexpr,
    FMT: tl.constexpr,
):
    s = tl.arange(0, S)
    j = tl.arange(0, P)
    mask = (s >= 0)[None, :] & (j >= 0)[:, None]
    ve, vo = quant.load_entry_pairs(
        cache_ptr, (s * P)[None, :], (SCALE_BASE + s)[None, :], j[:, None], mask, FMT, False
    )
    out = j[:, None] * S + s[None, :]
    tl.store(even_ptr + out, ve)
    tl.store(odd_ptr + out, vo)


def test_mxfp4_decode_every_byte_and_scale():
    keys = torch.arange(KEYS)
    scale = torch.where(keys < 255 * 16, keys // 16, torch.full_like(keys, 127))
    data = (keys % 16)[:, None] * PAIRS + torch.arange(PAIRS)[None, :]  # [KEYS, 16] bytes
    cache = torch.cat([data.reshape(-1), scale]).to(torch.uint8)
    even = torch.full((PAIRS, KEYS), float("nan"))
    odd = torch.full((PAIRS, KEYS), float("nan"))
    _decode_kernel[(1,)](
        cache, even, odd, S=KEYS, P=PAIRS, SCALE_BASE=KEYS * PAIRS, FMT=quant.FMT_MXFP4
    )
    pw = torch.pow(torch.tensor(2.0, dtype=torch.float64), scale.double() - 127)  # [KEYS]
    want_e = (e2m1_decode(data & 0xF).double() * pw[:, None]).float().t()
    want_o = (e2m1_decode(data >> 4).double() * pw[:, None]).float().t()
    assert torch.equal(even.view(torch.int32), want_e.view(torch.int32))
    assert torch.equal(odd.view(torch.int32), want_o.view(torch.int32))
    # the cases that matter are there: subnormal results, zero, both signs, the top of the range
    # (finite values near 2^127 and products past fp32's range, which become inf)
    assert bool((want_e.abs() < 2.0**-126).logical_and(want_e != 0).any())
    assert bool((want_e == 0).any()) and bool((want_e < 0).any())
    finite = want_o.abs()[torch.isfinite(want_o)]
    assert float(finite.max()) >= 2.0**127 and bool(torch.isinf(want_o).any())
