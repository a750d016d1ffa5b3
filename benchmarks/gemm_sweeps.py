# SPDX-License-Identifier: Apache-2.0
"""The FP8 weight GEMM's sweeps (``ops.triton.fp8_linear``, the product's op), run through
``python -m benchmarks.decode_kernels --only gemm,gemm_fold,gemm_prefill,gemm_cvt``: shapes of
every V4-Flash / V4-Pro projection, the weights as shipped (e4m3 + ue8m0 128x128 blocks)."""

from __future__ import annotations

import math

import torch

from benchmarks.sweep_common import HBM, _summary, _try

GEMM_SHAPES = {  # name: (groups, N, K)
    "flash wq_a": (1, 1024, 4096),
    "flash wkv": (1, 512, 4096),
    "flash wq_b": (1, 32768, 1024),
    "flash wo_a": (8, 1024, 4096),
    "flash wo_b": (1, 4096, 8192),
    "flash idx wq_b": (1, 8192, 1024),
    "pro wq_a": (1, 1536, 7168),
    "pro wq_b": (1, 65536, 1536),
    "pro wo_b": (1, 7168, 16384),
}


def _shipped_weights(dev, g, n, k, n_sets):
    """``n_sets`` random [G,] N x K weights as shipped: e4m3 + ue8m0 128x128-block scales."""
    from vllm_dsv4_hw.quant.formats import quantize_fp8_block

    sets = []
    for _ in range(n_sets):
        w = torch.randn(g, n, k, device=dev) if g > 1 else torch.randn(n, k, device=dev)
        if g > 1:
            pairs = [quantize_fp8_block(wi) for wi in w]
            sets.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        else:
            sets.append(quantize_fp8_block(w))
        del w
    return sets


def _shape_cases(dev, batches, extra_ms=lambda name: ()):
    """Per projection and M: (label, weight sets, n_sets, x, weight-streaming floor us); the
    weight sets are freed after each projection's rows."""
    for name, (g, n, k) in GEMM_SHAPES.items():
        n_sets = max(2, min(6, math.ceil(200e6 / (g * n * k))))
        ws = _shipped_weights(dev, g, n, k, n_sets)
        floor = (g * n * k + g * math.ceil(n / 128) * math.ceil(k / 128) * 4) / HBM * 1e6
        for m in list(batches) + list(extra_ms(name)):
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            yield f"{name} M={m}", ws, n_sets, x, floor
        del ws
        torch.cuda.empty_cache()


def sweep_gemm(dev, batches):
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    def w8a16_matmul(x, w8, s, **kw):
        return fp8_block_linear(x, w8, s, (128, 128), **kw)

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches):
        kb = math.ceil(x.shape[-1] / 128)
        res = {}
        res["default"] = _try(lambda i: w8a16_matmul(x, *ws[i]), n_sets)
        for bn in (32, 64, 128):
            for sk in (1, 2, 4, 8, 16):
                if sk > kb:
                    continue
                for st in (3, 4, 6):
                    key = f"bn={bn} split={sk} stages={st}"
                    res[key] = _try(
                        lambda i: w8a16_matmul(x, *ws[i], block_n=bn, split_k=sk, num_stages=st),
                        n_sets,
                    )
        rows.append(_summary("gemm", label, res, "default", floor))
    return rows


def sweep_gemm_split(dev, batches):
    """Split-K partials summed inside the launch by each tile's last split (``serial``, the
    default) or by a second launch, at the default and forced splits; every result equal to the
    separate sum's bit for bit."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches):
        kb = math.ceil(x.shape[-1] / 128)
        res = {"default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
        for sk in (None, 2, 4, 8):
            if sk is not None and sk > kb:
                continue
            want = fp8_block_linear(x, *ws[0], (128, 128), split_k=sk, serial=False)
            for serial in (True, False):
                kw = dict(split_k=sk, serial=serial)
                same = torch.equal(fp8_block_linear(x, *ws[0], (128, 128), **kw), want)
                res[f"split={sk or 'auto'} serial={serial}"] = (
                    _try(lambda i, kw=kw: fp8_block_linear(x, *ws[i], (128, 128), **kw), n_sets)
                    if same
                    else "wrong: differs from the separate sum"
                )
        rows.append(_summary("gemm_split", label, res, "default", floor))
    return rows


def sweep_gemm_fold(dev, batches):
    """Decode-sized M: the three ways of applying the block scale (``fp8_linear.FOLD``) at
    each column block and stage count, split-K as the default chooses, each checked."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches):
        want = fp8_block_linear(x, *ws[0], (128, 128), fold=0).float()
        res = {"default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
        for fold in (0, 1, 2):
            for bn in (32, 64, 128):
                for st in (3, 4):
                    key = f"fold={fold} bn={bn} stages={st}"
                    kw = dict(fold=fold, block_n=bn, num_stages=st)
                    got = fp8_block_linear(x, *ws[0], (128, 128), **kw).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    res[key] = (
                        _try(lambda i, kw=kw: fp8_block_linear(x, *ws[i], (128, 128), **kw), n_sets)
                        if err < 1e-2
                        else f"wrong: rel err {err:.2e}"
                    )
        rows.append(_summary("gemm_fold", label, res, "default", floor))
    return rows


def sweep_gemm_cvt(dev, batches, prefill_ms=(4096,)):
    """The e4m3 decode of the weight tile (``ptx_codecs``: integer, hardware cvt, packed PTX) at
    the default tiles (each result equal to the hardware cvt's bit for bit: the same values enter
    the same dots), and the packed decode at other column blocks / stage counts (within bf16
    rounding of it: the split-K, so the summation order, follows the column block)."""
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_INT, CVT_PTX
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    def extra(name):
        return prefill_ms if name in ("flash wq_b", "flash wo_b", "flash wo_a") else ()

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches, extra):
        m = x.shape[0]
        want = fp8_block_linear(x, *ws[0], (128, 128), cvt=CVT_HW)
        res = {"default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
        configs = [{"cvt": c} for c in (CVT_INT, CVT_HW, CVT_PTX)]
        if m <= 64:
            configs += [
                {"cvt": CVT_PTX, "block_n": bn, "num_stages": st}
                for bn in (32, 64)
                for st in (3, 4)
            ]
        for kw in configs:
            key = " ".join(f"{a}={b}" for a, b in kw.items())
            got = fp8_block_linear(x, *ws[0], (128, 128), **kw)
            ok = (
                torch.equal(got, want)
                if len(kw) == 1
                else (
                    float((got.float() - want.float()).abs().max() / want.float().abs().max())
                    < 2**-7
                )
            )
            res[key] = (
                _try(lambda i, kw=kw: fp8_block_linear(x, *ws[i], (128, 128), **kw), n_sets)
                if ok
                else "wrong: differs from the hardware cvt"
            )
        if m > 64:  # weight elements = g * n * k
            floor = max(floor, 2 * m * ws[0][0].numel() / 790e12 * 1e6)
        rows.append(_summary("gemm_cvt", label, res, "default", floor))
    return rows


def sweep_gemm_prefill(dev, batches=None, ms=(4096, 8192)):
    """Prefill-sized M: row / column tiles, warps and stages of the product's FP8 GEMM against
    the dense bf16 matmul of the dequantized weight (cuBLAS: the unfused path), each config's
    result checked against that matmul."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    # (bm, bn, warps, stages, fold): fold 0 = a dot per K block then scaled into the accumulator,
    # 1 = scale folded into the weight tile, 2 = 1 with the weight tile as the dot's A (y^T)
    configs = [(64, 128, 4, 3, 0), (128, 128, 8, 3, 0)]
    for fold in (1, 2):
        configs += [
            (bm, bn, nw, st, fold)
            for bm, bn, nw, st in (
                (64, 128, 4, 3),
                (128, 128, 4, 3),
                (128, 128, 8, 3),
                (128, 128, 8, 4),
                (128, 256, 8, 3),
                (256, 128, 8, 3),
                (64, 256, 8, 3),
                (128, 64, 4, 4),
            )
        ]
    rows = []
    for name in ("flash wq_a", "flash wq_b", "flash wo_b", "flash wo_a"):
        g, n, k = GEMM_SHAPES[name]
        ((w8, s),) = _shipped_weights(dev, g, n, k, 1)
        from vllm_dsv4_hw.ops.api import fp8_block_linear as product_op

        for m in ms:
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            want = fp8_block_linear(x, w8, s, (128, 128)).float()
            ref_w = _dequant(w8, s)
            dense = (
                (lambda: torch.einsum("mgk,gnk->mgn", x, ref_w))
                if g > 1
                else (lambda: x @ ref_w.t())
            )
            res = {"dense bf16 (cuBLAS)": _try(lambda i: dense(), 1)}
            res["default"] = _try(lambda i: product_op(x, w8, s, (128, 128)), 1)
            for bm, bn, nw, st, fold in configs:
                key = f"bm={bm} bn={bn} warps={nw} stages={st} fold={fold}"

                def run(i, bm=bm, bn=bn, nw=nw, st=st, fold=fold):
                    return fp8_block_linear(
                        x,
                        w8,
                        s,
                        (128, 128),
                        block_m=bm,
                        block_n=bn,
                        split_k=1,
                        num_warps=nw,
                        num_stages=st,
                        fold=fold,
                    )

                try:
                    got = run(0).float()
                    err = float((got - want).abs().max() / want.abs().max())
                except Exception as exc:  # out of shared memory / registers
                    res[key] = None
                    rows.append(
                        dict(
                            op="gemm_prefill",
                            shape=f"{name} M={m}",
                            config=key,
                            error=f"{type(exc).__name__}",
                        )
                    )
                    continue
                res[key] = _try(run, 1) if err < 1e-2 else None
                if err >= 1e-2:
                    rows.append(
                        dict(
                            op="gemm_prefill",
                            shape=f"{name} M={m}",
                            config=key,
                            error=f"wrong: rel err {err:.2e}",
                        )
                    )
            flops = 2 * m * g * n * k
            rows.append(
                _summary("gemm_prefill", f"{name} M={m}", res, "default", flops / 790e12 * 1e6)
            )
        del w8, s
        torch.cuda.empty_cache()
    return rows


def _dequant(w8, s):
    """bf16 copy of an FP8 128x128-block weight (the unfused path's input, benchmark only)."""
    from vllm_dsv4_hw.quant.formats import dequantize_fp8_block

    if w8.dim() == 3:
        return torch.stack([dequantize_fp8_block(w, sc) for w, sc in zip(w8, s)]).bfloat16()
    return dequantize_fp8_block(w8, s).bfloat16()


DENSE_SHAPES = {  # name: (N, K, out dtype) of the projections shipped in bf16
    "flash c4a compressor": (2048, 4096, torch.float32),
    "flash c128a compressor": (1024, 4096, torch.float32),
    "flash indexer compressor": (512, 4096, torch.float32),
    "flash weights_proj": (64, 4096, torch.bfloat16),
    "pro c4a compressor": (2048, 7168, torch.float32),
}


def sweep_dense(dev, batches):
    """``ops.dense_linear``: the Triton decode kernel (default up to its row limit) against the
    reference's cuBLAS GEMM (what these projections ran on before), at column blocks and splits;
    each result within fp32 accumulation error of the float64 product."""
    from vllm_dsv4_hw.ops.reference.linear import dense_linear as ref
    from vllm_dsv4_hw.ops.triton.linear.dense import dense_linear

    rows = []
    for name, (n, k, odt) in DENSE_SHAPES.items():
        n_sets = max(2, min(6, math.ceil(200e6 / (2 * n * k))))
        ws = [(torch.randn(n, k, device=dev) / k**0.5).bfloat16() for _ in range(n_sets)]
        floor = 2 * n * k / HBM * 1e6
        for m in batches:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = x.double() @ ws[0].double().t()
            top = float(want.abs().max())
            res = {"cuBLAS (reference)": _try(lambda i: ref(x, ws[i], odt), n_sets)}
            for kw in [{}] + [
                {"block_n": bn, "split_k": sk} for bn in (32, 64) for sk in (1, 2, 4, 8, 16)
            ]:
                key = " ".join(f"{a}={b}" for a, b in kw.items()) or "default"
                err = float((dense_linear(x, ws[0], odt, **kw).double() - want).abs().max()) / top
                ok = err < (2**-7 if odt == torch.bfloat16 else 1e-5)
                res[key] = (
                    _try(lambda i, kw=kw: dense_linear(x, ws[i], odt, **kw), n_sets)
                    if ok
                    else f"wrong: rel err {err:.2e}"
                )
            rows.append(_summary("dense", f"{name} M={m}", res, "default", floor))
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_gemm_w8a8(dev, batches, prefill_ms=(4096,)):
    """The W8A8 kernel (``ops.triton.fp8_dot_linear``: e4m3 activations quantized in the program,
    FP8 x FP8 tensor-core dots) against the W8A16 one (the product's other path) at every
    projection, decode batches and a prefill chunk: its tiles, stages and splits, each result
    checked against the reference with the same activation quantization (within bf16 rounding);
    prefill rows also time cuBLAS on the dequantized weight."""
    from vllm_dsv4_hw.ops.reference.linear import fp8_block_linear as ref
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    def extra(name):
        return (
            prefill_ms if name in ("flash wq_a", "flash wq_b", "flash wo_b", "flash wo_a") else ()
        )

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches, extra):
        m = x.shape[0]
        want = ref(x, *ws[0], (128, 128), quantize_x=True).float()
        top = float(want.abs().max())
        res = {"w8a16 default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
        # x quantized in the program (its next tile loaded ahead: xpf) or by a launch before
        # (pre, that launch timed with it)
        modes = (dict(pre=False, xpf=True), dict(pre=False, xpf=False), dict(pre=True))
        if m <= 64:
            configs = [{}] + [
                dict(md, block_n=bn, num_stages=st, split_k=sk)
                for md in modes
                for bn in (64, 128)
                for st in (3, 4)
                for sk in (None, 4)
            ]
        else:
            configs = [{}] + [
                dict(
                    block_m=bm,
                    block_n=bn,
                    num_warps=nw,
                    num_stages=st,
                    split_k=1,
                    wt=False,
                    pre=True,
                )
                for bm, bn, nw, st in (
                    (128, 128, 8, 3),
                    (128, 128, 8, 4),
                    (128, 256, 8, 3),
                    (64, 128, 4, 4),
                    (128, 128, 4, 3),
                    (256, 128, 8, 3),
                )
            ]
            configs += [
                dict(
                    block_m=128, block_n=128, num_warps=8, num_stages=3, wt=False, pre=False, xpf=x
                )
                for x in (False, True)
            ]
            ref_w = _dequant(*ws[0])
            dense = (
                (lambda: torch.einsum("mgk,gnk->mgn", x, ref_w))
                if x.dim() == 3
                else (lambda: x @ ref_w.t())
            )
            res["dense bf16 (cuBLAS)"] = _try(lambda i: dense(), 1)
            floor = max(floor, 2 * m * ws[0][0].numel() / 790e12 * 1e6)
        for kw in configs:
            key = " ".join(f"{a}={b}" for a, b in kw.items()) or "default"
            try:
                got = fp8_block_linear(x, *ws[0], (128, 128), quantize_x=True, **kw).float()
                err = float((got - want).abs().max()) / top
            except Exception as exc:  # out of shared memory / registers
                res[key] = f"{type(exc).__name__}: {str(exc)[:100]}"
                continue
            res[key] = (
                _try(
                    lambda i, kw=kw: fp8_block_linear(x, *ws[i], (128, 128), quantize_x=True, **kw),
                    n_sets,
                )
                if err < 2**-7
                else f"wrong: rel err {err:.2e}"
            )
        rows.append(_summary("gemm_w8a8", label, res, "default", floor))
    return rows


def sweep_gemm_codes(dev, batches):
    """The W8A8 GEMM at decode rows with x quantized in its programs (the default: a row max over
    a [BM, 128] tile and its barriers in every K step) against x handed over as e4m3 codes and
    scales (``x_scales``, as ``inv_rope_fp8_quant`` hands wo_a its input: the codes stream like
    the weight). The codes are made outside the timed call: this is the GEMM a producer kernel
    that emits codes (the q norm for wq_b and the indexer's wq_b) would buy. Ahead-of-time sm_90
    SASS of the 16 x 64 tile's K loop: 224 instructions and 4 block barriers in-program, 149 and
    2 with codes (2026-12-05)."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear
    from vllm_dsv4_hw.ops.triton.linear.w8a8 import quantize

    rows = []
    for label, ws, n_sets, x, floor in _shape_cases(dev, batches):
        if x.dim() == 3:  # wo_a already takes inv_rope_fp8_quant's codes
            continue
        codes, xs = quantize(x, 128)
        base = fp8_block_linear(x, *ws[0], (128, 128), quantize_x=True)
        got = fp8_block_linear(codes, *ws[0], (128, 128), x_scales=xs)
        res = {
            "in-program": _try(
                lambda i: fp8_block_linear(x, *ws[i], (128, 128), quantize_x=True), n_sets
            ),
            "codes given": _try(
                lambda i: fp8_block_linear(codes, *ws[i], (128, 128), x_scales=xs), n_sets
            ),
            "codes given, same bits": bool(torch.equal(got, base)),
        }
        rows.append(_summary("gemm_codes", label, res, "in-program", floor))
    return rows
