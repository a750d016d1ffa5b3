# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of the mHC ops (``hc_pre``, ``hc_seam``, ``hc_post``): 4 streams of the
dims' hidden size in bf16, fp32 mixes, 20 Sinkhorn iterations.

Same conventions as :mod:`vllm_dsv4_hw.conformance.cases`: the oracle is the reference
implementation on float64 copies of the inputs. The backends round the new streams and the
sub-block input to bf16 where the float64 oracle does not, so the bound is bf16's.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import EPS, Case, Ctx, _same, _verdict
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import mhc as ref_mhc

HC, ITERS, HC_EPS = 4, 20, 1e-6


def _params(ctx: Ctx):
    d = ctx.dims.hidden
    n_mix = (2 + HC) * HC
    g = ctx.gen
    f32 = lambda t: t.to(torch.float32).to(ctx.device)
    fn = f32(torch.randn(n_mix, HC * d, generator=g) / (HC * d) ** 0.5)
    scale = f32(torch.rand(3, generator=g) + 0.5)
    base = f32(torch.randn(n_mix, generator=g))
    w = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).to(ctx.device)
    return fn, scale, base, w


def _check_all(want: tuple, shapes: tuple):
    def check(res, args):
        res = res if isinstance(res, tuple) else (res,)
        worst = 0.0
        for got, w, (shape, dtype) in zip(res, want, shapes):
            bad = _same(got, shape, dtype)
            if bad:
                return False, bad, float("inf")
            worst = max(worst, ratio(got.to(w.device), w, dense_bound(w, torch.bfloat16, 2**-7)))
        return _verdict(worst)

    return check


def hc_cases(ctx: Ctx) -> list[Case]:
    t, d = ctx.dims.tokens, ctx.dims.hidden
    fn, scale, base, w = _params(ctx)
    h = ctx.rows(t * HC, d, lo=-2, hi=2).reshape(t, HC, d)
    y = ctx.rows(t, d, lo=-2, hi=2)
    post = (torch.rand(t, HC, generator=ctx.gen) * 2).to(ctx.device)
    comb = torch.rand(t, HC, HC, generator=ctx.gen).to(ctx.device)
    o = ctx.to_oracle
    bf, f32 = torch.bfloat16, torch.float32
    mix_shapes = (((t, d), bf), ((t, HC), f32), ((t, HC, HC), f32))
    pre_args = (h, fn, scale, base, w, ITERS, HC_EPS, EPS)
    seam_args = (y, h, post, comb, fn, scale, base, w, ITERS, HC_EPS, EPS)
    want_pre = ref_mhc.hc_pre(*(o(a) for a in pre_args))
    want_seam = ref_mhc.hc_seam(*(o(a) for a in seam_args))
    want_post = ref_mhc.hc_post(o(y), o(h), o(post), o(comb))
    name = f"bf16 streams [{t}, {HC}, {d}]"
    return [
        Case(api.HC_PRE, name, pre_args, _check_all(want_pre, mix_shapes)),
        Case(api.HC_SEAM, name, seam_args, _check_all(want_seam, (((t, HC, d), bf),) + mix_shapes)),
        Case(api.HC_POST, name, (y, h, post, comb), _check_all((want_post,), (((t, HC, d), bf),))),
    ]
