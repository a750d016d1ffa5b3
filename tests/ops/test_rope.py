# SPDX-License-Identifier: Apache-2.0
"""RoPE: the YaRN/plain frequency tables and the GPT-J rotation, against float64 oracles."""

import math
from types import SimpleNamespace

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import rope_oracle, yarn_inv_freq_oracle
from vllm_dsv4_hw.config import V4_FLASH, V4_PRO, YarnParams
from vllm_dsv4_hw.ops.api import ROPE
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin, rope_inv_freq, rope_tables_for

YARN = YarnParams()  # factor 16, original 65536, beta_fast 32, beta_slow 1
FAR_POSITIONS = [
    0,
    1,
    2,
    3,
    127,
    128,
    65535,
    65536,
    65537,
    999_999,
    1_000_000,
    1_000_001,
    1_048_574,
    1_048_575,
]


@pytest.fixture(scope="module")
def full_yarn_table():
    # The real c4a/c128a table up to max_position_embeddings (built once: ~2 s).
    return rope_cos_sin(160000.0, 64, 1_048_576, YARN)


# -- frequency tables ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "theta,dim,yarn",
    [
        (10000.0, 64, None),
        (160000.0, 64, YARN),
        (10000.0, 64, YARN),
        (160000.0, 16, YARN),
        (
            500000.0,
            128,
            YarnParams(
                factor=4.0, original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0
            ),
        ),
        (
            10000.0,
            8,
            YarnParams(
                factor=8.0, original_max_position_embeddings=4096, beta_fast=2.0, beta_slow=1.9
            ),
        ),  # low == high: the +0.001 branch
    ],
)
def test_inv_freq_matches_formula(theta, dim, yarn):
    got = rope_inv_freq(theta, dim, yarn)
    assert got.dtype == torch.float64 and got.shape == (dim // 2,)
    if yarn is None:
        ref = yarn_inv_freq_oracle(theta, dim)
    else:
        ref = yarn_inv_freq_oracle(
            theta,
            dim,
            yarn.factor,
            yarn.original_max_position_embeddings,
            yarn.beta_fast,
            yarn.beta_slow,
        )
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-13, atol=0)


def test_yarn_table_structure_real_params():
    # theta 160000, R 64, L 65536: low = floor(15.45) = 15, high = ceil(24.71) = 25.
    plain = rope_inv_freq(160000.0, 64, None)
    yarn = rope_inv_freq(160000.0, 64, YARN)
    torch.testing.assert_close(yarn[:16], plain[:16], rtol=0, atol=0)  # ramp 0 up to j = low
    torch.testing.assert_close(yarn[25:], plain[25:] / 16, rtol=1e-15, atol=0)  # fully scaled
    mid = yarn[16:25] / plain[16:25]
    assert torch.all(mid < 1) and torch.all(mid > 1 / 16)
    assert torch.all(mid[1:] < mid[:-1])  # monotone interpolation between the two regimes


def test_yarn_inv_freq_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    cfg = SimpleNamespace(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.0,
            "partial_rotary_factor": 64 / 512,
        },
        head_dim=512,
        hidden_size=4096,
        num_attention_heads=64,
        max_position_embeddings=1048576,
        standardize_rope_params=lambda: None,
    )
    inv, attention_factor = rope_utils._compute_yarn_parameters(cfg, "cpu")
    assert attention_factor == 1.0  # no mscale
    torch.testing.assert_close(rope_inv_freq(160000.0, 64, YARN), inv.double(), rtol=1e-6, atol=0)


def test_cos_sin_table_near_zero_and_far(full_yarn_table):
    inv = torch.tensor(
        yarn_inv_freq_oracle(160000.0, 64, 16.0, 65536, 32.0, 1.0), dtype=torch.float64
    )
    assert full_yarn_table.shape == (1_048_576, 64) and full_yarn_table.dtype == torch.float32
    rows = full_yarn_table[FAR_POSITIONS].double()
    ang = torch.tensor(FAR_POSITIONS, dtype=torch.float64)[:, None] * inv[None, :]
    # float64 angles then one fp32 rounding: error ~6e-8 even at p ~ 2^20 (fp32 angles: ~3e-2).
    torch.testing.assert_close(rows[:, :32], torch.cos(ang), rtol=0, atol=2e-7)
    torch.testing.assert_close(rows[:, 32:], torch.sin(ang), rtol=0, atol=2e-7)


def test_cos_sin_plain_table_and_device_arg():
    tab = rope_cos_sin(10000.0, 64, 300, None, device="cpu")
    p = torch.arange(300, dtype=torch.float64)[:, None]
    inv = torch.tensor(yarn_inv_freq_oracle(10000.0, 64), dtype=torch.float64)
    torch.testing.assert_close(
        tab.double(), torch.cat([torch.cos(p * inv), torch.sin(p * inv)], -1), rtol=0, atol=2e-7
    )
    assert torch.equal(tab[0], torch.cat([torch.ones(32), torch.zeros(32)]))


@pytest.mark.parametrize("cfg", [V4_FLASH, V4_PRO])
def test_rope_tables_for_layer_kinds(cfg):
    n = 1000
    t0 = rope_tables_for(cfg, 0, n)
    t4 = rope_tables_for(cfg, 4, n)
    t128 = rope_tables_for(cfg, 128, n)
    assert torch.equal(t0, rope_cos_sin(10000.0, 64, n))
    assert torch.equal(t4, rope_cos_sin(160000.0, 64, n, YARN))
    assert torch.equal(t128, t4)
    assert not torch.allclose(t0, t4)
    with pytest.raises(ValueError):
        rope_tables_for(cfg, 2, n)


# -- the rotation -------------------------------------------------------------------------------
def _table_and_freqs(theta, r, n, yarn):
    return rope_cos_sin(theta, r, n, yarn), rope_inv_freq(theta, r, yarn)


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
@pytest.mark.parametrize(
    "shape,r",
    [
        ((5, 8), 4),
        ((3, 2, 16), 8),
        ((7, 512), 64),
        ((6, 4, 512), 64),
        ((2, 3, 128), 64),
        ((4, 64), 64),
    ],
)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_complex_oracle(backend, shape, r, inverse, gen):
    tab, inv = _table_and_freqs(160000.0, r, 4096, YARN)
    x = torch.randn(shape, generator=gen)
    pos = torch.randint(0, 4096, (shape[0],), generator=gen)
    out = impl(ROPE, backend)(x, pos, tab, inverse)
    ref = rope_oracle(x, pos, inv, inverse)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    # Dims before the last R are bit-identical.
    assert torch.equal(out[..., : shape[-1] - r], x[..., : shape[-1] - r])


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
def test_rope_far_positions(backend, full_yarn_table, gen):
    x = torch.randn(len(FAR_POSITIONS), 4, 512, generator=gen)
    pos = torch.tensor(FAR_POSITIONS)
    out = impl(ROPE, backend)(x, pos, full_yarn_table)
    ref = rope_oracle(x, pos, rope_inv_freq(160000.0, 64, YARN))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-6)


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
def test_rope_pair_convention_is_gptj(backend):
    # e_{2j} at position p -> (cos, sin) in dims (2j, 2j+1): interleaved pairs, not halves.
    r, p, j = 8, 3, 1
    tab, inv = _table_and_freqs(10000.0, r, 8, None)
    x = torch.zeros(1, 12, dtype=torch.float64)
    x[0, 4 + 2 * j] = 1.0
    out = impl(ROPE, backend)(x, torch.tensor([p]), tab)
    expect = torch.zeros(1, 12, dtype=torch.float64)
    expect[0, 4 + 2 * j] = math.cos(p * float(inv[j]))
    expect[0, 4 + 2 * j + 1] = math.sin(p * float(inv[j]))
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_inverse_undoes_rope(backend, dtype, full_yarn_table, gen):
    x = torch.randn(len(FAR_POSITIONS), 3, 512, generator=gen).to(dtype)
    pos = torch.tensor(FAR_POSITIONS)
    f = impl(ROPE, backend)
    back = f(f(x, pos, full_yarn_table), pos, full_yarn_table, inverse=True)
    assert back.dtype == dtype
    tol = {torch.float32: 2e-6, torch.float64: 1e-6, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(back.double(), x.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
def test_rope_bf16_matches_oracle(backend, gen):
    tab, inv = _table_and_freqs(10000.0, 64, 2048, None)
    x = torch.randn(9, 4, 512, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 2048, (9,), generator=gen)
    out = impl(ROPE, backend)(x, pos, tab)
    ref = rope_oracle(x, pos, inv)  # exact rotation of the same bf16 values
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
def test_rope_scores_depend_on_relative_position(backend, full_yarn_table, gen):
    # <R(p) q, R(s) k> is a function of p - s only, for YaRN tables too, at any offset.
    q = torch.randn(1, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 64, generator=gen, dtype=torch.float64)
    f = impl(ROPE, backend)
    tab = full_yarn_table.double()

    def score(p, s):
        return float((f(q, torch.tensor([p]), tab) * f(k, torch.tensor([s]), tab)).sum())

    for delta in (0, 5, 300):
        base = score(10 + delta, 10)
        for off in (65536, 1_000_000):
            assert abs(score(off + delta, off) - base) < 2e-5 * (q.norm() * k.norm())


@pytest.mark.parametrize("backend", cpu_backends(ROPE))
def test_rope_empty_batch(backend):
    tab = rope_cos_sin(10000.0, 64, 16)
    out = impl(ROPE, backend)(torch.zeros(0, 2, 512), torch.zeros(0, dtype=torch.long), tab)
    assert out.shape == (0, 2, 512)
