# SPDX-License-Identifier: Apache-2.0
"""``fp8_block_linear(..., quantize_x=True)``: the FP8 linears with e4m3 activations (W8A8, the
checkpoints' dynamic activation scheme) on every CPU-runnable backend, against a float64 oracle
written here: x's quantization (per row and ``bk`` block: scale ``2^ceil(log2(max(amax, 1e-4) /
448))``, codes rounded to nearest even on the e4m3 grid) computed independently in float64, then
the W8A16 oracle of ``test_fp8_block_linear`` on the quantized values, with that file's rigorous
bound (the quantized values are exact in fp32, so the kernels' only errors stay the accumulation
and the output rounding). Also: the Triton W8A8 kernel's tiles, the x-quantizing launch, splits
and the fallback of calls it does not take; the activation setting and the ``fp8_dot``
capability.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.ops.test_fp8_block_linear import assert_close, error_ratio, quantized_weight, rand_x
from vllm_dsv4_hw.conformance.cases_weights import e4m3_activation_values
from vllm_dsv4_hw.ops.api import FP8_BLOCK_LINEAR

BACKENDS = cpu_backends(FP8_BLOCK_LINEAR)


def oracle_quantize(x: torch.Tensor, bk: int) -> torch.Tensor:
    """x [..., K] (read as fp32) -> its e4m3 activation values, float64: the conformance kit's
    float64 oracle (written apart from the reference's integer rule)."""
    return e4m3_activation_values(x, bk)


def _x(gen, m, g, k, dtype):
    """Activations whose blocks span magnitudes (outliers, tiny blocks, an all-zero block)."""
    x = rand_x(gen, m, g, k, torch.float64)
    x = x * torch.exp2(torch.randint(-12, 6, x.shape[:-1] + (1,), generator=gen).double())
    if k > 40:
        x[..., 3] *= 300.0  # an outlier sets its block's scale
        x[..., 32:40] = 0.0  # with bk = 32: a whole zero block (the 1e-4 floor)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bk", [32, 128])
def test_quantization_matches_the_oracle(dtype, bk, gen):
    from vllm_dsv4_hw.ops.reference.linear import quantize_activations

    x = _x(gen, 7, None, 300, dtype)
    want = oracle_quantize(x, bk)
    got = quantize_activations(x, bk)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)


@pytest.mark.parametrize("bk", [32, 128])
def test_triton_quantize_launch_is_bit_exact(bk, gen):
    """The x-quantizing launch of the W8A8 kernel (interpreter): codes and scales whose product is
    the oracle's value, bit for bit."""
    from vllm_dsv4_hw.numerics import e4m3_decode
    from vllm_dsv4_hw.ops.triton.linear import w8a8 as fp8_dot_linear

    x = _x(gen, 19, None, 300, torch.bfloat16)
    q, xs = fp8_dot_linear.quantize(x, bk)
    assert q.shape == (19, 300) and xs.shape == (19, -(-300 // bk))
    got = e4m3_decode(q).double() * xs.double().repeat_interleave(bk, 1)[:, :300]
    assert torch.equal(got, oracle_quantize(x, bk))


SHAPES = [  # m, n, k, g (None = plain), block
    (1, 256, 384, None, (128, 128)),  # decode
    (3, 200, 300, None, (128, 128)),  # ragged N and K
    (5, 64, 256, 3, (128, 128)),  # grouped (wo_a form)
    (17, 100, 150, 2, (32, 32)),  # grouped, V4.1 blocks, ragged, a 32-row tile
    (70, 130, 200, None, (32, 32)),  # the prefill tile, ragged
    (0, 64, 128, None, (128, 128)),  # empty batch
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,g,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_oracle(backend, m, n, k, g, block, dtype, gen):
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = _x(gen, m, g, k, dtype)
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block, None, True)
    assert got.shape == ((m, g, n) if g else (m, n)) and got.dtype == dtype
    xq = oracle_quantize(x, block[1]).float()  # exact in fp32
    assert_close(got, xq, wq, sc, block, dtype)
    if m:
        # the test sees the quantization: a backend that skipped it (W8A16 on x itself, in the
        # same output dtype) is outside the bound
        plain = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block, None)
        skipped, _ = error_ratio(plain, xq, wq, sc, block, dtype)
        assert skipped > 1.0, f"quantization-free output within {skipped:.3g} x the bound"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "x_dtype,out_dtype,block",
    [
        (torch.float64, None, (128, 128)),  # float64 x: the W8A16 kernel on the quantized values
        (torch.bfloat16, torch.float32, (64, 96)),  # a scale block the W8A8 kernel does not take
        (torch.float16, None, (32, 32)),
    ],
)
def test_dtypes_and_fallbacks(backend, x_dtype, out_dtype, block, gen):
    wq, sc = quantized_weight(gen, (72, 200), (block[0], block[0]))
    sc = torch.randint(
        120, 128, (-(-72 // block[0]), -(-200 // block[1])), generator=gen, dtype=torch.uint8
    )
    x = rand_x(gen, 3, None, 200, x_dtype)  # (fp16 outputs: no outlier blocks)
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block, out_dtype, True)
    xq = oracle_quantize(x, block[1])
    assert_close(
        got,
        xq.to(torch.float64 if x_dtype == torch.float64 else torch.float32),
        wq,
        sc,
        block,
        out_dtype or x_dtype,
    )


@pytest.mark.parametrize(
    "knobs",
    [
        dict(wt=True, pre=False, xpf=True),  # decode default
        dict(wt=True, pre=False, xpf=False),
        dict(wt=True, pre=True, block_n=128),
        dict(wt=False, pre=True, block_m=64),  # the prefill tile
        dict(wt=False, pre=False, xpf=True, block_m=16),
        dict(wt=True, split_k=3, serial=True),  # the last split sums
        dict(wt=True, split_k=3, serial=False, pre=True),  # the separate sum launch
    ],
)
@pytest.mark.parametrize("g", [None, 2])
def test_triton_w8a8_tiles(knobs, g, gen):
    """Every tile and mode of the W8A8 kernel (interpreter) within the bound, and bit-equal to
    each other where only the x path differs (the same codes enter the same dots)."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    block = (128, 128)
    m, n, k = 6, 200, 420
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = _x(gen, m, g, k, torch.bfloat16)
    got = fp8_block_linear(x, wq, sc, block, torch.float32, True, **knobs)
    assert_close(got, oracle_quantize(x, 128).float(), wq, sc, block, torch.float32)
    other = dict(knobs, pre=not knobs.get("pre", False), xpf=True)
    assert torch.equal(fp8_block_linear(x, wq, sc, block, torch.float32, True, **other), got)


def test_activation_setting(monkeypatch):
    from vllm_dsv4_hw import envs
    from vllm_dsv4_hw.quant.linear import e4m3_activations

    cpu = torch.device("cpu")
    monkeypatch.delenv("VLLM_DSV4_HW_FP8_ACTIVATIONS", raising=False)
    assert e4m3_activations(cpu) is False  # auto: the CPU declares no FP8 dots
    monkeypatch.setenv("VLLM_DSV4_HW_FP8_ACTIVATIONS", "e4m3")
    assert e4m3_activations(cpu) is True
    monkeypatch.setenv("VLLM_DSV4_HW_FP8_ACTIVATIONS", "model")
    assert e4m3_activations(cpu) is False
    monkeypatch.setenv("VLLM_DSV4_HW_FP8_ACTIVATIONS", "fp8")
    with pytest.raises(envs.SettingError, match="VLLM_DSV4_HW_FP8_ACTIVATIONS='fp8'.*auto"):
        e4m3_activations(cpu)


def test_fp8_dot_capability():
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    assert not cuda_capabilities(8, 0).fp8_dot and not cuda_capabilities(8, 6).fp8_dot
    assert all(cuda_capabilities(*cc).fp8_dot for cc in ((8, 9), (9, 0), (10, 0), (12, 0)))
    assert not cuda_capabilities(9, 4, hip=True).fp8_dot  # ROCm e4m3 is the fnuz variant


def test_w8a8_tile_rule():
    """The measured launch rule (``fp8_dot_linear._tile``) at the shipped projections."""
    from vllm_dsv4_hw.ops.triton.linear.w8a8 import _tile

    dec = _tile(1, 32768, 1, 1024)  # V4-Flash wq_b, decode
    assert (dec["block_m"], dec["block_n"], dec["pre"], dec["xpf"], dec["wt"]) == (
        16,
        64,
        False,
        True,
        True,
    )
    assert _tile(32, 32768, 1, 1024)["pre"] and _tile(32, 1024, 8, 4096)["pre"]  # wq_b, wo_a
    assert _tile(32, 1024, 8, 4096)["max_split"] == 4
    assert not _tile(32, 8192, 1, 1024)["pre"]  # indexer wq_b: x quantized in place
    assert not _tile(32, 1536, 1, 7168)["pre"]  # V4-Pro wq_a
    assert _tile(32, 1024, 1, 4096)["block_m"] == 32
    pre = _tile(4096, 4096, 1, 8192)
    assert (pre["block_m"], pre["block_n"], pre["wt"], pre["pre"]) == (64, 128, False, True)


def _codes(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 codes, fp32 scales [..., KB]) of the oracle's quantization."""
    from vllm_dsv4_hw.conformance.cases_weights import _e4m3_codes

    return _e4m3_codes(oracle_quantize(x, bk), bk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,g,block", [s for s in SHAPES if s[0]])
def test_prequantized_x_is_quantize_x(backend, m, n, k, g, block, gen):
    """``x_scales``: x given as e4m3 codes + scales gives the result of ``quantize_x`` on the
    values they encode (the same codes enter the same dots), bit for bit; bf16 out by default."""
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = _x(gen, m, g, k, torch.float32)
    codes, scales = _codes(x, block[1])
    f = impl(FP8_BLOCK_LINEAR, backend)
    got = f(codes, wq, sc, block, None, False, x_scales=scales)
    assert got.dtype == torch.bfloat16
    want = f(x, wq, sc, block, torch.bfloat16, True)
    assert torch.equal(got, want)
    assert_close(
        f(codes, wq, sc, block, torch.float32, x_scales=scales),
        oracle_quantize(x, block[1]).float(),
        wq,
        sc,
        block,
        torch.float32,
    )


def test_prequantized_x_errors(gen):
    from vllm_dsv4_hw.ops import api

    wq, sc = quantized_weight(gen, (64, 256), (128, 128))
    codes, scales = _codes(_x(gen, 2, None, 256, torch.float32), 128)
    with pytest.raises(ValueError, match="with x_scales, x must be e4m3 codes"):
        api.fp8_block_linear(codes.float(), wq, sc, (128, 128), x_scales=scales)
    with pytest.raises(ValueError, match=r"x_scales must be float32 \[2, 2\]"):
        api.fp8_block_linear(codes, wq, sc, (128, 128), x_scales=scales[:, :1])


@pytest.mark.parametrize("g,n,k", [(None, 200, 1000), (3, 64, 300), (None, 24, 128)])
@pytest.mark.parametrize(
    "knobs", [dict(), dict(split_k=3, block_k=128), dict(split_k=2, block_k=256, block_n=16)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_gemv_one_row(g, n, k, knobs, dtype, gen):
    """The one-row GEMV (``fp8_gemv``, the decode row's W8A8 path; interpreter): within the
    oracle's bound for plain and grouped weights, ragged N and K (a K block past the last
    split), every x dtype; its splits summed by the last split or by the separate launch give
    the same bits; the tile kernels (gemv=False) agree within the bound."""
    from vllm_dsv4_hw.ops.reference.linear import check_fp8_block_linear_args
    from vllm_dsv4_hw.ops.triton.linear import gemv as fp8_gemv
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    block = (128, 128)
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = _x(gen, 1, g, k, dtype)
    a = check_fp8_block_linear_args(x, wq, sc, block, torch.float32)
    assert fp8_gemv.takes(a, 1)
    got = fp8_gemv.launch(a, **knobs)
    assert got.shape == ((1, g, n) if g else (1, n))
    assert_close(got, oracle_quantize(x, 128).float(), wq, sc, block, torch.float32)
    assert torch.equal(fp8_gemv.launch(a, serial=False, **knobs), got)
    if not knobs:
        assert torch.equal(fp8_block_linear(x, wq, sc, block, torch.float32, True, gemv=True), got)
        tiles = fp8_block_linear(x, wq, sc, block, torch.float32, True, gemv=False)
        assert_close(tiles, oracle_quantize(x, 128).float(), wq, sc, block, torch.float32)


@pytest.mark.parametrize(
    "m,g,n,k,knobs",
    [
        (2, None, 200, 1000, dict(split_k=3, block_k=128)),
        (3, 3, 64, 300, dict()),
        (5, None, 24, 384, dict(block_n=16, block_k=256)),
        (3, None, 200, 1000, dict(split_k=2)),
        (2, 2, 40, 768, dict(block_k=256, split_k=2)),
    ],
)
def test_triton_gemv_rows_and_codes(m, g, n, k, knobs, gen):
    """The GEMV of a few rows (one weight tile, every row's products): within the oracle's
    bound, and each row the bits of a one-row launch of that row (batch-invariant); x given as
    the producer's e4m3 codes + scales: the bits of the launch that quantizes it, also through
    ``fp8_block_linear(x_scales=...)``."""
    from vllm_dsv4_hw.ops.reference.linear import check_fp8_block_linear_args
    from vllm_dsv4_hw.ops.triton.linear import gemv as fp8_gemv
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    block = (128, 128)
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = _x(gen, m, g, k, torch.bfloat16)
    a = check_fp8_block_linear_args(x, wq, sc, block, torch.float32)
    assert fp8_gemv.takes(a, m) and not fp8_gemv.takes(a, m - 1)
    got = fp8_gemv.launch(a, **knobs)
    assert got.shape == ((m, g, n) if g else (m, n))
    assert_close(got, oracle_quantize(x, 128).float(), wq, sc, block, torch.float32)
    for r in (0, m - 1):
        one = check_fp8_block_linear_args(x[r : r + 1], wq, sc, block, torch.float32)
        assert torch.equal(fp8_gemv.launch(one, **knobs), got[r : r + 1])
    codes, scales = _codes(x.float(), 128)
    c = check_fp8_block_linear_args(codes, wq, sc, block, torch.float32, x_dtype=torch.float32)
    xs = scales if g else scales.unsqueeze(1)
    assert fp8_gemv.takes(c._replace(x=codes if g else codes.unsqueeze(1)), m, codes=True)
    assert torch.equal(
        fp8_gemv.launch(c._replace(x=codes if g else codes.unsqueeze(1)), x_scales=xs, **knobs), got
    )
    if not knobs:
        assert torch.equal(
            fp8_block_linear(codes, wq, sc, block, torch.float32, x_scales=scales, gemv=True), got
        )


def test_gemv_takes_one_row_of_128_column_blocks(gen):
    from vllm_dsv4_hw.ops.reference.linear import check_fp8_block_linear_args
    from vllm_dsv4_hw.ops.triton.linear import gemv as fp8_gemv

    wq, sc = quantized_weight(gen, (64, 256), (128, 128))
    w32, s32 = quantized_weight(gen, (64, 256), (32, 32))
    one, two = torch.zeros(1, 256), torch.zeros(2, 256)
    assert fp8_gemv.takes(check_fp8_block_linear_args(one, wq, sc, (128, 128), None), 1)
    assert not fp8_gemv.takes(check_fp8_block_linear_args(two, wq, sc, (128, 128), None), 1)
    assert not fp8_gemv.takes(check_fp8_block_linear_args(one, w32, s32, (32, 32), None), 1)
    assert not fp8_gemv.takes(
        check_fp8_block_linear_args(one.double(), wq, sc, (128, 128), None), 1
    )
    # the product's row count (LinearTuning.gemv_max_rows: one row, from the stack's timings),
    # and a scope that passes another
    from vllm_dsv4_hw.ops import tuning

    assert tuning.current().linear.gemv_max_rows == 1
    assert fp8_gemv.takes(check_fp8_block_linear_args(one, wq, sc, (128, 128), None))
    with tuning.override(linear=tuning.LinearTuning(gemv_max_rows=0)):
        assert not fp8_gemv.takes(check_fp8_block_linear_args(one, wq, sc, (128, 128), None))
    with tuning.override(linear=tuning.LinearTuning(gemv_max_rows=2)):
        assert fp8_gemv.takes(check_fp8_block_linear_args(two, wq, sc, (128, 128), None))
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemv.launch(check_fp8_block_linear_args(one, wq, sc, (128, 128), None), block_k=192)
