# SPDX-License-Identifier: Apache-2.0
"""The weights-as-shipped matmuls on the GPU: ``fp8_block_linear`` (FP8 128x128 block linears) and
``moe_experts`` (FP4 e2m1 routed experts), checked and timed at V4-Flash / V4-Pro dimensions.

    python -m benchmarks.gpu.weights            # check + bench on cuda, prints tables
    python -m benchmarks.gpu.weights --smoke    # tiny sizes on CPU (TRITON_INTERPRET=1)

``check``: the Triton op against the reference op (fp32 math over the same e4m3 / e2m1 bytes) on
fresh random weights, the FP8 linears with and without e4m3 activations (``quantize_x``): max
|diff| / max |ref| <= 2^-7 (bf16 outputs).

``bench``: CUDA-graph medians of the Triton op, of the unfused path it replaces (the weight
dequantized to bf16 on every call, then a bf16 matmul; per expert for the MoE), and the floor
max(weight bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s). For the MoE the bytes are those of the experts
the batch selects (every selected expert's packed codes and scales, read once).
"""

from __future__ import annotations

from benchmarks.gpu.table import prepare_smoke_env, run_cli

HBM_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
# (name, N, K, groups) per model: the FP8 linears of an attention layer and of the shared expert
LINEARS = {
    "v4-flash": (
        ("wq_a", 1024, 4096, 1),
        ("wq_b", 32768, 1024, 1),
        ("wkv", 512, 4096, 1),
        ("wo_a", 1024, 4096, 8),
        ("wo_b", 4096, 8192, 1),
        ("indexer.wq_b", 8192, 1024, 1),
        ("shared.w13", 4096, 4096, 1),
        ("shared.w2", 4096, 2048, 1),
    ),
    "v4-pro": (("wq_b", 65536, 1536, 1), ("wo_a", 1024, 8192, 16), ("wo_b", 7168, 16384, 1)),
}
EXPERTS = {"v4-flash": (256, 4096, 2048, 6), "v4-pro": (384, 7168, 3072, 6)}


def _fp8_weight(torch, n, k, g, device, gen):
    from vllm_dsv4_hw.quant.formats import quantize_fp8_block

    w8, s = [], []
    for _ in range(g):
        q, sc = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        w8.append(q)
        s.append(sc)
    if g == 1:
        return w8[0], s[0]
    return torch.stack(w8), torch.stack(s)


def _all_codes_weight(torch, n, k, device, gen):
    """An N x K e4m3 weight holding every finite code (0x7F / 0xFF are NaN) in shuffled order and
    random ue8m0 block scales 2^-24..2^4: the decode paths must agree on every code."""
    codes = torch.arange(256, device=device).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    flat = codes.repeat(-(-n * k // codes.numel()))[: n * k]
    flat = flat[torch.randperm(flat.numel(), device=device, generator=gen)]
    w8 = flat.view(n, k).view(torch.float8_e4m3fn)
    s = (
        torch.randint(127 - 24, 127 + 5, (-(-n // 128), -(-k // 128)), device=device, generator=gen)
        .to(torch.uint8)
        .view(torch.float8_e8m0fnu)
    )
    return w8, s


def _decode_modes(torch, device, gen, smoke):
    """Every e4m3 decode the device can run (``ops.triton.ptx_codecs``) gives the auto choice's
    bits, at a decode and a prefill-tile M, on a weight of every finite code."""
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import e4m3_mode, e4m3_modes
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    n, k = (256, 256) if smoke else (1024, 1024)
    w8, s = _all_codes_weight(torch, n, k, device, gen)
    auto = e4m3_mode(device)
    modes = e4m3_modes(device)
    rows = []
    for m in (1, 3) if smoke else (1, 4096):
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        got = fp8_block_linear(x, w8, s, (128, 128))
        for mode in modes:
            same = torch.equal(fp8_block_linear(x, w8, s, (128, 128), cvt=mode), got)
            rows.append(
                {
                    "op": "fp8_block_linear",
                    "case": f"all e4m3 codes M={m} auto decode {auto} == decode {mode}",
                    "ok": same and bool(torch.isfinite(got).all()),
                }
            )
    return rows


def _expert_decode_modes(torch, e, d, i, k, device, gen):
    """The routed-expert GEMV's e2m1 decodes (the integer one and the packed PTX one where the
    device declares inline PTX) give the same bits, on weights of every byte value."""
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_INT, CVT_PTX, e4m3_modes
    from vllm_dsv4_hw.ops.triton.moe.gemv import gemv_experts

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)

    def scales(*shape):
        return torch.randint(118, 128, shape, dtype=torch.uint8, device=device, generator=gen)

    w13, w2 = codes(e, 2 * i, d // 2), codes(e, d, i // 2)
    s13, s2 = scales(e, 2 * i, d // 32), scales(e, d, i // 32)
    modes = [m for m in (CVT_INT, CVT_PTX) if m in e4m3_modes(device)]
    rows = []
    for t in (1, 4, 8):
        x = torch.randn(t, d, device=device, generator=gen).to(torch.bfloat16)
        tw, ids = _routing(torch, t, e, k, device, gen)
        outs = [gemv_experts(x, tw, ids, w13, s13, w2, s2, 10.0, e, i, cvt=m) for m in modes]
        rows.append(
            {
                "op": "moe_experts",
                "case": f"GEMV T={t} every byte: e2m1 decodes {modes} give the same bits",
                "ok": all(torch.equal(o, outs[0]) for o in outs)
                and bool(torch.isfinite(outs[0]).all()),
            }
        )
    return rows


def _experts(torch, e, d, i, device, gen):
    from vllm_dsv4_hw.quant.formats import quantize_fp4_experts

    def one(n, k):
        q, s = quantize_fp4_experts(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        return q.view(torch.uint8), s

    w13 = [one(2 * i, d) for _ in range(e)]
    w2 = [one(d, i) for _ in range(e)]
    return (
        torch.stack([a for a, _ in w13]),
        torch.stack([b for _, b in w13]),
        torch.stack([a for a, _ in w2]),
        torch.stack([b for _, b in w2]),
    )


def _impls():
    from vllm_dsv4_hw.ops import api
    from vllm_dsv4_hw.ops.registry import REGISTRY

    return (
        {b: REGISTRY.implementations(api.FP8_BLOCK_LINEAR)[b].fn for b in ("reference", "triton")},
        {b: REGISTRY.implementations(api.MOE_EXPERTS)[b].fn for b in ("reference", "triton")},
    )


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _routing(torch, t, e, k, device, gen):
    ids = torch.stack([torch.randperm(e, device=device, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, device=device, generator=gen)
    return w / w.sum(-1, keepdim=True), ids


def _serial_split(torch, device, gen, smoke):
    """The split-K partials summed inside the launch by each tile's last split give the separate
    sum launch's bits (auto and forced splits, a grouped weight), and leave the arrival counters
    zeroed, also after launches from two streams at once."""
    from vllm_dsv4_hw.ops.triton.common.counters import COUNTERS
    from vllm_dsv4_hw.ops.triton.linear import fp8_block_linear as fp8_op

    rows = []
    shapes = (
        ((256, 512, 1, 4), (128, 512, 2, 3))
        if smoke
        else ((1536, 4096, 1, None), (4096, 8192, 1, None), (1024, 4096, 8, 4))
    )
    for n, k, g, split in shapes:
        w8, s = _fp8_weight(torch, n, k, g, device, gen)
        for m in (1, 5):
            x = torch.randn(*((m, g, k) if g > 1 else (m, k)), device=device, generator=gen).to(
                torch.bfloat16
            )
            kw = dict(split_k=split)
            two = fp8_op.fp8_block_linear(x, w8, s, (128, 128), **kw, serial=False)
            ser = fp8_op.fp8_block_linear(x, w8, s, (128, 128), **kw, serial=True)
            side = torch.cuda.Stream(device) if device.type == "cuda" else None
            outs = []
            if side is not None:  # the same launch on two streams at once: their own counters
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    outs.append(fp8_op.fp8_block_linear(x, w8, s, (128, 128), **kw, serial=True))
                outs.append(fp8_op.fp8_block_linear(x, w8, s, (128, 128), **kw, serial=True))
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
            same = all(torch.equal(o, two) for o in [ser] + outs)
            clean = not any(bool(c.any()) for c in COUNTERS.values())
            rows.append(
                {
                    "op": "fp8_block_linear",
                    "case": f"serial split-K N={n} K={k} G={g} "
                    f"M={m} split={split or 'auto'} == separate sum (2 streams)",
                    "ok": same and clean,
                }
            )
    return rows


def _gemv(torch, device, gen, smoke):
    """The GEMV (``fp8_gemv``, forced with ``gemv=True``) at 1 to 4 rows: against the reference
    (e4m3 activations), every row the bits of its own one-row launch, and x given as the
    product's e4m3 codes + scales (``fp8_dot_linear.quantize``) the bits of x quantized in the
    launch; where the device takes it (FP8 dots, or the interpreter)."""
    from vllm_dsv4_hw.ops.reference.linear import check_fp8_block_linear_args
    from vllm_dsv4_hw.ops.triton.linear import gemv as fp8_gemv
    from vllm_dsv4_hw.ops.triton.linear.w8a8 import quantize

    lin, _ = _impls()
    rows = []
    shapes = (
        (("wq_b", 384, 256, 1), ("wo_a", 256, 512, 2))
        if smoke
        else (("wq_b", 32768, 1024, 1), ("wo_a", 1024, 4096, 8), ("wo_b", 4096, 8192, 1))
    )
    for name, n, k, g in shapes:
        w8, s = _fp8_weight(torch, n, k, g, device, gen)
        for m in (1, 3, 4):
            x = torch.randn(*((m, g, k) if g > 1 else (m, k)), device=device, generator=gen).to(
                torch.bfloat16
            )
            if not fp8_gemv.takes(check_fp8_block_linear_args(x, w8, s, (128, 128), None), m):
                continue
            got = lin["triton"](x, w8, s, (128, 128), None, True, gemv=True)
            r = _rel(got, lin["reference"](x, w8, s, (128, 128), None, True))
            own = all(
                torch.equal(
                    lin["triton"](x[i : i + 1], w8, s, (128, 128), None, True, gemv=True),
                    got[i : i + 1],
                )
                for i in range(m)
            )
            q, qs = quantize(x.reshape(-1, k), 128)
            coded = lin["triton"](
                q.view(*x.shape),
                w8,
                s,
                (128, 128),
                None,
                x_scales=qs.view(*x.shape[:-1], -1),
                gemv=True,
            )
            rows.append(
                {
                    "op": "fp8_block_linear",
                    "case": f"GEMV {name} M={m} e4m3 x (rows alone, codes given)",
                    "rel_err": r,
                    "ok": r <= 2**-7
                    and bool(torch.isfinite(got).all())
                    and own
                    and torch.equal(coded, got),
                }
            )
    return rows


def _dense(torch, device, gen, smoke):
    """``dense_linear`` (Triton up to its row limit, cuBLAS past it) at the shapes of the
    projections shipped in bf16, against the float64 product; the split sum inside the launch
    gives the separate sum's bits."""
    from vllm_dsv4_hw.ops.triton.linear import dense as td

    rows = []
    shapes = (
        ((256, 512, torch.float32),)
        if smoke
        else ((2048, 4096, torch.float32), (512, 4096, torch.float32), (64, 4096, torch.bfloat16))
    )
    for n, k, odt in shapes:
        w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
        for m in (1, 3) if smoke else (1, 8, 16, 64):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            want = x.double() @ w.double().t()
            got = td.dense_linear(x, w, odt)
            r = _rel(got.double(), want)
            tol = 2**-7 if odt == torch.bfloat16 else 1e-5
            same = torch.equal(
                td.dense_linear(x, w, odt, split_k=4, serial=True),
                td.dense_linear(x, w, odt, split_k=4, serial=False),
            )
            rows.append(
                {
                    "op": "dense_linear",
                    "case": f"N={n} K={k} M={m} {odt}",
                    "rel_err": r,
                    "ok": r <= tol and same and got.dtype == odt,
                }
            )
    return rows


def check(device, smoke=False):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    lin, moe = _impls()
    rows = []
    shapes = (("wq_b", 384, 256, 1), ("wo_a", 256, 512, 2)) if smoke else LINEARS["v4-flash"]
    for name, n, k, g in shapes:
        w8, s = _fp8_weight(torch, n, k, g, device, gen)
        for m in (1, 5) if smoke else (1, 8, 64, 700):
            x = torch.randn(*((m, g, k) if g > 1 else (m, k)), device=device, generator=gen).to(
                torch.bfloat16
            )
            for qx in (False, True):  # W8A16, and W8A8 (e4m3 activations: fp8_dot_linear)
                got = lin["triton"](x, w8, s, (128, 128), None, qx)
                ref = lin["reference"](x, w8, s, (128, 128), None, qx)
                r = _rel(got, ref)
                rows.append(
                    {
                        "op": "fp8_block_linear",
                        "case": f"{name} M={m}" + (" e4m3 x" if qx else ""),
                        "rel_err": r,
                        "ok": r <= 2**-7 and bool(torch.isfinite(got).all()),
                    }
                )
    rows += _decode_modes(torch, device, gen, smoke)
    rows += _serial_split(torch, device, gen, smoke)
    rows += _gemv(torch, device, gen, smoke)
    rows += _dense(torch, device, gen, smoke)
    e, d, i, k = (8, 256, 128, 2) if smoke else EXPERTS["v4-flash"]
    rows += _expert_decode_modes(torch, e, d, i, k, device, gen)
    w13, s13, w2, s2 = _experts(torch, e, d, i, device, gen)
    for t in (1, 3) if smoke else (1, 4, 8, 64, 300):
        x = torch.randn(t, d, device=device, generator=gen).to(torch.bfloat16)
        tw, ids = _routing(torch, t, e, k, device, gen)
        got = moe["triton"](x, tw, ids, w13, s13, w2, s2, 10.0)
        ref = moe["reference"](x, tw, ids, w13, s13, w2, s2, 10.0)
        r = _rel(got, ref)
        rows.append(
            {
                "op": "moe_experts",
                "case": f"E={e} D={d} I={i} k={k} T={t}",
                "rel_err": r,
                "ok": r <= 2**-7 and bool(torch.isfinite(got).all()),
            }
        )
    return rows


def bench(device, smoke=False):
    import torch
    import torch.nn.functional as F

    from benchmarks.gpu.timing import time_ms
    from vllm_dsv4_hw.quant.formats import dequantize_fp4_experts, dequantize_fp8_block

    gen = torch.Generator(device=device).manual_seed(1)
    lin, moe = _impls()
    rows = []
    models = {"smoke": (("wq_b", 384, 256, 1),)} if smoke else LINEARS
    for model, shapes in models.items():
        for name, n, k, g in shapes:
            w8, s = _fp8_weight(torch, n, k, g, device, gen)

            def unfused(x, w8=w8, s=s, g=g):
                if g == 1:
                    return F.linear(x, dequantize_fp8_block(w8, s).to(torch.bfloat16))
                w = torch.stack([dequantize_fp8_block(w8[j], s[j]) for j in range(g)])
                return torch.einsum("mgk,gnk->mgn", x, w.to(torch.bfloat16))

            wbytes = w8.numel() + s.numel()
            for m in (1,) if smoke else (1, 8, 64, 4096):
                x = torch.randn(*((m, g, k) if g > 1 else (m, k)), device=device, generator=gen).to(
                    torch.bfloat16
                )
                ours = time_ms(lambda: lin["triton"](x, w8, s, (128, 128), None), device)
                base = time_ms(lambda: unfused(x), device)
                floor = max(wbytes / HBM_BYTES_PER_S, 2 * m * n * k * g / PEAK_FLOPS) * 1e3
                rows.append(
                    {
                        "op": "fp8_block_linear",
                        "model": model,
                        "case": f"{name} M={m} N={n} K={k} G={g}",
                        "us": ours * 1e3,
                        "unfused_us": base * 1e3,
                        "speedup": base / ours,
                        "floor_us": floor * 1e3,
                        "x_floor": ours / floor,
                    }
                )
    emodels = {"smoke": (8, 256, 128, 2)} if smoke else EXPERTS
    for model, (e, d, i, k) in emodels.items():
        w13, s13, w2, s2 = _experts(torch, e, d, i, device, gen)
        per_expert = w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()

        def unfused(x, tw, ids, w13=w13, s13=s13, w2=w2, s2=s2, i=i):  # noqa: F811
            out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
            for ex in ids.unique().tolist():
                rows_, slot = (ids == ex).nonzero(as_tuple=True)
                a = dequantize_fp4_experts(w13[ex], s13[ex]).to(torch.bfloat16)
                h = F.linear(x[rows_], a).float()
                act = F.silu(h[:, :i].clamp(max=10)) * h[:, i:].clamp(-10, 10)
                b = dequantize_fp4_experts(w2[ex], s2[ex]).to(torch.bfloat16)
                y = F.linear(act.to(torch.bfloat16), b).float()
                out.index_add_(0, rows_, y * tw[rows_, slot, None])
            return out

        for t in (1,) if smoke else (1, 4, 8, 64, 512):
            x = torch.randn(t, d, device=device, generator=gen).to(torch.bfloat16)
            tw, ids = _routing(torch, t, e, k, device, gen)
            hit = int(ids.unique().numel())
            ours = time_ms(lambda: moe["triton"](x, tw, ids, w13, s13, w2, s2, 10.0), device)
            base = time_ms(lambda: unfused(x, tw, ids), device, graph=False)
            floor = (
                max(hit * per_expert / HBM_BYTES_PER_S, 2 * t * k * 3 * d * i / PEAK_FLOPS) * 1e3
            )
            rows.append(
                {
                    "op": "moe_experts",
                    "model": model,
                    "case": f"E={e} D={d} I={i} k={k} T={t} ({hit} experts hit)",
                    "us": ours * 1e3,
                    "unfused_us": base * 1e3,
                    "speedup": base / ours,
                    "floor_us": floor * 1e3,
                    "x_floor": ours / floor,
                }
            )
            if t <= 8:  # the switch MoETuning.gemv_max_tokens: both kernels at this batch
                rows.append(_moe_paths(torch, moe, model, x, tw, ids, (w13, s13, w2, s2), floor))
    return rows


def _moe_paths(torch, moe, model, x, tw, ids, weights, floor) -> dict:
    from benchmarks.gpu.timing import time_ms
    from vllm_dsv4_hw.ops import tuning

    us = {}
    for name, limit in (("gemv", 1 << 20), ("grouped", 0)):
        with tuning.override(moe=tuning.MoETuning(gemv_max_tokens=limit)):
            us[name] = 1e3 * time_ms(lambda: moe["triton"](x, tw, ids, *weights, 10.0), x.device)
    return {
        "op": "moe_experts_paths",
        "model": model,
        "case": f"T={x.shape[0]}",
        "gemv_us": us["gemv"],
        "grouped_us": us["grouped"],
        "floor_us": floor * 1e3,
    }


if __name__ == "__main__":
    import sys

    prepare_smoke_env(sys.argv)
    sys.exit(run_cli(__doc__, check, bench))
