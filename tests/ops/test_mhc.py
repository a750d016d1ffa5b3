# SPDX-License-Identifier: Apache-2.0
"""mHC ops (``hc_pre``, ``hc_seam``, ``hc_post``) on every CPU backend against a float64 oracle
written per token with explicit loops (the reference's vectorised math is itself checked against
transformers' ``DeepseekV4HyperConnection`` in ``tests/model/test_network.py``).

The oracle rounds where the contract rounds (new streams and ``x`` to the stream dtype before the
norm), so the budget covers only summation order: a rounding that lands on the other side of a
bf16 half-ulp moves a value by one bf16 ulp. Shapes: no tokens, one, a few, past the fused limit of
the Triton backend (its reference path); 4 streams (the models) and 3 (a padded stream tile); D a
power of two and not; Sinkhorn with 1 and 20 iterations."""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.ops.api import HC_POST, HC_PRE, HC_SEAM

EPS = 1e-6
HC_EPS = 1e-6
# max |ours - oracle| / max |oracle| per stream dtype
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2**-7}


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def _oracle_mixes(h, fn, scale, base, iters):
    """Per token: (pre [hc], post [hc], comb [hc, hc]) in float64."""
    t, hc, d = h.shape
    out = []
    for i in range(t):
        z = h[i].double().flatten()
        inv = 1.0 / math.sqrt(float((z * z).sum()) / z.numel() + EPS)
        mix = [float((fn[m].double() * z).sum()) * inv for m in range(fn.shape[0])]
        sig = lambda v: 1.0 / (1.0 + math.exp(-v))
        pre = [sig(mix[j] * float(scale[0]) + float(base[j])) + HC_EPS for j in range(hc)]
        post = [2.0 * sig(mix[hc + j] * float(scale[1]) + float(base[hc + j])) for j in range(hc)]
        logit = [
            [
                mix[2 * hc + j * hc + k] * float(scale[2]) + float(base[2 * hc + j * hc + k])
                for k in range(hc)
            ]
            for j in range(hc)
        ]
        m = []
        for row in logit:
            top = max(row)
            e = [math.exp(v - top) for v in row]
            m.append([v / sum(e) + HC_EPS for v in e])
        steps = ["col"] + ["row", "col"] * (iters - 1)
        for step in steps:
            if step == "col":
                sums = [sum(m[j][k] for j in range(hc)) + HC_EPS for k in range(hc)]
                m = [[m[j][k] / sums[k] for k in range(hc)] for j in range(hc)]
            else:
                sums = [sum(m[j]) + HC_EPS for j in range(hc)]
                m = [[m[j][k] / sums[j] for k in range(hc)] for j in range(hc)]
        out.append(
            (
                torch.tensor(pre, dtype=torch.float64),
                torch.tensor(post, dtype=torch.float64),
                torch.tensor(m, dtype=torch.float64),
            )
        )
    return out


def _oracle_pre(h, fn, scale, base, w, iters):
    """(x_normed, post, comb) in float64, x rounded to h's dtype before its norm."""
    t, hc, d = h.shape
    xs, posts, combs = [], [], []
    for i, (pre, post, comb) in enumerate(_oracle_mixes(h, fn, scale, base, iters)):
        x = _round((pre[:, None] * h[i].double()).sum(0), h.dtype)
        x = x / math.sqrt(float((x * x).mean()) + EPS) * w.double()
        xs.append(x)
        posts.append(post)
        combs.append(comb)
    if t == 0:
        z = torch.zeros(0, dtype=torch.float64)
        return z.view(0, d), z.view(0, hc), z.view(0, hc, hc)
    return torch.stack(xs), torch.stack(posts), torch.stack(combs)


def _oracle_post(y, h, post, comb):
    y = _round(y, h.dtype)  # a wider y is rounded to the streams' dtype first
    out = post.double()[..., None] * y[:, None, :]
    out = out + torch.einsum("tjk,tjd->tkd", comb.double(), h.double())
    return _round(out, h.dtype)


def _inputs(gen, t, hc, d, dtype):
    n_mix = (2 + hc) * hc
    md = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    h = (r(t, hc, d) * 2).to(dtype)
    fn = (r(n_mix, hc * d) / math.sqrt(hc * d)).to(md)
    scale = (r(3).abs() + 0.5).to(md)
    base = r(n_mix).to(md)
    w = (r(d) * 0.5 + 1).to(dtype)
    return h, fn, scale, base, w


def _close(got, want, dtype, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.numel() == 0:
        return
    err = float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:.3g}"


SHAPES = [(0, 4, 64), (1, 4, 256), (3, 4, 96), (5, 3, 64), (70, 4, 64)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("backend", cpu_backends(HC_PRE))
@pytest.mark.parametrize("t,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("iters", [1, 20])
def test_hc_pre_matches_oracle(backend, t, hc, d, dtype, iters, gen):
    h, fn, scale, base, w = _inputs(gen, t, hc, d, dtype)
    x, post, comb = impl(HC_PRE, backend)(h, fn, scale, base, w, iters, HC_EPS, EPS)
    want = _oracle_pre(h, fn, scale, base, w, iters)
    assert x.dtype == dtype and post.dtype == comb.dtype == fn.dtype
    for got, ref, what in zip((x, post, comb), want, ("x", "post", "comb")):
        _close(got, ref, dtype if what == "x" else fn.dtype, what)
    if t and iters == 20:  # Sinkhorn ran: columns sum to 1, rows nearly so
        assert float((comb.double().sum(-2) - 1).abs().max()) < 1e-4


@pytest.mark.parametrize("backend", cpu_backends(HC_SEAM))
@pytest.mark.parametrize("t,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_seam_is_post_then_pre(backend, t, hc, d, dtype, gen):
    h, fn, scale, base, w = _inputs(gen, t, hc, d, dtype)
    md = fn.dtype
    y = (torch.randn(t, d, generator=gen, dtype=torch.float64) * 3).to(dtype)
    post = torch.rand(t, hc, generator=gen, dtype=torch.float64).to(md) * 2
    comb = torch.rand(t, hc, hc, generator=gen, dtype=torch.float64).to(md)
    h2, x, post2, comb2 = impl(HC_SEAM, backend)(
        y, h, post, comb, fn, scale, base, w, 20, HC_EPS, EPS
    )
    want_h2 = _oracle_post(y, h, post, comb)
    _close(h2, want_h2, dtype, "h2")
    # the pre runs on the seam's own rounded streams: the oracle takes them as given
    want = _oracle_pre(h2, fn, scale, base, w, 20)
    for got, ref, what in zip((x, post2, comb2), want, ("x", "post", "comb")):
        _close(got, ref, dtype if what == "x" else md, what)


@pytest.mark.parametrize("backend", cpu_backends(HC_POST))
@pytest.mark.parametrize("t,hc,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wide_y", [False, True])
def test_hc_post_matches_oracle(backend, t, hc, d, dtype, wide_y, gen):
    """``wide_y``: the sub-block output in fp32 (the MoE's sum) for streams of any dtype."""
    md = torch.float64 if dtype == torch.float64 else torch.float32
    h = (torch.randn(t, hc, d, generator=gen, dtype=torch.float64) * 2).to(dtype)
    y = (torch.randn(t, d, generator=gen, dtype=torch.float64) * 3).to(md if wide_y else dtype)
    post = torch.rand(t, hc, generator=gen, dtype=torch.float64).to(md) * 2
    comb = torch.rand(t, hc, hc, generator=gen, dtype=torch.float64).to(md)
    out = impl(HC_POST, backend)(y, h, post, comb)
    assert out.dtype == dtype
    _close(out, _oracle_post(y, h, post, comb), dtype, "streams")


@pytest.mark.parametrize("backend", cpu_backends(HC_PRE))
def test_bad_shapes_are_named(backend, gen):
    h, fn, scale, base, w = _inputs(gen, 2, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="fn is"):
        impl(HC_PRE, backend)(h, fn[:, :-1], scale, base, w, 20, HC_EPS, EPS)
    with pytest.raises(ValueError, match="norm_w"):
        impl(HC_PRE, backend)(h, fn, scale, base, w[:-1], 20, HC_EPS, EPS)
    with pytest.raises(ValueError, match="comb"):
        impl(HC_POST, backend)(h[:, 0], h, torch.ones(2, 4), torch.ones(2, 4, 3))


@pytest.mark.skipif("triton" not in cpu_backends(HC_SEAM), reason="no triton backend here")
@pytest.mark.parametrize("t,d", [(1, 1280), (3, 96), (9, 256)])
def test_triton_mixes_same_bits_in_the_partial_launch_or_their_own(t, d, gen, monkeypatch):
    """The mixes taken by each token's last partial program (arrival counters) or by a launch of
    their own (no counters: a stream first met under graph capture) give the same bits, and the
    counters are left zeroed for the next launch."""
    from vllm_dsv4_hw.ops.triton import mhc
    from vllm_dsv4_hw.ops.triton.common.counters import arrival_counters

    h, fn, scale, base, w = _inputs(gen, t, 4, d, torch.bfloat16)
    y = (torch.randn(t, d, generator=gen) * 3).to(torch.bfloat16)
    post = torch.rand(t, 4, generator=gen) * 2
    comb = torch.rand(t, 4, 4, generator=gen)
    args = (y, h, post, comb, fn, scale, base, w, 20, HC_EPS, EPS)
    ticket = impl(HC_SEAM, "triton")(*args)
    assert not arrival_counters(h.device, t).any()
    # d 1280: more partial rows (40) than the mixes add a step (MIX_ROWS 32): the oracle's values
    _close(ticket[0], _oracle_post(y, h, post, comb), torch.bfloat16, "h2")
    want = _oracle_pre(ticket[0], fn, scale, base, w, 20)
    for got, ref, what in zip(ticket[1:], want, ("x", "post", "comb")):
        _close(got, ref, torch.bfloat16 if what == "x" else fn.dtype, what)
    monkeypatch.setattr(mhc, "arrival_counters", lambda device, units: None)
    own = impl(HC_SEAM, "triton")(*args)
    for a, b, what in zip(ticket, own, ("h2", "x", "post", "comb")):
        assert torch.equal(a, b), what
