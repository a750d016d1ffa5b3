# SPDX-License-Identifier: Apache-2.0
"""Fused prologue / epilogue ops (qnorm_rope_kv_insert, inv_rope_fp8_quant, qkv_rms_norm) on every
CPU-runnable backend, against float64 oracles written here (complex-number RoPE, plain RMSNorm,
power-of-two FP8 scales). Real dims (D 512, R 64), few heads and tokens; positions cross the 4 / 8 /
128 / 256 boundaries; caches are poisoned with NaN bytes and every byte outside the written entries
must stay identical."""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw import ops
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.api import INV_ROPE_FP8_QUANT, QKV_RMS_NORM, QNORM_ROPE_KV_INSERT
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

D, R = 512, 64
THETA = 10000.0
POSITIONS = [0, 3, 4, 7, 8, 127, 128, 129, 255, 256, 511, 4095, 65536, 70001]
POISON = 0xFF  # NaN in bf16 / fp32 / e4m3 data and inf as a ue8m0 scale byte


@pytest.fixture(scope="module")
def table():
    return rope_cos_sin(THETA, R, max(POSITIONS) + 1)


# -- float64 oracles --------------------------------------------------------------------------------
def inv_freq64(theta=THETA, r=R):
    return theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)


def rope64(x, pos, inverse=False):
    """GPT-J RoPE on the last R dims of x [T, ..., D] as a complex product, float64."""
    x = x.double()
    ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * inv_freq64()[None, :]
    if inverse:
        ang = -ang
    rot = torch.polar(torch.ones_like(ang), ang).reshape(
        (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    )
    z = torch.complex(x[..., D - R :: 2], x[..., D - R + 1 :: 2]) * rot
    out = x.clone()
    out[..., D - R :: 2], out[..., D - R + 1 :: 2] = z.real, z.imag
    return out


def rms64(x, w, eps):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


# -- helpers ------------------------------------------------------------------------------------------
def _rows(gen, shape, dtype, lo=-4.0, hi=4.0):
    """Random rows with per-row magnitudes 2^lo .. 2^hi."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    mag = torch.exp2(
        torch.empty(shape[:-1] + (1,), dtype=torch.float64).uniform_(lo, hi, generator=gen)
    )
    return (x * mag).to(dtype)


def _entry_spans(fmt, slot):
    e = fmt.entries_per_page
    page, off = divmod(int(slot), e)
    d0 = off * fmt.data_bytes
    s0 = e * fmt.data_bytes + off * fmt.scale_bytes
    return page, slice(d0, d0 + fmt.data_bytes), slice(s0, s0 + fmt.scale_bytes)


def _check_cache(cache, before, fmt, slots, want):
    """Written entries decode to ``want`` within the format's error; every other byte is intact."""
    written = torch.zeros_like(cache, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, ds, ss = _entry_spans(fmt, s)
        written[page, ds] = True
        written[page, ss] = True
        got = fmt.dequantize(cache[page, ds][None].clone(), cache[page, ss][None].clone())[
            0
        ].double()
        x = want[i]
        assert torch.isfinite(got).all(), f"slot {s}: entry not fully written"
        if fmt.name == "fp32":
            torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)
        elif fmt.name == "bf16":
            torch.testing.assert_close(got, x, rtol=2**-8, atol=1e-5)
        else:  # fp8_ds_mla: 7 e4m3 blocks of 64 with power-of-two scales, bf16 rope dims
            sb = cache[page, ss]
            assert int(sb[7]) == 0
            s_blk = torch.exp2(sb[:7].double() - 127)
            amax = x[:448].reshape(7, 64).abs().amax(-1).clamp_min(1e-4)
            # s = 2^ceil(log2(amax / 448)) (slack: the codec rounds x to bf16 first)
            assert torch.all(448 * s_blk >= amax * (1 - 2**-8)), (s_blk, amax)
            assert torch.all(448 * s_blk < 2 * amax * (1 + 2**-8)), (s_blk, amax)
            s_el = s_blk.repeat_interleave(64)
            bound = x[:448].abs() * (2**-4 + 2**-8) + s_el * 2**-10 + 1e-6
            assert torch.all((got[:448] - x[:448]).abs() <= bound)
            torch.testing.assert_close(got[448:], x[448:], rtol=2**-8, atol=1e-5)
    assert torch.equal(cache[~written], before[~written]), (
        "bytes outside the written entries changed"
    )


# -- qnorm_rope_kv_insert -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends(QNORM_ROPE_KV_INSERT))
@pytest.mark.parametrize(
    "fmt_name,dtype,pad",
    [
        ("fp8", torch.bfloat16, 64),
        ("fp8", torch.float32, 13),
        ("bf16", torch.bfloat16, 64),
        ("bf16", torch.float32, 13),
        ("fp32", torch.float32, 64),
    ],
)
def test_qnorm_rope_kv_insert_matches_oracle(backend, fmt_name, dtype, pad, table, gen):
    f = impl(QNORM_ROPE_KV_INSERT, backend)
    t, h, e, pages, eps = len(POSITIONS), 3, 8, 3, 1e-6
    fmt = make_format(fmt_name, "main", e)
    cache = fmt.new_cache(pages, page_bytes=fmt.min_page_bytes + pad).fill_(POISON)
    before = cache.clone()
    q = _rows(gen, (t, h, D), dtype)
    q[1, 2] = 0.0  # an all-zero head: eps keeps it finite (output 0)
    kv = _rows(gen, (t, D), dtype, -6.0, 6.0)
    slots = torch.randperm(pages * e, generator=gen)[:t]
    slots[torch.randperm(t, generator=gen)[:3]] = -1
    pos = torch.tensor(POSITIONS)
    q_in, kv_in = q.clone(), kv.clone()

    q_out = f(q, kv, pos, table, eps, cache, slots, fmt)

    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert torch.equal(q, q_in) and torch.equal(kv, kv_in)  # inputs untouched
    want_q = rope64(rms64(q, None, eps), POSITIONS)
    tol = dict(rtol=2**-8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_out.double(), want_q, **tol)
    assert torch.equal(q_out[1, 2], torch.zeros(D, dtype=dtype))
    _check_cache(cache, before, fmt, slots, rope64(kv, POSITIONS))


@pytest.mark.parametrize("backend", cpu_backends(QNORM_ROPE_KV_INSERT))
def test_qnorm_rope_kv_insert_no_slots_and_empty(backend, table, gen):
    f = impl(QNORM_ROPE_KV_INSERT, backend)
    fmt = make_format("fp8", "main", 4)
    cache = fmt.new_cache(2).fill_(POISON)
    before = cache.clone()
    q = _rows(gen, (2, 2, D), torch.bfloat16)
    out = f(
        q,
        _rows(gen, (2, D), torch.bfloat16),
        torch.tensor([5, 300]),
        table,
        1e-6,
        cache,
        torch.tensor([-1, -1]),
        fmt,
    )
    assert torch.equal(cache, before)
    torch.testing.assert_close(
        out.double(), rope64(rms64(q, None, 1e-6), [5, 300]), rtol=2**-8, atol=1e-5
    )
    empty = f(
        torch.zeros(0, 2, D),
        torch.zeros(0, D),
        torch.zeros(0, dtype=torch.long),
        table,
        1e-6,
        cache,
        torch.zeros(0, dtype=torch.long),
        fmt,
    )
    assert empty.shape == (0, 2, D) and torch.equal(cache, before)


@pytest.mark.parametrize("backend", cpu_backends(QNORM_ROPE_KV_INSERT))
def test_qnorm_rope_kv_insert_bad_inputs(backend, table):
    f = impl(QNORM_ROPE_KV_INSERT, backend)
    fmt = make_format("fp8", "main", 4)
    cache = fmt.new_cache(2)
    q, kv, pos, sl = (
        torch.zeros(2, 2, D),
        torch.zeros(2, D),
        torch.tensor([0, 1]),
        torch.tensor([0, 1]),
    )
    with pytest.raises(ValueError):
        f(q, torch.zeros(2, 128), pos, table, 1e-6, cache, sl, fmt)
    with pytest.raises(ValueError):
        f(q[..., :128], kv[:, :128], pos, table, 1e-6, cache, sl, fmt)  # fmt holds 512-vectors
    with pytest.raises(ValueError):
        f(q, kv, pos, table, 1e-6, cache, torch.tensor([0]), fmt)
    with pytest.raises(ValueError):
        f(q, kv, pos, table, 1e-6, cache, torch.tensor([0, 8]), fmt)  # past the cache
    assert torch.equal(cache, fmt.new_cache(2))


# -- inv_rope_fp8_quant ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends(INV_ROPE_FP8_QUANT))
@pytest.mark.parametrize(
    "dtype,inverse", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)]
)
def test_inv_rope_fp8_quant_matches_oracle(backend, dtype, inverse, table, gen):
    """inverse=False is ``rope_fp8_quant`` (the indexer's q^I): the forward rotation."""
    f = impl(INV_ROPE_FP8_QUANT, backend)
    t, h = len(POSITIONS), 3
    o = _rows(gen, (t, h, D), dtype, -20.0, 10.0)
    o[2, 1] = 0.0  # amax 0: the floor sets the scale, codes are 0
    o[3, 0] = (torch.randn(D, generator=gen) * 1e-12).to(dtype)  # below the 1e-10 floor
    o_in = o.clone()

    q, s = f(o, torch.tensor(POSITIONS), table, inverse)

    assert torch.equal(o, o_in)
    assert q.shape == (t, h, D) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (t, h, D // 128) and s.dtype == torch.float32
    x = rope64(o, POSITIONS, inverse=inverse)  # [T, H, D] float64
    s64 = s.double()
    # power-of-two scales, s = 2^ceil(log2(max(amax, 1e-10) / 448)) (slack: x is fp32 in the op)
    assert torch.equal(torch.exp2(torch.log2(s64).round()), s64)
    amax = x.reshape(t, h, 4, 128).abs().amax(-1).clamp_min(1e-10)
    assert torch.all(448 * s64 >= amax * (1 - 1e-6)) and torch.all(
        448 * s64 < 2 * amax * (1 + 1e-6)
    )
    floor_scale = 2.0 ** math.ceil(math.log2(1e-10 / 448))
    assert torch.all(s64[2, 1] == floor_scale) and torch.all(s64[3, 0] == floor_scale)
    assert torch.all(q[2, 1].float() == 0)  # (+-0: the rotation may give -0.0)
    qf = q.double()
    assert torch.isfinite(qf).all() and qf.abs().max() <= 448
    deq = qf * s64.repeat_interleave(128, -1)
    s_el = s64.repeat_interleave(128, -1)
    assert torch.all((deq - x).abs() <= x.abs() * (2**-4 + 1e-6) + s_el * 2**-10)


@pytest.mark.parametrize("inverse", [True, False])
@pytest.mark.parametrize("rows,warps", [(1, 1), (2, 1), (4, 4), (8, 2)])
def test_inv_rope_fp8_quant_row_tiles(rows, warps, inverse, table, gen):
    """The Triton kernel's tiles of several (token, head) rows per iteration (prefill), the last
    tile ragged, give the one-row program's codes and scales bit for bit."""
    from vllm_dsv4_hw.ops.triton.rope import inv_rope_fp8_quant

    t = len(POSITIONS)
    o = _rows(gen, (t, 3, D), torch.bfloat16, -20.0, 10.0)  # 42 rows
    o[1, 2] = -0.0  # a row of -0.0: its codes keep the sign outside the rotated dims
    pos = torch.tensor(POSITIONS)
    q1, s1 = inv_rope_fp8_quant(o, pos, table, inverse, rows=1)
    q, s = inv_rope_fp8_quant(o, pos, table, inverse, rows=rows, num_warps=warps)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    assert (q.view(torch.uint8)[1, 2, :448] == 0x80).all()


def test_inv_rope_fp8_quant_hardware_encode(table, gen):
    """The cvt encode (``HW_ENC``, what sm_89+ GPUs run) gives the integer encode's scales and
    (nearly all of) its codes. The interpreter's fp8 cast is not the hardware's (ties round up, a
    mantissa carry can drop the exponent: 31.5 -> 16), so bit equality of every code is checked
    on the GPU (``benchmarks/gpu/fused.py``); here a wrong operand, byte order or scale would
    still change most codes. Only GPUs that declare the cvt take it; CPU tensors never."""
    from vllm_dsv4_hw.ops.triton.rope import hw_encode, inv_rope_fp8_quant

    t = len(POSITIONS)
    o = _rows(gen, (t, 3, D), torch.bfloat16, -20.0, 10.0)
    pos = torch.tensor(POSITIONS)
    q_int, s_int = inv_rope_fp8_quant(o, pos, table, hw_enc=False)
    q_hw, s_hw = inv_rope_fp8_quant(o, pos, table, hw_enc=True)
    assert torch.equal(s_hw, s_int)
    differ = q_hw.view(torch.uint8) != q_int.view(torch.uint8)
    assert differ.float().mean() < 0.15, float(differ.float().mean())
    assert not hw_encode(torch.device("cpu"))


@pytest.mark.parametrize("backend", cpu_backends(INV_ROPE_FP8_QUANT))
def test_inv_rope_fp8_quant_undoes_forward_rope(backend, table, gen):
    # rope then inverse-rope is the identity: quantizing a rope'd row gives the row's own codes.
    f = impl(INV_ROPE_FP8_QUANT, backend)
    x = _rows(gen, (4, 2, D), torch.float32)
    pos = torch.tensor([3, 4, 255, 256])
    q1, s1 = f(x, pos, table)
    q0, s0 = f(x, torch.zeros(4, dtype=torch.long), table)  # position 0: no rotation
    deq1 = q1.double() * s1.double().repeat_interleave(128, -1)
    deq0 = q0.double() * s0.double().repeat_interleave(128, -1)
    x64, s_el = x.double(), s0.double().repeat_interleave(128, -1)
    assert torch.all((deq0 - x64).abs() <= x64.abs() * 2**-4 + s_el * 2**-10)
    torch.testing.assert_close(deq1[..., :448], deq0[..., :448], rtol=0, atol=0)  # nope dims
    assert s1.shape == (4, 2, 4)
    empty_q, empty_s = f(torch.zeros(0, 2, D), torch.zeros(0, dtype=torch.long), table)
    assert empty_q.shape == (0, 2, D) and empty_s.shape == (0, 2, 4)


# -- qkv_rms_norm ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends(QKV_RMS_NORM))
@pytest.mark.parametrize(
    "dtype,q_lora", [(torch.bfloat16, 1024), (torch.float32, 1536), (torch.bfloat16, 1536)]
)
def test_qkv_rms_norm_matches_oracle(backend, dtype, q_lora, gen):
    f = impl(QKV_RMS_NORM, backend)
    t, eps = 5, 1e-6
    fused = _rows(gen, (t, q_lora + D), dtype)  # one projection output, split by columns
    q_r, kv = fused[:, :q_lora], fused[:, q_lora:]
    q_w = (torch.rand(q_lora, generator=gen, dtype=torch.float64) * 2 - 0.5).to(dtype)
    kv_w = (torch.rand(D, generator=gen, dtype=torch.float64) * 2 - 0.5).to(dtype)
    before = fused.clone()
    qn, kvn = f(q_r, q_w, kv, kv_w, eps)
    assert torch.equal(fused, before)
    assert qn.shape == (t, q_lora) and kvn.shape == (t, D) and qn.dtype == kvn.dtype == dtype
    tol = dict(rtol=2**-8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(qn.double(), rms64(q_r, q_w, eps), **tol)
    torch.testing.assert_close(kvn.double(), rms64(kv, kv_w, eps), **tol)
    e1, e2 = f(fused[:0, :q_lora], q_w, fused[:0, q_lora:], kv_w, eps)
    assert e1.shape == (0, q_lora) and e2.shape == (0, D)


@pytest.mark.parametrize("backend", cpu_backends(QKV_RMS_NORM))
def test_qkv_rms_norm_bad_inputs(backend):
    f = impl(QKV_RMS_NORM, backend)
    with pytest.raises(ValueError):
        f(torch.zeros(2, 8), torch.ones(8), torch.zeros(3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError):
        f(torch.zeros(2, 8), torch.ones(7), torch.zeros(2, 4), torch.ones(4), 1e-6)


# -- dispatch -------------------------------------------------------------------------------------
def test_new_ops_are_dispatched(monkeypatch, table, gen):
    assert {QNORM_ROPE_KV_INSERT, INV_ROPE_FP8_QUANT, QKV_RMS_NORM} <= set(api.ALL_OPS)
    o = _rows(gen, (2, 2, D), torch.bfloat16)
    pos = torch.tensor([1, 128])
    want = impl(INV_ROPE_FP8_QUANT, "reference")(o, pos, table)
    for backend in cpu_backends(INV_ROPE_FP8_QUANT):
        monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", f"{INV_ROPE_FP8_QUANT}={backend}")
        ops.REGISTRY.clear_cache()
        got = ops.inv_rope_fp8_quant(o, pos, table)
        assert torch.equal(got[1], want[1])
        assert (got[0].view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs().max() <= 1


# -- grid-stride loops of the triton kernels (capped grids: Ascend, large CUDA batches) ------------
@pytest.mark.skipif(
    "triton" not in cpu_backends(QNORM_ROPE_KV_INSERT), reason="triton not runnable"
)
def test_triton_kernels_with_capped_grid(monkeypatch, table, gen):
    from vllm_dsv4_hw.ops.triton.common import rows as common

    monkeypatch.setattr(common, "MAX_PROGRAMS", 3)  # every program loops over several rows
    t, h = 7, 2
    pos = torch.tensor(POSITIONS[:t])
    q, kv = _rows(gen, (t, h, D), torch.bfloat16), _rows(gen, (t, D), torch.bfloat16)
    fmt = make_format("fp8", "main", 4)
    slots = torch.tensor([9, 0, -1, 3, 4, 11, 6])
    outs = {}
    for backend in ("reference", "triton"):
        cache = fmt.new_cache(3).fill_(POISON)
        q_out = impl(QNORM_ROPE_KV_INSERT, backend)(q, kv, pos, table, 1e-6, cache, slots, fmt)
        c2 = fmt.new_cache(3).fill_(POISON)
        impl(api.KV_INSERT, backend)(c2, slots, kv, fmt)
        outs[backend] = (
            q_out,
            cache,
            c2,
            impl(INV_ROPE_FP8_QUANT, backend)(q, pos, table),
            impl(QKV_RMS_NORM, backend)(kv, kv[0], kv, kv[1], 1e-6),
            impl(api.ROPE, backend)(q, pos, table, True),
            impl(api.RMS_NORM, backend)(q, None, 1e-6),
        )
    ref, tri = outs["reference"], outs["triton"]
    torch.testing.assert_close(tri[0].double(), ref[0].double(), rtol=2**-7, atol=1e-5)
    assert torch.equal(tri[1], ref[1]) and torch.equal(tri[2], ref[2])
    assert torch.equal(tri[3][1], ref[3][1])
    assert (tri[3][0].view(torch.uint8).int() - ref[3][0].view(torch.uint8).int()).abs().max() <= 1
    for a, b in [
        (tri[4][0], ref[4][0]),
        (tri[4][1], ref[4][1]),
        (tri[5], ref[5]),
        (tri[6], ref[6]),
    ]:
        torch.testing.assert_close(a.double(), b.double(), rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(
    "triton" not in cpu_backends(QNORM_ROPE_KV_INSERT), reason="triton not runnable"
)
@pytest.mark.parametrize("fmt_name", ["fp8", "bf16"])
def test_triton_qnorm_separate_launches_equal_fused(monkeypatch, fmt_name, table, gen):
    """From SEPARATE_FROM_TOKENS tokens the query rows and the KV rows are two launches: the same
    bits as the one fused launch (which the oracle test above checks), with a -1 slot left alone."""
    from vllm_dsv4_hw.ops.triton import fused_prologue as fused_qkv

    t, h, e = len(POSITIONS), 3, 8
    fmt = make_format(fmt_name, "main", e)
    q, kv = _rows(gen, (t, h, D), torch.bfloat16), _rows(gen, (t, D), torch.bfloat16)
    slots = torch.randperm(3 * e, generator=gen)[:t]
    slots[2] = -1
    pos = torch.tensor(POSITIONS)
    got = {}
    for separate in (10**9, 1):
        monkeypatch.setattr(fused_qkv, "SEPARATE_FROM_TOKENS", separate)
        cache = fmt.new_cache(3).fill_(POISON)
        got[separate] = (
            impl(QNORM_ROPE_KV_INSERT, "triton")(q, kv, pos, table, 1e-6, cache, slots, fmt),
            cache,
        )
    assert torch.equal(got[1][0], got[10**9][0]) and torch.equal(got[1][1], got[10**9][1])
    assert (got[1][1] == POISON).any()  # the skipped slot and the spare pages kept their bytes
