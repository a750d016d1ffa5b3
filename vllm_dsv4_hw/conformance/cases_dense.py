# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of the dense per-token ops: RMSNorm (weighted, weightless per head, and the
fused q / kv pair), RoPE (forward and inverse), the fused q-norm + RoPE + window-insert prologue,
and the epilogue op (inverse RoPE + fp8 quantization).

Same conventions as :mod:`vllm_dsv4_hw.conformance.cases`: the oracle is the reference
implementation on float64 copies of the inputs.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import (
    EPS,
    Case,
    Ctx,
    _same,
    _verdict,
    check_entries,
    poisoned_cache,
)
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import norm as ref_norm
from vllm_dsv4_hw.ops.reference import rope as ref_rope


# -- norms -----------------------------------------------------------------------------------------
def rms_norm_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    out = []
    for name, x, w in (
        (
            f"weighted bf16 [{d.tokens}, {d.q_lora}]",
            ctx.rows(d.tokens, d.q_lora, lo=-3, hi=3),
            (torch.rand(d.q_lora, generator=ctx.gen) * 2 - 0.5).to(torch.bfloat16).to(ctx.device),
        ),
        (
            f"per-head weightless fp32 [{d.tokens}, {d.heads}, {d.head_dim}]",
            ctx.rows(d.tokens * d.heads, d.head_dim, torch.float32).reshape(
                d.tokens, d.heads, d.head_dim
            ),
            None,
        ),
    ):
        want = ref_norm.rms_norm(ctx.to_oracle(x), ctx.to_oracle(w), EPS)

        def check(res, args, want=want, x=x):
            bad = _same(res, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
            return _verdict(ratio(res.to(want.device), want, dense_bound(want, x.dtype, 1e-4)))

        out.append(Case(api.RMS_NORM, name, (x, w, EPS), check))
    return out


def qkv_rms_norm_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    fused = ctx.rows(d.tokens, d.q_lora + d.head_dim, lo=-3, hi=3)
    q_r, kv = fused[:, : d.q_lora], fused[:, d.q_lora :]  # column slices of one projection
    q_w = (torch.rand(d.q_lora, generator=ctx.gen) + 0.5).to(torch.bfloat16).to(ctx.device)
    kv_w = (torch.rand(d.head_dim, generator=ctx.gen) + 0.5).to(torch.bfloat16).to(ctx.device)
    wq = ref_norm.rms_norm(ctx.to_oracle(q_r), ctx.to_oracle(q_w), EPS)
    wk = ref_norm.rms_norm(ctx.to_oracle(kv), ctx.to_oracle(kv_w), EPS)

    def check(res, args):
        if not isinstance(res, tuple) or len(res) != 2:
            return False, "expected a (q, kv) pair", float("inf")
        for r_, x in zip(res, (q_r, kv)):
            bad = _same(r_, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
        r = max(
            ratio(res[0].to(wq.device), wq, dense_bound(wq, torch.bfloat16, 1e-4)),
            ratio(res[1].to(wk.device), wk, dense_bound(wk, torch.bfloat16, 1e-4)),
        )
        return _verdict(r)

    return [
        Case(
            api.QKV_RMS_NORM,
            f"bf16 q_lora {d.q_lora} + kv {d.head_dim} (strided)",
            (q_r, q_w, kv, kv_w, EPS),
            check,
        )
    ]


# -- RoPE ------------------------------------------------------------------------------------------
def rope_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    pos = torch.tensor(d.positions, device=ctx.device)
    out = []
    for name, dtype, inverse in (
        ("forward bf16", torch.bfloat16, False),
        ("inverse fp32", torch.float32, True),
    ):
        x = ctx.rows(d.tokens * d.heads, d.head_dim, dtype, -2, 2).reshape(
            d.tokens, d.heads, d.head_dim
        )
        want = ref_rope.rope(
            ctx.to_oracle(x), pos.to(ctx.oracle_device), ctx.table.to(ctx.oracle_device), inverse
        )

        def check(res, args, x=x, want=want):
            bad = _same(res, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
            nope = d.head_dim - d.rope_dim
            if not torch.equal(res[..., :nope], x[..., :nope]):
                return False, "dims before the rotated part changed", float("inf")
            return _verdict(ratio(res.to(want.device), want, dense_bound(want, x.dtype, 1e-6)))

        out.append(
            Case(
                api.ROPE,
                f"{name} [{d.tokens}, {d.heads}, {d.head_dim}] YaRN",
                (x, pos, ctx.table, inverse),
                check,
            )
        )
    return out


# -- fused prologue / epilogue ---------------------------------------------------------------------
def qnorm_rope_kv_insert_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    t = d.tokens
    fmt = make_format(ctx.main_fmt, "main", 64)
    pages = max(2, t // 64 + 2)
    q = ctx.rows(t * d.heads, d.head_dim, lo=-4, hi=4).reshape(t, d.heads, d.head_dim)
    kv = ctx.rows(t, d.head_dim, lo=-6, hi=6)
    pos = torch.tensor(d.positions, device=ctx.device)
    slots = ctx.randperm(pages * 64)[:t]
    slots[0] = -1
    cache = poisoned_cache(fmt, pages, ctx.device)
    oq = ref_rope.rope(
        ref_norm.rms_norm(ctx.to_oracle(q), None, EPS),
        pos.to(ctx.oracle_device),
        ctx.table.to(ctx.oracle_device),
    )
    ok_ = ref_rope.rope(
        ctx.to_oracle(kv), pos.to(ctx.oracle_device), ctx.table.to(ctx.oracle_device)
    )

    def check(res, args):
        bad = _same(res, q.shape, q.dtype)
        if bad:
            return False, bad, float("inf")
        rq = ratio(res.to(oq.device), oq, dense_bound(oq, q.dtype, 1e-6))
        ok, detail, rc = check_entries(args[5], cache, fmt, slots, ok_, fmt.name)
        r = max(rq, rc)
        return (rq <= 1 and ok), f"q err/tol {rq:.3g}; window cache: {detail}", r

    return [
        Case(
            api.QNORM_ROPE_KV_INSERT,
            f"bf16 [{t}, {d.heads}, {d.head_dim}] -> {fmt.name} window",
            (q, kv, pos, ctx.table, EPS, cache, slots.to(ctx.device), fmt),
            check,
            mutable=(5,),
        )
    ]


def inv_rope_fp8_quant_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    o = ctx.rows(d.tokens * d.heads, d.head_dim, lo=-12, hi=8).reshape(
        d.tokens, d.heads, d.head_dim
    )
    pos = torch.tensor(d.positions, device=ctx.device)
    x = ref_rope.rope(
        ctx.to_oracle(o), pos.to(ctx.oracle_device), ctx.table.to(ctx.oracle_device), inverse=True
    ).cpu()

    def check(res, args):
        if not isinstance(res, tuple) or len(res) != 2:
            return False, "expected (o_fp8, scales)", float("inf")
        q, s = res
        g = api.O_QUANT_GROUP
        for bad in (
            _same(q, o.shape, torch.float8_e4m3fn),
            _same(s, (d.tokens, d.heads, d.head_dim // g), torch.float32),
        ):
            if bad:
                return False, bad, float("inf")
        s64, q64 = s.cpu().double(), q.cpu().double()
        if not torch.equal(torch.exp2(torch.log2(s64).round()), s64):
            return False, "scales are not powers of two", float("inf")
        amax = x.reshape(d.tokens, d.heads, -1, g).abs().amax(-1).clamp_min(api.O_QUANT_AMAX_FLOOR)
        if not (
            bool(torch.all(448 * s64 >= amax * (1 - 1e-6)))
            and bool(torch.all(448 * s64 < 2 * amax * (1 + 1e-6)))
        ):
            return False, "scale is not 2^ceil(log2(amax / 448))", float("inf")
        s_el = s64.repeat_interleave(g, -1)
        deq = q64 * s_el
        return _verdict(ratio(deq, x, x.abs() * (2**-4 + 1e-6) + s_el * 2**-10))

    return [
        Case(
            api.INV_ROPE_FP8_QUANT,
            f"bf16 [{d.tokens}, {d.heads}, {d.head_dim}]",
            (o, pos, ctx.table),
            check,
        )
    ]
