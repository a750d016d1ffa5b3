"""Launch-parameter sweep of the decode-path kernels at the shapes of one decode step (issue 6).

    python -m benchmarks.decode_kernels --out $OUT            # H200: all ops (~4 min)
    python -m benchmarks.decode_kernels --only gemm,pool

Why: the decode step's time is a few kernels (``decode_stack --profile``), each far from its own
floor at batch 1; their launch parameters were chosen for prefill-sized or mid-batch cases. Every
config is timed the way the stack runs it: captured in a CUDA graph (``INNER`` calls per replay,
rotating over several input sets so weights and keys do not sit in L2), median over replays.

Ops and knobs:

* ``gemm``: the W8A16 FP8 GEMM (``ops.triton.fp8_linear``, the product's op) at every projection of V4-Flash / Pro,
  M = 1, 4, 32: BN x split-K x stages (the split-K reduction's extra launch included);
* ``gemm_cvt``: the same GEMM's e4m3 decode (integer / hardware cvt / packed PTX,
  ``ops.triton.ptx_codecs``) at the default tiles (bit-equal results checked) and the packed one at
  BN x stages; M = the batches and 4096 for three wide weights;
* ``attn``: ``sparse_attention`` at window 128 + K compressed (0, 512 = top-k, 8192 = c128a at 1M),
  B = 1, 4, 32: BLOCK_H x BLOCK_N x warps x candidates per split;
* ``attn_prefill``: ``sparse_attention`` over an 8192-token prefill chunk (64 heads, window 128 +
  512 / 1024 compressed): e4m3 decode x head block x tile x warps x prefetch, no split;
* ``index``: the indexer score kernel at 128K / 1M context, B = 1, 4, 32: keys as the dots' A or
  B operand x BLOCK_S x ITERS x warps;
* ``index_prefill``: the same kernel over a prefill chunk (8192 tokens at the end of 128K, 2048
  at the end of 1M): keys as A / B operand x tokens per program x warps x BLOCK_S;
* ``topk``: ``torch.topk`` sorted vs unsorted over the score row vs ``radix_topk`` (its output's
  -1 fill is not timed: the indexer allocates that buffer anyway). A two-stage torch variant
  (top-k of chunks, then of the survivors) was tried on 2026-11-29 and lost at every shape: 71-150
  us vs 62-71 us at 256K scores;
* ``pool``: ``compressor_store`` of one decode token per request, completing a group or not
  (graph-safe metadata: slot -1), per row budget and warps.

JSON (``decode_kernels.json``): per op and shape, every config's microseconds, the best and the
current default, and the floor (bytes once / 4.3 TB/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

HBM = 4.3e12
INNER = 8


def graph_us(fn, n_sets: int, inner: int = INNER, reps: int = 7) -> float:
    """Median microseconds of one ``fn(i)`` call (i cycles over the input sets), graph-replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            fn(i % n_sets)
    g.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        g.replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ts = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    del g
    return ts[reps // 2] * 1e3 / inner


def _try(fn, n_sets, inner: int = INNER, reps: int = 7):
    try:
        return graph_us(fn, n_sets, inner, reps)
    except Exception as exc:  # a config out of resources
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def _summary(op, shape, results: dict, default_key, floor_us):
    ok = {k: v for k, v in results.items() if isinstance(v, float)}
    best = min(ok, key=ok.get) if ok else None
    row = {"op": op, "shape": shape, "floor_us": floor_us, "best": best,
           "best_us": ok.get(best), "default": default_key,
           "default_us": results.get(default_key), "configs": results}
    print(f"{op:6s} {shape:42s} default {_f(row['default_us'])} best {_f(row['best_us'])} "
          f"floor {floor_us:6.2f}  {best}", flush=True)
    return row


def _f(v):
    return f"{v:7.2f}" if isinstance(v, float) else "   fail"


# -- gemm ---------------------------------------------------------------------------------------------
GEMM_SHAPES = {  # name: (groups, N, K)
    "flash wq_a": (1, 1024, 4096), "flash wkv": (1, 512, 4096), "flash wq_b": (1, 32768, 1024),
    "flash wo_a": (8, 1024, 4096), "flash wo_b": (1, 4096, 8192), "flash idx wq_b": (1, 8192, 1024),
    "pro wq_a": (1, 1536, 7168), "pro wq_b": (1, 65536, 1536), "pro wo_b": (1, 7168, 16384),
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


def sweep_gemm(dev, batches):
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    def w8a16_matmul(x, w8, s, **kw):
        return fp8_block_linear(x, w8, s, (128, 128), **kw)

    rows = []
    for name, (g, n, k) in GEMM_SHAPES.items():
        n_sets = max(2, min(6, math.ceil(200e6 / (g * n * k))))
        ws = _shipped_weights(dev, g, n, k, n_sets)
        kb = math.ceil(k / 128)
        for m in batches:
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            res = {}
            res["default"] = _try(lambda i: w8a16_matmul(x, *ws[i]), n_sets)
            for bn in (32, 64, 128):
                for sk in (1, 2, 4, 8, 16):
                    if sk > kb:
                        continue
                    for st in (3, 4, 6):
                        key = f"bn={bn} split={sk} stages={st}"
                        res[key] = _try(lambda i: w8a16_matmul(x, *ws[i], block_n=bn, split_k=sk,
                                                               num_stages=st), n_sets)
            floor = (g * n * k + g * math.ceil(n / 128) * kb * 4) / HBM * 1e6
            rows.append(_summary("gemm", f"{name} M={m}", res, "default", floor))
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_gemm_fold(dev, batches):
    """Decode-sized M: the three ways of applying the block scale (``fp8_linear.FOLD``) at
    each column block and stage count, split-K as the default chooses, each checked."""
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    rows = []
    for name, (g, n, k) in GEMM_SHAPES.items():
        n_sets = max(2, min(6, math.ceil(200e6 / (g * n * k))))
        ws = _shipped_weights(dev, g, n, k, n_sets)
        kb = math.ceil(k / 128)
        for m in batches:
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            want = fp8_block_linear(x, *ws[0], (128, 128), fold=0).float()
            res = {"default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
            for fold in (0, 1, 2):
                for bn in (32, 64, 128):
                    for st in (3, 4):
                        key = f"fold={fold} bn={bn} stages={st}"
                        kw = dict(fold=fold, block_n=bn, num_stages=st)
                        got = fp8_block_linear(x, *ws[0], (128, 128), **kw).float()
                        err = float((got - want).abs().max() / want.abs().max())
                        res[key] = (_try(lambda i, kw=kw: fp8_block_linear(
                            x, *ws[i], (128, 128), **kw), n_sets) if err < 1e-2
                            else f"wrong: rel err {err:.2e}")
            floor = (g * n * k + g * math.ceil(n / 128) * kb * 4) / HBM * 1e6
            rows.append(_summary("gemm_fold", f"{name} M={m}", res, "default", floor))
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_gemm_cvt(dev, batches, prefill_ms=(4096,)):
    """The e4m3 decode of the weight tile (``ptx_codecs``: integer, hardware cvt, packed PTX) at
    the default tiles (each result equal to the hardware cvt's bit for bit: the same values enter
    the same dots), and the packed decode at other column blocks / stage counts (within bf16
    rounding of it: the split-K, so the summation order, follows the column block)."""
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear
    from vllm_dsv4_hw.ops.triton.ptx_codecs import CVT_HW, CVT_INT, CVT_PTX

    rows = []
    for name, (g, n, k) in GEMM_SHAPES.items():
        n_sets = max(2, min(6, math.ceil(200e6 / (g * n * k))))
        ws = _shipped_weights(dev, g, n, k, n_sets)
        kb = math.ceil(k / 128)
        prefill = prefill_ms if name in ("flash wq_b", "flash wo_b", "flash wo_a") else ()
        for m in list(batches) + list(prefill):
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            want = fp8_block_linear(x, *ws[0], (128, 128), cvt=CVT_HW)
            res = {"default": _try(lambda i: fp8_block_linear(x, *ws[i], (128, 128)), n_sets)}
            configs = [{"cvt": c} for c in (CVT_INT, CVT_HW, CVT_PTX)]
            if m <= 64:
                configs += [{"cvt": CVT_PTX, "block_n": bn, "num_stages": st}
                            for bn in (32, 64) for st in (3, 4)]
            for kw in configs:
                key = " ".join(f"{a}={b}" for a, b in kw.items())
                got = fp8_block_linear(x, *ws[0], (128, 128), **kw)
                ok = torch.equal(got, want) if len(kw) == 1 else (
                    float((got.float() - want.float()).abs().max() / want.float().abs().max())
                    < 2 ** -7)
                res[key] = (_try(lambda i, kw=kw: fp8_block_linear(x, *ws[i], (128, 128), **kw),
                                 n_sets) if ok else "wrong: differs from the hardware cvt")
            floor = (g * n * k + g * math.ceil(n / 128) * kb * 4) / HBM * 1e6
            if m > 64:
                floor = max(floor, 2 * m * g * n * k / 790e12 * 1e6)
            rows.append(_summary("gemm_cvt", f"{name} M={m}", res, "default", floor))
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_gemm_prefill(dev, batches=None, ms=(4096, 8192)):
    """Prefill-sized M: row / column tiles, warps and stages of the product's FP8 GEMM against
    the dense bf16 matmul of the dequantized weight (cuBLAS: the unfused path), each config's
    result checked against that matmul."""
    from vllm_dsv4_hw.ops.triton.fp8_linear import fp8_block_linear

    # (bm, bn, warps, stages, fold): fold 0 = a dot per K block then scaled into the accumulator,
    # 1 = scale folded into the weight tile, 2 = 1 with the weight tile as the dot's A (y^T)
    configs = [(64, 128, 4, 3, 0), (128, 128, 8, 3, 0)]
    for fold in (1, 2):
        configs += [(bm, bn, nw, st, fold) for bm, bn, nw, st in (
            (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
            (128, 256, 8, 3), (256, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 4))]
    rows = []
    for name in ("flash wq_a", "flash wq_b", "flash wo_b", "flash wo_a"):
        g, n, k = GEMM_SHAPES[name]
        (w8, s), = _shipped_weights(dev, g, n, k, 1)
        from vllm_dsv4_hw.ops.api import fp8_block_linear as product_op
        for m in ms:
            x = torch.randn((m, g, k) if g > 1 else (m, k), device=dev, dtype=torch.bfloat16)
            want = fp8_block_linear(x, w8, s, (128, 128)).float()
            ref_w = _dequant(w8, s)
            dense = (lambda: torch.einsum("mgk,gnk->mgn", x, ref_w)) if g > 1 else \
                (lambda: x @ ref_w.t())
            res = {"dense bf16 (cuBLAS)": _try(lambda i: dense(), 1)}
            res["default"] = _try(lambda i: product_op(x, w8, s, (128, 128)), 1)
            for bm, bn, nw, st, fold in configs:
                key = f"bm={bm} bn={bn} warps={nw} stages={st} fold={fold}"

                def run(i, bm=bm, bn=bn, nw=nw, st=st, fold=fold):
                    return fp8_block_linear(x, w8, s, (128, 128), block_m=bm, block_n=bn,
                                            split_k=1, num_warps=nw, num_stages=st, fold=fold)
                try:
                    got = run(0).float()
                    err = float((got - want).abs().max() / want.abs().max())
                except Exception as exc:  # out of shared memory / registers
                    res[key] = None
                    rows.append(dict(op="gemm_prefill", shape=f"{name} M={m}", config=key,
                                     error=f"{type(exc).__name__}"))
                    continue
                res[key] = _try(run, 1) if err < 1e-2 else None
                if err >= 1e-2:
                    rows.append(dict(op="gemm_prefill", shape=f"{name} M={m}", config=key,
                                     error=f"wrong: rel err {err:.2e}"))
            flops = 2 * m * g * n * k
            rows.append(_summary("gemm_prefill", f"{name} M={m}", res, "default",
                                 flops / 790e12 * 1e6))
        del w8, s
        torch.cuda.empty_cache()
    return rows


def _dequant(w8, s):
    """bf16 copy of an FP8 128x128-block weight (the unfused path's input, benchmark only)."""
    from vllm_dsv4_hw.quant.formats import dequantize_fp8_block

    if w8.dim() == 3:
        return torch.stack([dequantize_fp8_block(w, sc) for w, sc in zip(w8, s)]).bfloat16()
    return dequantize_fp8_block(w8, s).bfloat16()


# -- sparse attention ---------------------------------------------------------------------------------
def sweep_attn(dev, batches):
    from benchmarks.gpu.sparse_attention import make_inputs
    from vllm_dsv4_hw.ops.triton import sparse_attention as tsa

    rows = []
    for k_comp in (0, 512, 8192):
        for b in batches:
            n_sets = 3
            sets = [make_inputs(dev, "fp8_ds_mla", b, topk=max(k_comp, 1),
                                cache_entries=1 << 20 if k_comp else 4096)[0]
                    for _ in range(n_sets)]
            if not k_comp:
                sets = [a[:3] + (None, None) + a[5:] for a in sets]
            outs = [torch.empty_like(a[0]) for a in sets]
            res = {"default": _try(lambda i: tsa.sparse_attention_triton(*sets[i], out=outs[i]),
                                   n_sets)}
            n_cand = 128 + k_comp
            for bh in (16, 32, 64):
                for bn in (16, 32):
                    for nw in (4, 8):
                        for chunk in (16, 32, 64, 128, 256):
                            if chunk < bn:
                                continue
                            splits = max(1, math.ceil(n_cand / chunk))
                            key = f"bh={bh} bn={bn} warps={nw} chunk={chunk}"
                            res[key] = _try(lambda i: tsa.sparse_attention_triton(
                                *sets[i], out=outs[i], block_h=bh, block_n=bn, num_warps=nw,
                                num_splits=splits), n_sets)
            floor = b * n_cand * 584 / HBM * 1e6
            rows.append(_summary("attn", f"W=128 K={k_comp} B={b}", res, "default", floor))
            del sets, outs
            torch.cuda.empty_cache()
    return rows


def sweep_attn_prefill(dev, batches, t=8192):
    """A prefill chunk's sparse attention (T tokens, 64 heads, window 128 + K compressed: 512 =
    c4a top-k, 1024 = c128a at 128K): the e4m3 decode (``ptx_codecs``) x head block x tile x warps,
    no split; each config checked against the default's output (bf16 rounding)."""
    from benchmarks.gpu.sparse_attention import make_inputs
    from vllm_dsv4_hw.ops.triton import sparse_attention as tsa
    from vllm_dsv4_hw.ops.triton.ptx_codecs import CVT_HW, CVT_PTX

    rows = []
    for k_comp in (512, 1024):
        args = make_inputs(dev, "fp8_ds_mla", t, topk=k_comp, cache_entries=1 << 17)[0]
        out = torch.empty_like(args[0])
        want = tsa.sparse_attention_triton(*args).float()
        res = {"default": _try(lambda i: tsa.sparse_attention_triton(*args, out=out), 1, 1, 3)}
        for cvt in (CVT_HW, CVT_PTX):
            for bh, bn, nw, pf in ((64, 32, 8, False), (64, 16, 8, False), (64, 32, 8, True),
                                   (32, 32, 8, False), (32, 32, 4, True), (16, 32, 4, True),
                                   (64, 32, 16, False)):
                kw = dict(cvt=cvt, block_h=bh, block_n=bn, num_warps=nw, prefetch=pf, num_splits=1)
                key = " ".join(f"{a}={int(b) if isinstance(b, bool) else b}" for a, b in kw.items())
                try:
                    got = tsa.sparse_attention_triton(*args, **kw)
                    if cvt == CVT_PTX:  # the same values enter the same dots as with the cvt
                        hw = tsa.sparse_attention_triton(*args, **dict(kw, cvt=CVT_HW))
                        res[key + " bit-equal to cvt=1"] = str(bool(torch.equal(got, hw)))
                    got = got.float()
                    err = float((got - want).abs().max() / want.abs().max())
                except Exception as exc:  # out of shared memory / registers
                    res[key] = f"{type(exc).__name__}"
                    torch.cuda.synchronize()
                    continue
                res[key] = (_try(lambda i, kw=kw: tsa.sparse_attention_triton(
                    *args, out=out, **kw), 1, 1, 3) if err < 2 ** -6 else f"wrong: {err:.2e}")
        flops = 4 * t * 64 * (128 + k_comp) * 512
        rows.append(_summary("attn_prefill", f"T={t} W=128 K={k_comp}", res, "default",
                             flops / 790e12 * 1e6))
        del args, out, want
        torch.cuda.empty_cache()
    return rows


# -- indexer ------------------------------------------------------------------------------------------
def sweep_index_prefill(dev, batches, cases=((131072, 8192), (1048576, 2048))):
    """A prefill chunk's scoring: T tokens at the end of one request of ``ctx`` positions (the
    chunk's causal tail included), tokens per program x warps x entry block, each checked
    against the one-token-per-program scores; the dot FLOPs / 790 TFLOP/s as the floor."""
    from benchmarks.gpu.indexer import make_inputs
    from vllm_dsv4_hw.ops.triton import indexer as ti

    rows = []
    for ctx, t in cases:
        args = make_inputs(dev, "mxfp4", [(ctx - t, t, ctx // 4)])[0]
        fmt = args[3]
        n_max = args[4].shape[1] * fmt.entries_per_page
        buf = torch.empty(t, n_max, device=dev)
        want = ti.indexer_scores(*args, 4, out=torch.empty_like(buf), tokens_per_program=1,
                                 keys_a=False)
        fin = torch.isfinite(want)
        res = {"default": _try(lambda i: ti.indexer_scores(*args, 4, out=buf), 1, 1, 3)}
        # (keys as the dots' A operand, tokens per program, warps, entry block)
        configs = [(False, 4, 4, 64)] + [(True, tb, nw, bs) for tb, nw, bs in (
            (1, 4, 64), (2, 4, 64), (4, 4, 64), (4, 8, 64), (4, 4, 32), (4, 8, 128), (8, 8, 64),
            (8, 4, 32), (8, 8, 32), (16, 8, 32))]
        for ka, tb, nw, bs in configs:
            key = f"keys_a={int(ka)} tb={tb} warps={nw} block_s={bs}"
            kw = dict(tokens_per_program=tb, num_warps=nw, block_s=bs, keys_a=ka)
            try:
                got = ti.indexer_scores(*args, 4, out=buf, **kw)
                same_inf = bool(torch.equal(torch.isfinite(got), fin))
                err = float(((got[fin] - want[fin]).abs().max() / want[fin].abs().max()))
            except Exception as exc:
                res[key] = f"{type(exc).__name__}"
                torch.cuda.synchronize()
                continue
            res[key] = (_try(lambda i, kw=kw: ti.indexer_scores(*args, 4, out=buf, **kw),
                             1, 1, 3) if same_inf and err < 1e-3
                        else f"wrong: mask {same_inf} rel err {err:.2e}")
        visible = sum(min(n_max, (ctx - t + i + 1) // 4) for i in range(t))
        floor = 2 * 64 * 128 * visible / 790e12 * 1e6
        rows.append(_summary("index_prefill", f"ctx={ctx} T={t}", res, "default", floor))
        del args, buf, want
        torch.cuda.empty_cache()
    return rows


def sweep_index(dev, batches):
    from benchmarks.gpu.indexer import _decode_reqs, make_inputs
    from vllm_dsv4_hw.ops.triton import indexer as ti

    rows = []
    for ctx in (131072, 1048576):
        for b in batches:
            n_sets = 3 if b * ctx <= 4 * 1048576 else 1
            sets = [make_inputs(dev, "mxfp4", _decode_reqs(b, ctx))[0] for _ in range(n_sets)]
            fmt = sets[0][3]
            n_max = sets[0][4].shape[1] * fmt.entries_per_page
            bufs = [torch.empty(b, n_max, device=dev) for _ in range(n_sets)]
            res = {"default": _try(lambda i: ti.indexer_scores(*sets[i], 4, out=bufs[i]), n_sets)}
            for ka in (False, True):
                for bs in (32, 64, 128):
                    for it in (1, 4, 16):
                        for nw in (4, 8):
                            key = f"keys_a={int(ka)} block_s={bs} iters={it} warps={nw}"
                            res[key] = _try(lambda i: ti.indexer_scores(
                                *sets[i], 4, out=bufs[i], block_s=bs, iters=it, num_warps=nw,
                                keys_a=ka), n_sets)
            floor = b * (ctx // 4) * fmt.entry_bytes / HBM * 1e6
            rows.append(_summary("index", f"ctx={ctx} B={b}", res, "default", floor))
            del sets, bufs
            torch.cuda.empty_cache()
    return rows


def sweep_topk(dev, batches):
    from vllm_dsv4_hw.ops.triton.topk import radix_topk

    rows = []
    for n in (32768, 262144):
        for b in batches:
            sets = [torch.randn(b, n, device=dev) for _ in range(3)]
            res = {}
            for srt in (True, False):
                res[f"sorted={srt}"] = _try(lambda i: torch.topk(sets[i], 512, dim=-1,
                                                                 sorted=srt), 3)
            outs = [torch.full((b, 512), -1, dtype=torch.int32, device=dev) for _ in range(3)]
            res["radix"] = _try(lambda i: radix_topk(sets[i], 512, outs[i]), 3)
            rows.append(_summary("topk", f"n={n} B={b}", res, "sorted=True", b * n * 4 / HBM * 1e6))
    return rows


# -- compressor pool ----------------------------------------------------------------------------------
def sweep_pool(dev, batches):
    from benchmarks.gpu.compressor import CASES, _decode_reqs, make_step
    from vllm_dsv4_hw.kinds import kind_of
    from vllm_dsv4_hw.ops.triton import compressor as tc

    rows = []
    saved = dict(tc.POOL_CONFIG)
    for case, fmt_name in (("c128a", "fp8_ds_mla"), ("c4a", "fp8_ds_mla"), ("indexer", "mxfp4")):
        ratio = CASES[case][2]
        for b in batches:
            for complete in (True, False):
                gen = torch.Generator().manual_seed(1)
                sets = []
                for _ in range(3):
                    st = make_step(dev, case, fmt_name, _decode_reqs(b, ratio, gen))
                    a = list(st["args"])
                    if not complete:  # graph-safe metadata of a step completing nothing
                        a[6] = torch.full_like(a[6], -1)
                        a[13] = torch.full_like(a[13], -1)
                    sets.append(a)
                res = {}
                for budget in (512, 1024, 2048, 4096, 8192):
                    for w in (4, 8):
                        tc.POOL_CONFIG.update(row_budget=budget, warps_large=w, warps_small=w)
                        res[f"row_budget={budget} warps={w}"] = _try(
                            lambda i: tc.compressor_store(*sets[i]), 3)
                tc.POOL_CONFIG.update(saved)
                d = st["d"]
                k = kind_of(ratio)  # every group reads its member rows of fp32 state
                rd = b * k.group_width * k.state_width(d) * 4 if complete else 0
                floor = rd / HBM * 1e6
                default = (f"row_budget={saved['row_budget']} "
                           f"warps={saved['warps_large'] if d >= 512 else saved['warps_small']}")
                rows.append(_summary("pool", f"{case} B={b} complete={complete}", res, default,
                                     floor))
    return rows


SWEEPS = {"pool": sweep_pool, "topk": sweep_topk, "attn": sweep_attn, "index": sweep_index,
          "gemm": sweep_gemm, "gemm_prefill": sweep_gemm_prefill, "gemm_fold": sweep_gemm_fold,
          "index_prefill": sweep_index_prefill, "gemm_cvt": sweep_gemm_cvt,
          "attn_prefill": sweep_attn_prefill}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SWEEPS))
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels needs a CUDA GPU (it times graph replays)")
    dev = torch.device("cuda", torch.cuda.current_device())
    batches = [int(b) for b in args.batches.split(",")]
    data = {"schema": "decode_kernels/1", "machine": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.decode_kernels " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_kernels.json")
    for name in args.only.split(","):
        data["rows"] += SWEEPS[name](dev, batches)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
