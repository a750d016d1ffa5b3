"""Ahead-of-time compile of the indexer / compressor / top-k Triton kernels for an H100/H200 (sm_90), on a
machine without a GPU: catches what the interpreter accepts but the GPU compiler rejects (globals that
are not constexpr, dot shapes and dtypes, layout conversions, pointer casts), before any GPU run.

Runs in a subprocess without TRITON_INTERPRET (under the interpreter the kernels are not compilable
JIT functions). Uses Triton's bundled ptxas; skipped when it is absent.
"""

from __future__ import annotations

import pytest

from tests.subprocess_scripts import HAS_PTXAS, compile_results

pytest.importorskip("triton")

_SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_dsv4_hw.ops.triton import compressor as tc, indexer as ti, quant, topk as tk

target = GPUTarget("cuda", 90, 32)
DIV16 = {"q_ptr", "w_ptr", "cache_ptr", "bt_ptr", "req_ptr", "pos_ptr", "out_ptr", "stride_qt",
         "stride_wt", "stride_out", "page_stride", "page_stride_units", "state_ptr", "rows_ptr",
         "kv_ptr", "score_ptr", "ape_ptr", "slot_ptr", "stride_kv", "stride_score", "stride_ape",
         "stride_state", "stride_state_pairs", "cos_sin_ptr", "stride_cs", "entry_ptr",
         "cache_slot_ptr"}
results = []


def comp(fn, sig, consts, name, **opts):
    full = dict(sig)
    full.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k in DIV16}
    try:
        triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs), target=target,
                       options=opts)
        results.append((name, None))
    except Exception as exc:  # report every failure, not just the first
        results.append((name, f"{type(exc).__name__}: {str(exc)[:1500]}"))


isig = dict(q_ptr="*bf16", w_ptr="*fp32", cache_ptr="*u8", bt_ptr="*i32", req_ptr="*i32",
            pos_ptr="*i64", out_ptr="*fp32", stride_qt="i32", stride_wt="i32", stride_bt="i32",
            stride_out="i32", page_stride="i32", page_stride_units="i32", n_max="i32",
            n_split="i32", bt_cols="i32", n_programs="i32")
for fmt, code, db, sb, unit, dot in (("mxfp4", quant.FMT_MXFP4, 64, 4, 1, 1),
                                     ("fp8", quant.FMT_FP8_INDEXER, 128, 4, 2, 2),
                                     ("bf16", quant.FMT_BF16, 256, 0, 4, 1),
                                     ("fp32", quant.FMT_FP32, 512, 0, 8, 0)):
    sig = dict(isig, q_ptr="*bf16" if dot == 1 else "*fp32")
    comp(ti._indexer_score_kernel, sig,
         dict(H=64, DI=128, E=64, DATA_BYTES=db, SCALE_BYTES=sb, UNIT=unit, RATIO=4, FMT=code,
              DOT=dot, BLOCK_S=64, ITERS=4), f"indexer {fmt} dot={dot}", num_warps=4, num_stages=2)

wsig = dict(kv_ptr="*fp32", score_ptr="*fp32", pos_ptr="*i64", ape_ptr="*fp32", state_ptr="*fp32",
            slot_ptr="*i64", n_tokens="i32", n_blocks="i32", stride_kv="i32", stride_score="i32",
            stride_ape="i32", stride_state="i32")
comp(tc._write_rows_kernel, wsig, dict(WIDTH=1024, RATIO=4, BLOCK=1024, BT=1), "write_rows",
     num_warps=4)
psig = dict(state_ptr="*fp32", rows_ptr="*i64", n_groups="i32", n_gblocks="i32",
            stride_state_pairs="i32", stride_rows="i32", w_ptr="*fp32", eps="fp32",
            cos_sin_ptr="*fp32", stride_cs="i32", entry_ptr="*i64", cache_ptr="*u8",
            cache_slot_ptr="*i64", page_stride="i32", out_ptr="*fp32", stride_out="i32")
for name, d, ratio, coff, code, e, db, sb, out in (
        ("c4a fp8_ds_mla", 512, 4, 2, quant.FMT_FP8_DS_MLA, 64, 576, 8, 0),
        ("c128a bf16", 512, 128, 1, quant.FMT_BF16, 2, 1024, 0, 0),
        ("c4a pool", 512, 4, 2, quant.FMT_FP32, 1, 0, 0, 1),
        ("indexer mxfp4", 128, 4, 2, quant.FMT_MXFP4, 64, 64, 4, 0),
        ("indexer fp8", 128, 4, 2, quant.FMT_FP8_INDEXER, 64, 128, 4, 0)):
    nb, bp = tc._layout(code, d)
    comp(tc._pool_kernel, psig,
         dict(D=d, RATIO=ratio, COFF=coff, NB=nb, BP=bp, GB=1, BLOCK_R=tc._block_r(ratio, d, 1),
              E=e, DATA_BYTES=db, SCALE_BYTES=sb, FMT=code, OUT=out, ROPE=64,
              SKIP_EMPTY=out == 0),
         f"pool {name}", num_warps=8 if d >= 512 else 4)
hs = dict(scores_ptr="*fp32", state_ptr="*i32", n="i32", stride="i32", n_blk="i32")
for p in range(4):
    comp(tk._hist_kernel, hs, dict(PASS=p, BLOCK=4096), f"topk hist pass {p}", num_warps=8)
    comp(tk._select_kernel, dict(state_ptr="*i32", k="i32"), dict(PASS=p),
         f"topk select pass {p}", num_warps=4)
comp(tk._count_kernel, dict(scores_ptr="*fp32", state_ptr="*i32", counts_ptr="*i32", n="i32",
                            stride="i32", n_blk="i32"),
     dict(BLOCK=4096), "topk count", num_warps=8)
comp(tk._gather_kernel, dict(scores_ptr="*fp32", state_ptr="*i32", base_ptr="*i32",
                             out_ptr="*i32", n="i32", stride="i32", stride_out="i32", n_blk="i32",
                             k="i32"),
     dict(BLOCK=4096), "topk gather", num_warps=8)
print("RESULTS" + json.dumps(results))
'''


@pytest.mark.skipif(not HAS_PTXAS, reason="Triton's bundled ptxas is not installed")
def test_kernels_compile_for_sm90():
    results = compile_results(_SCRIPT)
    failed = [f"{name}: {err}" for name, err in results if err]
    assert len(results) == 20
    assert not failed, "\n".join(failed)
