# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of ``moe_experts`` (routed experts with the FP4 weights as shipped).

Weights: random fp32 experts quantized by ``quant.formats.quantize_fp4_experts`` (the checkpoint's
own format: uint8 codes, float8_e8m0fnu scales, as the loader keeps them), at the kit's hidden size
with an intermediate size of ``min(hidden, 2048)`` and a handful of experts. The oracle is a float64
formula written here (per expert: codes decoded with unit scales, the ue8m0 scales applied in
float64, so bytes 0 and 254 are exact). Cases: realistic scales; the two ends of the ue8m0 range
(w13's up rows at 2^-127.., w2 at ..2^127 with x ~ N(0,1); and the mirror, x ~ 2^-120), picked so
h, the activation and the output stay representable in fp32.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import Case, Ctx, _same, _verdict
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.numerics import FP4_BLOCK
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.quant.formats import dequantize_fp4_experts, quantize_fp4_experts

N_EXPERTS = 6
TOP_K = 4
LIMIT = 10.0  # V4's swiglu_limit


def _fp4_f64(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K/2] codes + [N, K/32] ue8m0 bytes -> float64 [N, K], exact at every byte."""
    raw = scale.view(torch.uint8)
    vals = dequantize_fp4_experts(packed, torch.full_like(raw, 127)).double()
    return vals * torch.exp2(raw.double() - 127).repeat_interleave(FP4_BLOCK, dim=1)


def _oracle(x, tw, ids, w13, s13, w2, s2, limit) -> torch.Tensor:
    """``sum_j tw[t, j] * w2_e swiglu(w13_e x[t])`` in float64 (activation rounded to x's dtype),
    one expert dequantized at a time."""
    xd = x.double()
    inter = w2.shape[2] * 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xd[tok] @ _fp4_f64(w13[e], s13[e]).t()
        g = h[:, :inter].clamp(max=limit)
        u = h[:, inter:].clamp(-limit, limit)
        a = (g * torch.sigmoid(g) * u).to(x.dtype).double()
        y = a @ _fp4_f64(w2[e], s2[e]).t()
        out.index_add_(0, tok, y * tw[tok, slot].double()[:, None])
    return out


def _quantized_experts(ctx: Ctx, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E random experts [rows, cols] ~ N(0, 1/cols), quantized one at a time (CPU)."""
    q, s = zip(
        *(
            quantize_fp4_experts(torch.randn(rows, cols, generator=ctx.gen) * cols**-0.5)
            for _ in range(N_EXPERTS)
        )
    )
    return torch.stack(q).view(torch.uint8), torch.stack(s).view(torch.uint8)


def _bytes(ctx: Ctx, lo: int, hi: int, shape) -> torch.Tensor:
    return torch.randint(lo, hi + 1, tuple(shape), generator=ctx.gen, dtype=torch.uint8)


def moe_experts_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    t, hidden = d.tokens, d.hidden
    inter = min(hidden, 2048)
    w13, s13 = _quantized_experts(ctx, 2 * inter, hidden)
    w2, s2 = _quantized_experts(ctx, hidden, inter)
    # routing: distinct experts per token, expert 0 never chosen, one slot held elsewhere (-1),
    # token 0 routed nowhere (its output must be exactly zero)
    ids = torch.stack(
        [1 + torch.randperm(N_EXPERTS - 1, generator=ctx.gen)[:TOP_K] for _ in range(t)]
    )
    ids[-1, 1] = -1
    ids[0] = -1
    tw = torch.rand(t, TOP_K, generator=ctx.gen) + 0.1
    x = torch.randn(t, hidden, generator=ctx.gen)

    # the ends of the ue8m0 range, on the quantized codes
    s13_low, s2_high = s13.clone(), _bytes(ctx, 251, 254, s2.shape)
    s13_low[:, inter:] = _bytes(ctx, 0, 3, s13_low[:, inter:].shape)  # up rows ~2^-125
    s13_high, s2_low = _bytes(ctx, 251, 254, s13.shape), _bytes(ctx, 0, 3, s2.shape)

    out = []
    for label, xs, ws13, ws2 in (
        ("scales as quantized", x, s13, s2),
        ("ue8m0 ends: w13 up rows 2^-127.., w2 ..2^127, x ~ N(0,1)", x, s13_low, s2_high),
        ("ue8m0 ends: w13 ..2^127, w2 2^-127.., x ~ 2^-120", x * 2.0**-120, s13_high, s2_low),
    ):
        xb = xs.to(torch.bfloat16)
        od = ctx.oracle_device
        want = _oracle(
            xb.to(od), tw.to(od), ids.to(od), w13.to(od), ws13.to(od), w2.to(od), ws2.to(od), LIMIT
        )
        dev = ctx.device
        args = (
            xb.to(dev),
            tw.to(dev),
            ids.to(dev),
            w13.to(dev),
            ws13.to(dev).view(torch.float8_e8m0fnu),
            w2.to(dev),
            ws2.to(dev).view(torch.float8_e8m0fnu),
            LIMIT,
        )

        def check(res, args, want=want):
            bad = _same(res, (t, hidden), torch.float32)
            if bad:
                return False, bad, float("inf")
            res = res.to(want.device)
            if not torch.equal(res[0], torch.zeros_like(res[0])):
                return False, "a token whose slots are all -1 got a nonzero output", float("inf")
            # the activation is rounded to bf16: a few elements may land on the neighbouring value
            return _verdict(ratio(res, want, dense_bound(want, torch.bfloat16, 2**-9)))

        out.append(
            Case(
                api.MOE_EXPERTS,
                f"FP4 bf16 T {t}, D {hidden}, I {inter}, E {N_EXPERTS}, "
                f"top-{TOP_K}, limit {LIMIT:g}: {label}",
                args,
                check,
            )
        )
    return out


ROUTER_EXPERTS = 64


def moe_route_cases(ctx: Ctx) -> list[Case]:
    """The router at the kit's hidden size over 64 experts, top-6: top-k with a bias and hash rows.
    Ids must equal the float64 reference's (the draw keeps the 6th and 7th values apart);
    weights within fp32 rounding."""
    from vllm_dsv4_hw.ops.reference.moe import moe_route as ref_route

    t, d, e, k = ctx.dims.tokens, ctx.dims.hidden, ROUTER_EXPERTS, 6
    g = ctx.gen
    out = []
    for name, hashed in (("top-6 with bias", False), ("hash rows", True)):
        for _ in range(50):
            x = ctx.rows(t, d, lo=-1, hi=1)
            gate_w = (torch.randn(e, d, generator=g) / d**0.5).to(ctx.device)
            bias = (torch.randn(e, generator=g) * 0.1).to(ctx.device)
            s = torch.nn.functional.softplus(x.double() @ gate_w.double().T).sqrt() + bias.double()
            top = s.sort(dim=-1, descending=True).values
            if hashed or bool((top[:, k - 1] - top[:, k] > 1e-3).all()):
                break
        hash_ids = (
            torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(ctx.device)
            if hashed
            else None
        )
        args = (x, gate_w, None if hashed else bias, hash_ids, k, True, 2.5)
        want_w, want_ids = ref_route(*(ctx.to_oracle(a) for a in args))

        def check(res, args, want_w=want_w, want_ids=want_ids):
            w, ids = res
            bad = _same(w, want_w.shape, torch.float32) or _same(ids, want_ids.shape, torch.int64)
            if bad:
                return False, bad, float("inf")
            if not torch.equal(ids.cpu(), want_ids.cpu()):
                return False, "selected experts differ from the reference's", float("inf")
            return _verdict(ratio(w.to(want_w.device), want_w, dense_bound(want_w, torch.float32)))

        out.append(Case(api.MOE_ROUTE, f"{name} [{t}, {d}] x {e} experts", args, check))
    return out


def swiglu_cases(ctx: Ctx) -> list[Case]:
    """The shared expert's activation at the kit's tokens x the V4-Flash shared width (2048)."""
    from vllm_dsv4_hw.ops.reference.moe import swiglu as ref_swiglu

    t, inter = ctx.dims.tokens, 2048
    h = ctx.rows(t, 2 * inter, lo=-1, hi=4)
    want = ref_swiglu(ctx.to_oracle(h), LIMIT)

    def check(res, args):
        bad = _same(res, (t, inter), h.dtype)
        if bad:
            return False, bad, float("inf")
        return _verdict(ratio(res.to(want.device), want, dense_bound(want, h.dtype)))

    return [Case(api.SWIGLU, f"bf16 [{t}, {2 * inter}], clamp {LIMIT}", (h, LIMIT), check)]
