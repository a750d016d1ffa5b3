# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of the ops on weights as the checkpoint ships them (``ops.api`` issue 12):
``fp8_block_linear`` on e4m3 weights with ue8m0 block scales, ``dense_linear`` on the bf16 ones.

Same conventions as :mod:`vllm_dsv4_hw.conformance.cases` (fresh random inputs on the device under
test, a float64 oracle, one check per case). Weights are random N(0, 1/K) matrices quantized with
the checkpoint's recipe (``quant.formats.quantize_fp8_block``, on the CPU), handed over as the
checkpoint's dtypes where the device declares fp8 and as raw uint8 bytes elsewhere (the contract
takes both); two more cases put every scale at one end of the ue8m0 range. The oracle is the op's
formula in float64, one K block at a time (never a whole dequantized weight).
"""

from __future__ import annotations

import math

import torch

from vllm_dsv4_hw.conformance.cases import Case, Ctx, _same, _verdict
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.quant.formats import quantize_fp8_block

V4_BLOCK = (128, 128)  # DeepSeek V4 weight_block_size
V41_BLOCK = (32, 32)  # V4.1


def fp8_block_linear_oracle(
    x: torch.Tensor, wb: torch.Tensor, sb: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``y = sum_kb s[n // bn, kb] * (x[:, kb] @ e4m3(w[:, kb])^T)`` in float64 on x's device.

    x [M, K] or [M, G, K] (any float dtype); wb [(G,) N, K] e4m3 bytes (uint8); sb [(G,) NB, KB]
    ue8m0 bytes. Each product of an e4m3 value, a bf16 activation and a power-of-two scale is exact
    in float64."""
    bn, bk = block
    grouped = x.dim() == 3
    xs = x.double() if grouped else x.double()[:, None]
    wb = wb if grouped else wb[None]
    sb = sb if grouped else sb[None]
    m, g, k = xs.shape
    n = wb.shape[1]
    e = sb.to(torch.int64) - 127
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)  # [G, NB, KB], exact
    y = torch.zeros(m, g, n, dtype=torch.float64, device=x.device)
    for kb in range(s.shape[2]):
        ks = slice(kb * bk, min(k, (kb + 1) * bk))
        w = wb[:, :, ks].view(torch.float8_e4m3fn).double()  # [G, N, bk]
        col_s = s[:, :, kb].repeat_interleave(bn, dim=1)[:, :n]  # [G, N]
        y += torch.einsum("mgk,gnk->mgn", xs[:, :, ks], w) * col_s[None]
    return y if grouped else y[:, 0]


def e4m3_activation_values(x: torch.Tensor, bk: int) -> torch.Tensor:
    """x's values under ``quantize_x`` (the checkpoints' dynamic activation scheme) in float64:
    per row and ``bk`` block of K, x (as fp32) over the scale 2^ceil(log2(max(amax, 1e-4) / 448))
    rounded to nearest even on the e4m3 grid (spacing 2^-9 below 2^-6), times the scale."""
    xf = x.float().double()
    out = torch.empty_like(xf)
    floor = float(torch.tensor(1e-4, dtype=torch.float32))
    for j in range(0, xf.shape[-1], bk):
        blk = xf[..., j : j + bk]
        scale = torch.exp2(
            torch.ceil(torch.log2(blk.abs().amax(-1, keepdim=True).clamp_min(floor) / 448.0))
        )
        v = blk / scale
        step = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))) - 3)
        out[..., j : j + bk] = (torch.round(v.abs() / step) * step).clamp_max(448.0).copysign(
            v
        ) * scale
    return out


def _weight(
    ctx: Ctx,
    lead: tuple[int, ...],
    n: int,
    k: int,
    block: tuple[int, int],
    scale_bytes: tuple[int, int] | None = None,
):
    """(e4m3 bytes, ue8m0 bytes) on the CPU: a quantized N(0, 1/K) weight, or (``scale_bytes``
    = (lo, hi)) random finite e4m3 codes with scale bytes drawn from [lo, hi]."""
    if scale_bytes is None:
        if block[0] != block[1]:
            raise ValueError(f"quantize_fp8_block takes square blocks, got {block}")
        w = torch.randn(*lead, n, k, generator=ctx.gen) * k**-0.5
        qs = [quantize_fp8_block(wi, block[0]) for wi in w.reshape(-1, n, k)]
        wb = torch.stack([q.view(torch.uint8) for q, _ in qs]).reshape(*lead, n, k)
        sb = torch.stack([s.view(torch.uint8) for _, s in qs]).reshape(*lead, *qs[0][1].shape)
        return wb, sb
    wb = torch.randint(0, 256, (*lead, n, k), generator=ctx.gen, dtype=torch.uint8)
    wb[(wb & 0x7F) == 0x7F] = 0  # no NaN codes
    lo, hi = scale_bytes
    sb = torch.randint(
        lo,
        hi + 1,
        (*lead, -(-n // block[0]), -(-k // block[1])),
        generator=ctx.gen,
        dtype=torch.uint8,
    )
    return wb, sb


def fp8_block_linear_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    qk = d.heads * d.head_dim
    go_k = (d.heads // d.o_groups) * d.head_dim
    prefill = 3 * 64 + 5  # more than one 64-row tile, not a multiple of it
    specs = [  # name, tokens, groups (None = plain), N, K, block, scale bytes, x magnitude
        (
            f"wq_a [{d.tokens}, {d.hidden}] -> {d.q_lora}",
            d.tokens,
            None,
            d.q_lora,
            d.hidden,
            V4_BLOCK,
            None,
            1.0,
        ),
        (
            f"wq_b [{d.tokens}, {d.q_lora}] -> {qk}",
            d.tokens,
            None,
            qk,
            d.q_lora,
            V4_BLOCK,
            None,
            1.0,
        ),
        (
            f"wo_a grouped {d.o_groups} x [{d.tokens}, {go_k}] -> {d.o_lora}",
            d.tokens,
            d.o_groups,
            d.o_lora,
            go_k,
            V4_BLOCK,
            None,
            1.0,
        ),
        (
            f"wq_b [{d.tokens}, {d.q_lora}] -> {qk}",
            d.tokens,
            None,
            qk,
            d.q_lora,
            V41_BLOCK,
            None,
            1.0,
        ),
        (
            f"wo_a grouped {d.o_groups} x [{d.tokens}, {go_k}] -> {d.o_lora}",
            d.tokens,
            d.o_groups,
            d.o_lora,
            go_k,
            V41_BLOCK,
            None,
            1.0,
        ),
        (
            f"prefill wq_a [{prefill}, {d.hidden}] -> {d.q_lora}",
            prefill,
            None,
            d.q_lora,
            d.hidden,
            V4_BLOCK,
            None,
            1.0,
        ),
        # both ends of the ue8m0 range: scales 2^-127 .. 2^-124 (byte 0 is the fp32 subnormal
        # 2^-127), and 2^124 .. 2^127 (e4m3 * 2^127 overflows fp32) with x ~ 2^-100
        (
            f"ue8m0 bytes 0..3, [{d.tokens}, {d.hidden}] -> {d.q_lora}",
            d.tokens,
            None,
            d.q_lora,
            d.hidden,
            V4_BLOCK,
            (0, 3),
            1.0,
        ),
        (
            f"ue8m0 bytes 251..254, [{d.tokens}, {d.hidden}] -> {d.q_lora}",
            d.tokens,
            None,
            d.q_lora,
            d.hidden,
            V41_BLOCK,
            (251, 254),
            2.0**-100,
        ),
    ]
    # e4m3 activations (``quantize_x``, W8A8): decode, grouped, V4.1 blocks, a prefill chunk
    specs += [
        (f"e4m3 x: {spec[0]}",) + spec[1:] + (True,)
        for i, spec in enumerate(specs)
        if i in (0, 2, 3, 5)
    ]
    # x given as its e4m3 codes and scales (``x_scales``, as ``inv_rope_fp8_quant`` hands wo_a)
    specs += [
        (f"e4m3 codes in: {spec[0]}",) + spec[1:] + ("codes",)
        for i, spec in enumerate(specs)
        if i in (0, 2)
    ]
    out = []
    for name, m, g, n, k, block, sbytes, xmag, *qx in specs:
        codes_in = bool(qx) and qx[0] == "codes"
        quantize_x = bool(qx and qx[0]) and not codes_in
        lead = (g,) if g else ()
        wb, sb = _weight(ctx, lead, n, k, block, sbytes)
        x = torch.randn(*((m, g, k) if g else (m, k)), generator=ctx.gen) * xmag
        x = x.to(torch.bfloat16).to(ctx.device)
        xo = x.to(ctx.oracle_device)
        want = fp8_block_linear_oracle(
            e4m3_activation_values(xo, block[1]) if quantize_x or codes_in else xo,
            wb.to(ctx.oracle_device),
            sb.to(ctx.oracle_device),
            block,
        )
        w_dev, s_dev = wb.to(ctx.device), sb.to(ctx.device)
        if ctx.caps.fp8:  # the checkpoint's own dtypes; raw bytes where the device has no fp8
            w_dev, s_dev = w_dev.view(torch.float8_e4m3fn), s_dev.view(torch.float8_e8m0fnu)

        def check(res, args, want=want):
            bad = _same(res, want.shape, torch.bfloat16)
            if bad:
                return False, bad, float("inf")
            # compared after an exact power-of-two normalization to max |want| ~ 1 (dense_bound's
            # absolute floor would otherwise swallow the ~2^-113 results of the 2^-127 scales);
            # fp32 accumulation of exact products, one bf16 rounding of the result
            top = float(want.abs().max()) if want.numel() else 0.0
            p = 2.0 ** -math.floor(math.log2(top)) if top > 0 else 1.0
            w = want * p
            return _verdict(
                ratio(res.to(want.device).double() * p, w, dense_bound(w, torch.bfloat16))
            )

        args = (x, w_dev, s_dev, block) + ((None, True) if quantize_x else ())
        if codes_in:
            codes, scales = _e4m3_codes(e4m3_activation_values(x.cpu(), block[1]), block[1])
            codes = codes.to(ctx.device)
            args = (
                (codes if ctx.caps.fp8 else codes.view(torch.uint8)),
                w_dev,
                s_dev,
                block,
                None,
                False,
                scales.to(ctx.device),
            )
        out.append(
            Case(api.FP8_BLOCK_LINEAR, f"{name}, block {block[0]}x{block[1]}, bf16", args, check)
        )
    return out


def _e4m3_codes(vals: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized activation values [..., K] (e4m3 values times a power of two per ``bk`` block)
    -> (their e4m3 codes, fp32 scales [..., ceil(K/bk)]) with the rule's scale,
    2^ceil(log2(max(amax, 1e-4) / 448)): codes = values / scale, exact."""
    k = vals.shape[-1]
    kb = -(-k // bk)
    pad = torch.zeros(*vals.shape[:-1], kb * bk, dtype=torch.float64)
    pad[..., :k] = vals
    amax = pad.view(*vals.shape[:-1], kb, bk).abs().amax(-1).clamp_min(1e-4)
    scales = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    codes = vals / scales.repeat_interleave(bk, -1)[..., :k]
    return codes.to(torch.float8_e4m3fn), scales.float()


def dense_linear_cases(ctx: Ctx) -> list[Case]:
    """``dense_linear`` at the shapes of the projections the checkpoints ship in bf16: the main
    compressors' merged ``wkv | wgate`` (c4a: 4 x 512 columns, c128a: 2 x 512) and the indexer's
    (4 x 128) with fp32 outputs, the indexer's ``weights_proj`` in bf16, a prefill-sized call and
    a K that is no multiple of 128."""
    d = ctx.dims
    prefill = 3 * 64 + 5
    specs = [  # name, M, N, K, out dtype
        (
            f"c4a compressor wkv|wgate [{d.tokens}, {d.hidden}] -> {4 * d.head_dim}",
            d.tokens,
            4 * d.head_dim,
            d.hidden,
            torch.float32,
        ),
        (
            f"c128a compressor wkv|wgate [{d.tokens}, {d.hidden}] -> {2 * d.head_dim}",
            d.tokens,
            2 * d.head_dim,
            d.hidden,
            torch.float32,
        ),
        (
            f"indexer compressor [{d.tokens}, {d.hidden}] -> {4 * d.index_dim}",
            d.tokens,
            4 * d.index_dim,
            d.hidden,
            torch.float32,
        ),
        (
            f"weights_proj [{d.tokens}, {d.hidden}] -> {d.index_heads}",
            d.tokens,
            d.index_heads,
            d.hidden,
            torch.bfloat16,
        ),
        (
            f"prefill [{prefill}, {d.hidden}] -> {d.index_heads}",
            prefill,
            d.index_heads,
            d.hidden,
            torch.bfloat16,
        ),
        (f"K tail [{d.tokens}, {d.hidden + 72}] -> 96", d.tokens, 96, d.hidden + 72, torch.float32),
    ]
    out = []
    for name, m, n, k, odt in specs:
        x = torch.randn(m, k, generator=ctx.gen).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=ctx.gen) / math.sqrt(k)).to(torch.bfloat16)
        want = x.to(ctx.oracle_device).double() @ w.to(ctx.oracle_device).double().t()

        def check(res, args, want=want, odt=odt):
            bad = _same(res, want.shape, odt)
            if bad:
                return False, bad, float("inf")
            tol = dense_bound(want, odt, atol_rel=1e-4 if odt == torch.float32 else 1e-3)
            return _verdict(ratio(res.to(want.device).double(), want, tol))

        out.append(
            Case(
                api.DENSE_LINEAR,
                f"{name}, {str(odt).split('.')[-1]} out",
                (x.to(ctx.device), w.to(ctx.device), odt),
                check,
            )
        )
    return out
