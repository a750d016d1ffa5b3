# SPDX-License-Identifier: Apache-2.0
"""Launch-parameter sweep of the decode-path kernels at the shapes of one decode step (issue 6).

    python -m benchmarks.decode_kernels --out $OUT            # H200: all ops (~4 min)
    python -m benchmarks.decode_kernels --only gemm,pool

Why: the decode step's time is a few kernels (``decode_stack --profile``), each far from its own
floor at batch 1; their launch parameters were chosen for prefill-sized or mid-batch cases. Every
config is timed the way the stack runs it: captured in a CUDA graph (``sweep_common.INNER`` calls
per replay, rotating over several input sets so weights and keys do not sit in L2), median over
replays.

Ops and knobs (the GEMM sweeps live in ``benchmarks.gemm_sweeps``, the timing in
``benchmarks.sweep_common``):

* ``gemm``: the W8A16 FP8 GEMM (``ops.triton.fp8_linear``, the product's op) at every projection of V4-Flash / Pro,
  M = 1, 4, 32: BN x split-K x stages (the split-K reduction's extra launch included);
* ``gemm_cvt``: the same GEMM's e4m3 decode (integer / hardware cvt / packed PTX,
  ``ops.triton.ptx_codecs``) at the default tiles (bit-equal results checked) and the packed one at
  BN x stages; M = the batches and 4096 for three wide weights;
* ``gemm_w8a8``: the W8A8 GEMM (``ops.triton.fp8_dot_linear``, e4m3 activations) against the
  W8A16 default at the same projections and batches plus a 4096-row chunk (with cuBLAS on the
  dequantized weight there): BN x stages x split-K (decode), BM x BN x warps x stages (prefill);
* ``gemm_codes``: the W8A8 GEMM at decode rows, x quantized in its programs against x handed over
  as e4m3 codes + scales (what a producer that emits codes would buy),
* ``attn``: ``sparse_attention`` at window 128 + K compressed (512 = top-k, 8192 = c128a at 1M),
  B = 1, 4, 32: BLOCK_H x BLOCK_N x warps x prefetch x candidates per split (4096: no split);
* ``attn_prefill``: ``sparse_attention`` over an 8192-token prefill chunk (64 heads, window 128 +
  512 / 1024 compressed): e4m3 decode x head block x tile x warps x prefetch, no split;
* ``attn_loop``: ``sparse_attention``'s single loop over both caches against one loop per cache,
  and its pipeline stages / tiles, at decode (K = 512 / 8192, the batches) and prefill
  shapes (``benchmarks.attn_sweeps``);
* ``index``: the indexer score kernel at 128K / 1M context, B = 1, 4, 32: keys as the dots' A or
  B operand x BLOCK_S x ITERS x warps, and pipeline stages 3 / 4 for a few tiles;
* ``index_prefill``: the same kernel over a prefill chunk (8192 tokens at the end of 128K, 2048
  at the end of 1M): keys as A / B operand x tokens per program x warps x BLOCK_S;
* ``index_e4m3``: the same kernel with an e4m3 query on FP8 dots against the bf16 query of the
  same values, decode (the batches) and prefill shapes (``benchmarks.index_sweeps``);
* ``index_ab``: the score kernel's default launch only, at those decode and prefill shapes, with
  a digest of its scores (two package versions timed on one machine: ``benchmarks/experiments/pending_ab.sh index-ab``);
* ``topk``: ``torch.topk`` sorted vs unsorted over the score row vs ``radix_topk`` (one launch
  where the device allows it, and the six-launch form; its output's
  -1 fill is not timed: the indexer allocates that buffer anyway). A two-stage torch variant
  (top-k of chunks, then of the survivors) was tried on 2026-11-29 and lost at every shape: 71-150
  us vs 62-71 us at 256K scores;
* ``topk_sync``: the radix top-k's scores per program and warps at decode rows, bounded as the
  indexer calls it (``benchmarks.topk_sweeps``);
* ``dense``: ``dense_linear`` (the projections shipped in bf16) against cuBLAS, M = the batches:
  column block x split-K;
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

from benchmarks import topk_sweeps
from benchmarks.attn_sweeps import sweep_attn_loop
from benchmarks.gemm_sweeps import (
    sweep_dense,
    sweep_gemm,
    sweep_gemm_codes,
    sweep_gemm_cvt,
    sweep_gemm_fold,
    sweep_gemm_prefill,
    sweep_gemm_split,
    sweep_gemm_w8a8,
)
from benchmarks.index_sweeps import (
    decode_floor_us,
    prefill_floor_us,
    sweep_index_ab,
    sweep_index_e4m3,
)
from benchmarks.sweep_common import HBM, _summary, _try
from benchmarks.topk_sweeps import sweep_topk_sync


# -- sparse attention ---------------------------------------------------------------------------------
def sweep_attn(dev, batches, k_comps=(512, 8192)):
    from benchmarks.gpu.sparse_attention import make_inputs
    from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa

    rows = []
    for k_comp in k_comps:
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
                        for pf in (True, False):
                            for chunk in (32, 128, 256, 1024, 4096):
                                if chunk < bn or (chunk > n_cand and chunk != 4096):
                                    continue
                                splits = max(1, math.ceil(n_cand / chunk))
                                key = f"bh={bh} bn={bn} warps={nw} prefetch={int(pf)} chunk={chunk}"
                                res[key] = _try(lambda i: tsa.sparse_attention_triton(
                                    *sets[i], out=outs[i], block_h=bh, block_n=bn, num_warps=nw,
                                    prefetch=pf, num_splits=splits), n_sets)
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
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_PTX
    from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa

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
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    rows = []
    for ctx, t in cases:
        args = make_inputs(dev, "mxfp4", [(ctx - t, t, ctx // 4)])[0]
        fmt = args[3]
        n_max = args[4].shape[1] * fmt.entries_per_page
        buf = torch.empty(t, n_max, device=dev)
        want = ti.indexer_scores(*args, 4, out=torch.empty_like(buf), tokens_per_program=1)
        fin = torch.isfinite(want)
        res = {"default": _try(lambda i: ti.indexer_scores(*args, 4, out=buf), 1, 1, 3)}
        # (tokens per program, warps, entry block)
        configs = ((1, 4, 64), (2, 4, 64), (4, 4, 64), (4, 8, 64), (4, 4, 32), (4, 8, 128),
                   (8, 8, 64), (8, 4, 32), (8, 8, 32), (16, 8, 32))
        for tb, nw, bs in configs:
            key = f"tb={tb} warps={nw} block_s={bs}"
            kw = dict(tokens_per_program=tb, num_warps=nw, block_s=bs)
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
        rows.append(_summary("index_prefill", f"ctx={ctx} T={t}", res, "default",
                             prefill_floor_us(ctx, t, n_max)))
        del args, buf, want
        torch.cuda.empty_cache()
    return rows


def sweep_index(dev, batches):
    from benchmarks.gpu.indexer import _decode_reqs, make_inputs
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    rows = []
    for ctx in (131072, 1048576):
        for b in batches:
            n_sets = 3 if b * ctx <= 4 * 1048576 else 1
            sets = [make_inputs(dev, "mxfp4", _decode_reqs(b, ctx))[0] for _ in range(n_sets)]
            fmt = sets[0][3]
            n_max = sets[0][4].shape[1] * fmt.entries_per_page
            bufs = [torch.empty(b, n_max, device=dev) for _ in range(n_sets)]
            res = {"default": _try(lambda i: ti.indexer_scores(*sets[i], 4, out=bufs[i]), n_sets)}
            # the integer MXFP4 decode (to fp32, then cvt) against the default (packed PTX where
            # the device declares it): the same bf16 keys, so the same scores bit for bit
            want = ti.indexer_scores(*sets[0], 4).clone()
            same = torch.equal(ti.indexer_scores(*sets[0], 4, cvt=0), want)
            res["cvt=int"] = (_try(lambda i: ti.indexer_scores(*sets[i], 4, out=bufs[i], cvt=0),
                                   n_sets) if same else "wrong: differs from the default decode")
            for bs in (32, 64, 128):
                for it in (1, 4, 16):
                    for nw in (4, 8):
                        key = f"block_s={bs} iters={it} warps={nw}"
                        res[key] = _try(lambda i: ti.indexer_scores(
                            *sets[i], 4, out=bufs[i], block_s=bs, iters=it, num_warps=nw), n_sets)
            for reg in (0, 96, 80):  # programs per SM (114 registers, 0 = no cap: 4; 96: 5; 80: 6)
                res[f"maxnreg={reg}"] = _try(lambda i, reg=reg: ti.indexer_scores(
                    *sets[i], 4, out=bufs[i], maxnreg=reg), n_sets)
            for st in (3, 4):
                for bs, nw in ((64, 4), (128, 8), (128, 4)):
                    key = f"block_s={bs} warps={nw} stages={st}"
                    res[key] = _try(lambda i: ti.indexer_scores(
                        *sets[i], 4, out=bufs[i], block_s=bs, num_warps=nw, num_stages=st), n_sets)
            rows.append(_summary("index", f"ctx={ctx} B={b}", res, "default",
                                 decode_floor_us(b, ctx, fmt)))
            del sets, bufs
            torch.cuda.empty_cache()
    return rows


def sweep_topk(dev, batches):
    from vllm_dsv4_hw.ops.triton.indexer.topk import radix_topk

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
            res["radix six launches"] = _try(lambda i: radix_topk(sets[i], 512, outs[i],
                                                                  one_launch=False), 3)
            for blk in (1024, 2048, 4096, 8192):
                res[f"radix block={blk}"] = _try(lambda i, blk=blk: radix_topk(
                    sets[i], 512, outs[i], block=blk), 3)
            rows.append(_summary("topk", f"n={n} B={b}", res, "sorted=True", b * n * 4 / HBM * 1e6))
    return rows


# -- the o projection's input ----------------------------------------------------------------------
def sweep_inv_rope(dev, batches, prefill=(8192,)):
    """Step 6's input to wo_a at V4-Flash shapes (64 heads x 512, 64 rope dims): the fused
    ``inv_rope_fp8_quant`` (codes + scales straight into the W8A8 wo_a) at its row tiles and warps,
    with the integer e4m3 encode instead of the cvt, each checked
    bit-equal to the one-row program, against what it replaces: the inverse rope
    (bf16) and the W8A8 GEMM's own quantizing launch of that."""
    from vllm_dsv4_hw import ops
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin
    from vllm_dsv4_hw.ops.triton import rope as irq
    from vllm_dsv4_hw.ops.triton.linear import w8a8 as fp8_dot_linear

    cs = rope_cos_sin(10000.0, 64, 1 << 17).to(dev)
    rows = []
    for t in list(batches) + list(prefill):
        sets = [torch.randn(t, 64, 512, device=dev).to(torch.bfloat16) for _ in range(3)]
        pos = torch.randint(0, 1 << 17, (t,), device=dev)
        q1, s1 = irq.inv_rope_fp8_quant(sets[0], pos, cs, rows=1, num_warps=4)
        res = {"default": _try(lambda i: irq.inv_rope_fp8_quant(sets[i], pos, cs), 3)}
        for r, w in ((1, 4), (1, 1), (1, 2), (2, 2), (4, 4), (4, 2), (8, 4), (8, 8)):
            q, sc = irq.inv_rope_fp8_quant(sets[0], pos, cs, rows=r, num_warps=w)
            same = torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(sc, s1)
            res[f"rows={r} warps={w}"] = (_try(lambda i, r=r, w=w: irq.inv_rope_fp8_quant(
                sets[i], pos, cs, rows=r, num_warps=w), 3) if same else "wrong: bits differ")
        for hw in (False, True):
            for w in (1, 2, 4):
                kw = dict(num_warps=w, hw_enc=hw)
                qi, si = irq.inv_rope_fp8_quant(sets[0], pos, cs, **kw)
                same = torch.equal(qi.view(torch.uint8), q1.view(torch.uint8)) \
                    and torch.equal(si, s1)
                name = f"{'cvt' if hw else 'integer'} warps={w}"
                res[name] = (_try(lambda i, kw=kw: irq.inv_rope_fp8_quant(
                    sets[i], pos, cs, **kw), 3) if same else "wrong: bits differ")
        res["rope + quantize launch (before)"] = _try(lambda i: fp8_dot_linear.quantize(
            ops.rope(sets[i], pos, cs, inverse=True).view(t * 8, 4096), 128), 3)
        floor = t * 64 * 512 * (2 + 1) / HBM * 1e6
        rows.append(_summary("inv_rope", f"T={t} H=64", res, "default", floor))
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
          "attn_prefill": sweep_attn_prefill, "gemm_split": sweep_gemm_split,
          "dense": sweep_dense, "gemm_w8a8": sweep_gemm_w8a8, "attn_loop": sweep_attn_loop,
          # the prefill rows only (8,192 rows: a chunk), whatever --batches says
          "gemm_w8a8_prefill": lambda dev, _: sweep_gemm_w8a8(dev, (), prefill_ms=(8192,)),
          "index_e4m3": sweep_index_e4m3, "index_ab": sweep_index_ab, "inv_rope": sweep_inv_rope,
          "topk_sync": sweep_topk_sync, "gemm_codes": sweep_gemm_codes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SWEEPS))
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--topk-blocks", default=None,
                    help="topk_sync: scores per program to sweep, comma-separated, 'auto' for "
                         "the launch rule's (default: auto,512,1024,2048)")
    args = ap.parse_args(argv)
    if args.topk_blocks:
        topk_sweeps.BLOCKS = tuple(None if v == "auto" else int(v)
                                   for v in args.topk_blocks.split(","))
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
