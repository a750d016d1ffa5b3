# SPDX-License-Identifier: Apache-2.0
"""indexer_topk on the GPU: correctness check and benchmark of the Triton kernel.

    python -m benchmarks.gpu.indexer            # check + bench on cuda, prints tables
    python -m benchmarks.gpu.indexer --sweep    # + a block / warp / iters sweep (1M context)
    python -m benchmarks.gpu.indexer --smoke    # tiny sizes on CPU (TRITON_INTERPRET=1)

``check(device)`` runs V4 indexer dims (64 heads x 128, topk 512) on fresh random inputs: decode
batch 1 at 8K / 128K / 1M token contexts (2048 / 32768 / 262144 compressed entries) for every key
format (bf16, fp8, mxfp4) with bf16 queries, one fp32-query case (the bf16 hi/lo split dot), and a
ragged batch (decode tokens with fewer than topk visible entries, a prefill chunk, a padding token).
The score buffer is filled with NaN first and must be fully written; scores are compared to the
reference's fp32 scores (``gather_keys`` + ``score_entries`` on the GPU): max |diff| <= 1e-4 * max
|score|. Top-k is compared with the reference op as sets: at most 4 boundary swaps per token, and
every swapped-in entry's reference score within that tolerance of the reference k-th score; rows
end in -1 beyond the visible count.

``bench(device)`` times the op (score kernel + torch.topk) against the reference op (unfused
PyTorch) for decode B=1 at 8K / 128K / 1M contexts (B=8 at 128K too) per key format, and one prefill
row (T=2048 tokens of one request at an 8K context). ``score_ms`` / ``topk_ms`` split our time.
Floor = max(bytes / 4.3e12 B/s, flops / 790e12) with bytes = keys read once per request (entry
bytes) + q (bf16) + w (fp32) read + scores written (4 B per token and entry) and flops = 2 T H Di n
+ 3 T H n. Medians of ``triton.testing.do_bench(..., return_mode="median")``.
"""

from __future__ import annotations

import sys
import time

from benchmarks.gpu.table import prepare_smoke_env, run_cli, size_label
from benchmarks.gpu.timing import time_ms

HBM_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
HEADS, HEAD_DIM, TOPK = 64, 128, 512
CONTEXTS = (8192, 131072, 1048576)  # tokens; entries = tokens / 4
FORMATS = ("mxfp4", "fp8", "bf16")


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def make_inputs(
    device,
    fmt_name,
    reqs,
    h=HEADS,
    di=HEAD_DIM,
    q_dtype=None,
    seed=None,
    entries_per_page=64,
    pad_tokens=0,
):
    """reqs: list of (first position, token count, cache entries) per request. Returns (args of the
    op without topk, fmt). Pages are shuffled across requests; every slot holds a distinct random key
    (generated and encoded on the device)."""
    import torch

    from vllm_dsv4_hw.kv_cache.formats import make_format
    from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights

    q_dtype = q_dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31) if seed is None else seed)
    fmt = make_format(fmt_name, "indexer", entries_per_page)
    e = fmt.entries_per_page
    nb = max((n + e - 1) // e for _, _, n in reqs)
    pool_pages = len(reqs) * nb
    cache = fmt.new_cache(pool_pages, device=device)
    # distinct random keys for every slot (repeated rows would tie at the top-k boundary)
    dgen = torch.Generator(device=device).manual_seed(
        int(torch.randint(0, 2**31, (1,), generator=gen))
    )
    data_v, scale_v = fmt.page_views(cache)
    for p0 in range(0, pool_pages, 1024):  # chunks bound the fp32 temporaries (1M ctx: 4096 pages)
        p1 = min(pool_pages, p0 + 1024)
        rows = torch.randn((p1 - p0) * e, di, generator=dgen, device=device)
        data, scales = fmt.quantize(rows)
        data_v[p0:p1] = data.view(p1 - p0, e, -1)
        if fmt.scale_bytes:
            scale_v[p0:p1] = scales.view(p1 - p0, e, -1)
    bt = torch.randperm(pool_pages, generator=gen).view(len(reqs), nb).to(torch.int32)
    token_req, token_pos = [], []
    for r, (start, count, _) in enumerate(reqs):
        token_req += [r] * count
        token_pos += list(range(start, start + count))
    token_req += [-1] * pad_tokens
    token_pos += [0] * pad_tokens
    t = len(token_req)
    q = torch.randn(t, h, di, generator=gen).to(q_dtype)
    w = indexer_head_weights(torch.randn(t, h, generator=gen), h, di)
    args = (
        q.to(device),
        w.to(device),
        cache,
        fmt,
        bt.to(device),
        torch.tensor(token_req, device=device),
        torch.tensor(token_pos, device=device),
    )
    return args, fmt


def e4m3_query(args):
    """The op's args with q^I as e4m3 codes + per-(token, head) power-of-two scales, quantized by
    the product's ``ops.rope_fp8_quant`` (positions 0: no rotation), and the scales."""
    import torch

    from vllm_dsv4_hw import ops
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    q = args[0]
    zero = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    codes, scales = ops.rope_fp8_quant(
        q.to(torch.bfloat16), zero, rope_cos_sin(10000.0, 64, 1).to(q.device)
    )
    return (codes,) + tuple(args[1:]), scales.view(q.shape[:2])


def _decode_reqs(batch, ctx_tokens):
    n = ctx_tokens // 4
    return [(ctx_tokens - 1, 1, n)] * batch  # position ctx-1: all n entries visible


def _ops():
    import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
    from vllm_dsv4_hw.ops.reference import indexer as ref
    from vllm_dsv4_hw.ops.registry import REGISTRY
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    return REGISTRY.implementations("indexer_topk")["reference"].fn, ref, ti


def _ref_scores(ref, args, n_max, ratio=4, q_scales=None):
    """Reference fp32 scores [T, n_max] (-inf where invisible): the keys as the cache returns them
    (``paged.gather_rows``), scored by the reference's ``score_entries`` (an e4m3 query as its
    values, codes * scales)."""
    import torch

    from vllm_dsv4_hw.kv_cache import paged

    q, w, cache, fmt, bt, token_req, token_pos = args
    if q_scales is not None:
        q = ref.query_values(q, q_scales)
    out = torch.full((q.shape[0], n_max), float("-inf"), device=q.device)
    for t in range(q.shape[0]):
        r = int(token_req[t])
        if r < 0:
            continue
        n = min((int(token_pos[t]) + 1) // ratio, n_max)
        if n == 0:
            continue
        s = torch.arange(n, device=q.device)
        slots = paged.logical_to_slot(bt, torch.full_like(s, r), s, fmt.entries_per_page)
        keys = paged.gather_rows(cache, slots, fmt)
        out[t, :n] = ref.score_entries(q[t : t + 1], w[t : t + 1], keys)[0]
    return out


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------
def _check_case(device, ref_fn, ref, ti, case, args, topk, tol=1e-4, q_scales=None):
    import torch

    from vllm_dsv4_hw.ops.triton.indexer.select import indexer_topk

    q, w, cache, fmt, bt, token_req, token_pos = args
    n_max = bt.shape[1] * fmt.entries_per_page
    poisoned = torch.full((q.shape[0], n_max), float("nan"), device=device)
    got = ti.indexer_scores(
        q, w, cache, fmt, bt, token_req, token_pos, 4, out=poisoned, q_scales=q_scales
    )
    want = _ref_scores(ref, args, n_max, q_scales=q_scales)
    written = not bool(torch.isnan(got).any())
    mask_ok = bool(torch.equal(torch.isneginf(got), torch.isneginf(want)))
    fin = torch.isfinite(want)
    scale = float(want[fin].abs().max()) if bool(fin.any()) else 1.0
    err = float((got[fin] - want[fin]).abs().max()) / scale if bool(fin.any()) else 0.0
    ours = indexer_topk(q, w, cache, fmt, bt, token_req, token_pos, topk, q_scales=q_scales)
    theirs = ref_fn(q, w, cache, fmt, bt, token_req, token_pos, topk, q_scales=q_scales)
    max_swaps, sel_ok = 0, True
    for t in range(q.shape[0]):
        a = set(ours[t][ours[t] >= 0].tolist())
        b = set(theirs[t][theirs[t] >= 0].tolist())
        k = len(b)
        n_a = int((ours[t] >= 0).sum())
        if len(a) != k or n_a != k or bool((ours[t, k:] != -1).any()):
            sel_ok = False
            continue
        extra = a - b
        max_swaps = max(max_swaps, len(extra))
        if extra:
            kth = float(want[t][theirs[t, k - 1]])
            low = min(float(want[t][s]) for s in extra)
            if low < kth - tol * scale:
                sel_ok = False
    ok = written and mask_ok and err <= tol and sel_ok and max_swaps <= 4
    return dict(
        op="indexer_topk",
        case=case,
        max_err_rel=err,
        tol=tol,
        all_written=written,
        mask_ok=mask_ok,
        max_swaps=max_swaps,
        selection_ok=sel_ok,
        ok=ok,
    )


def _radix_forms(torch, device, smoke):
    """The radix top-k's one-launch form (its row barriers across many programs) against the
    six-launch form, bit for bit, twice, on ties and distinct scores with -inf entries; and the
    k-th score against torch.topk's."""
    from vllm_dsv4_hw.ops.triton.indexer.topk import radix_topk

    gen = torch.Generator(device=device).manual_seed(3)
    rows = []
    for t, n in ((1, 4096),) if smoke else ((1, 32768), (1, 262144), (4, 32768), (32, 32768)):
        for ties in (False, True):
            s = (
                torch.randint(-3, 4, (t, n), device=device, generator=gen).float()
                if ties
                else torch.randn(t, n, device=device, generator=gen)
            )
            s[0, : n // 3] = float("-inf")
            outs = []
            for one in (True, False, True):
                o = torch.full((t, 512), -1, dtype=torch.int32, device=device)
                outs.append(radix_topk(s, 512, o, one_launch=one))
            kth = torch.topk(s, 512, dim=-1).values[:, -1:]
            picked = torch.gather(s, 1, outs[0].long().clamp_min(0))
            ok = (
                all(torch.equal(outs[0], o) for o in outs[1:])
                and bool((picked >= kth).all())
                and bool((outs[0] >= 0).all())
            )
            rows.append(
                dict(
                    op="radix_topk",
                    case=f"one launch == six launches T={t} n={n} {'ties' if ties else 'distinct'}",
                    ok=ok,
                )
            )
    return rows


def check(device, smoke: bool = False) -> list[dict]:
    import torch

    device = torch.device(device)
    ref_fn, ref, ti = _ops()
    h, topk = (16, 24) if smoke else (HEADS, TOPK)
    contexts = (512, 2048) if smoke else CONTEXTS
    rows = []
    for fmt_name in FORMATS:
        for ctx in contexts:
            args, _ = make_inputs(device, fmt_name, _decode_reqs(1, ctx), h=h)
            rows.append(
                _check_case(
                    device,
                    ref_fn,
                    ref,
                    ti,
                    f"decode {fmt_name} B=1 ctx={size_label(ctx)}",
                    args,
                    topk,
                )
            )
    ctx = contexts[1]
    args, _ = make_inputs(device, "mxfp4", _decode_reqs(2, ctx), h=h, q_dtype=torch.float32)
    rows.append(
        _check_case(
            device, ref_fn, ref, ti, f"decode mxfp4 q=fp32 B=2 ctx={size_label(ctx)}", args, topk
        )
    )
    # ragged: a decode token with < topk visible, two long decodes, a prefill chunk, padding
    small = 4 * (topk // 2)
    reqs = [
        (small - 1, 1, small // 4 + 3),
        (ctx - 1, 1, ctx // 4),
        (ctx - 2, 1, ctx // 4),
        (700, 33 if smoke else 200, 1000),
    ]
    for fmt_name in ("fp8", "bf16"):
        args, _ = make_inputs(device, fmt_name, reqs, h=h, pad_tokens=1)
        rows.append(
            _check_case(
                device, ref_fn, ref, ti, f"ragged {fmt_name} (decode+prefill+pad)", args, topk
            )
        )
    # a prefill chunk long enough for tokens scored together (ops.triton.indexer.GROUP_TOKENS),
    # behind a decode token (a group across requests) and before a padding token
    n_pf = 40 if smoke else 1100
    c0 = contexts[0]
    reqs = [(c0 - 1, 1, c0 // 4), (c0 - n_pf, n_pf, c0 // 4)]
    args, _ = make_inputs(device, "mxfp4", reqs, h=h, pad_tokens=1)
    rows.append(
        _check_case(device, ref_fn, ref, ti, f"prefill mxfp4 T={n_pf} after a decode", args, topk)
    )
    # e4m3 q^I (the product's default where the device has FP8 dots): MXFP4 / fp8 keys on FP8
    # dots, fp32 sums of K = 32 (MXFP4 scale blocks) or K = 128 (fp8) products; decode and a
    # prefill chunk behind a decode token. Tolerance 1e-3: the tensor core's FP8 accumulation is
    # narrower than fp32 within a dot (products exact, sums to about 2^-13)
    for fmt_name in ("mxfp4", "fp8"):
        for label, reqs in (
            (f"decode B=2 ctx={size_label(ctx)}", _decode_reqs(2, ctx)),
            (
                f"prefill T={n_pf} after a decode",
                [(c0 - 1, 1, c0 // 4), (c0 - n_pf, n_pf, c0 // 4)],
            ),
        ):
            args, _ = make_inputs(device, fmt_name, reqs, h=h, pad_tokens=1)
            args, scales = e4m3_query(args)
            mode = ti._dot_mode(args[0], ti.quant.format_code(args[3]))
            rows.append(
                _check_case(
                    device,
                    ref_fn,
                    ref,
                    ti,
                    f"e4m3 q {fmt_name} {label} (dot mode {mode})",
                    args,
                    topk,
                    tol=1e-3,
                    q_scales=scales,
                )
            )
    rows += _radix_forms(torch, device, smoke)
    if device.type == "cuda":
        from vllm_dsv4_hw.ops.registry import REGISTRY

        res = REGISTRY.resolve("indexer_topk", device)
        rows.append(
            dict(
                op="indexer_topk",
                case="dispatch on cuda",
                backend=res.impl.backend,
                ok=res.impl.backend == "triton",
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------
def _floor_ms(t, h, di, n_per_tok, n_keys_read, entry_bytes, q_bytes):
    bytes_moved = n_keys_read * entry_bytes + t * h * di * q_bytes + t * h * 4 + t * n_per_tok * 4
    flops = 2 * t * h * di * n_per_tok + 3 * t * h * n_per_tok
    return max(bytes_moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3


def _bench_case(device, ref_fn, ti, case, args, topk, n_keys_read, n_per_tok, **kw):
    import torch

    from vllm_dsv4_hw.ops.triton.indexer.select import indexer_topk

    q, w, cache, fmt, bt, token_req, token_pos = args
    n_max = bt.shape[1] * fmt.entries_per_page
    ours = time_ms(lambda: indexer_topk(*args, topk), device)
    ref_ms = time_ms(lambda: ref_fn(*args, topk), device) if kw.get("with_ref", True) else None
    buf = torch.empty(q.shape[0], n_max, device=device)
    score_ms = time_ms(lambda: ti.indexer_scores(*args, 4, out=buf), device)
    topk_ms = time_ms(lambda: torch.topk(buf, min(topk, n_max), dim=-1), device)
    floor = _floor_ms(
        q.shape[0],
        q.shape[1],
        q.shape[2],
        n_per_tok,
        n_keys_read,
        fmt.entry_bytes,
        q.element_size(),
    )
    return dict(
        op="indexer_topk",
        case=case,
        ref_ms=ref_ms,
        ours_ms=ours,
        speedup=(ref_ms / ours) if ref_ms else None,
        floor_ms=floor,
        frac_of_floor=floor / ours,
        score_ms=score_ms,
        topk_ms=topk_ms,
        score_frac_of_floor=floor / score_ms,
    )


def bench(device, smoke: bool = False, sweep: bool = False) -> list[dict]:
    import torch

    device = torch.device(device)
    ref_fn, _, ti = _ops()
    h, topk = (16, 24) if smoke else (HEADS, TOPK)
    contexts = (512, 2048) if smoke else CONTEXTS
    rows = []
    for fmt_name in FORMATS:
        for ctx in contexts:
            for b in (1, 8) if smoke else (1, 8, 64):
                args, _ = make_inputs(device, fmt_name, _decode_reqs(b, ctx), h=h)
                n = ctx // 4
                rows.append(
                    _bench_case(
                        device,
                        ref_fn,
                        ti,
                        f"decode {fmt_name} B={b} ctx={size_label(ctx)}",
                        args,
                        topk,
                        n_keys_read=b * n,
                        n_per_tok=n,
                    )
                )
        # prefill: the first T tokens of one request in one chunk (causal over its T/4 entries)
        for t in (16,) if smoke else (4096, 16384):
            args, _ = make_inputs(device, fmt_name, [(0, t, t // 4)], h=h)
            rows.append(
                _bench_case(
                    device,
                    ref_fn,
                    ti,
                    f"prefill {fmt_name} T={t}",
                    args,
                    topk,
                    n_keys_read=t // 4,
                    n_per_tok=t // 4,
                )
            )
    if sweep:
        rows += _sweep(device, ti, smoke)
    return rows


def _sweep(device, ti, smoke: bool) -> list[dict]:
    """Score-kernel launch knobs (entry block, warps, blocks per program) at decode B=1, 1M context
    (mxfp4 and bf16): 36 configs, each compiled once (about a minute of compiles)."""
    import torch

    h = 16 if smoke else HEADS
    rows = []
    for fmt_name in ("mxfp4", "bf16"):
        for ctx in (2048,) if smoke else CONTEXTS[2:]:
            args, fmt = make_inputs(device, fmt_name, _decode_reqs(1, ctx), h=h)
            n = ctx // 4
            buf = torch.empty(1, args[4].shape[1] * fmt.entries_per_page, device=device)
            floor = _floor_ms(1, h, HEAD_DIM, n, n, fmt.entry_bytes, 2)
            for block_s in (64,) if smoke else (32, 64, 128):
                for warps in (4,) if smoke else (4, 8):
                    for iters in (1, 2) if smoke else (1, 4, 16):
                        kw = dict(block_s=block_s, num_warps=warps, iters=iters)
                        case = f"sweep {fmt_name} ctx={size_label(ctx)}"
                        try:
                            ms = time_ms(lambda: ti.indexer_scores(*args, 4, out=buf, **kw), device)
                        except Exception as exc:  # e.g. out of resources for a config
                            rows.append(
                                dict(
                                    op="indexer_scores",
                                    case=case,
                                    config=str(kw),
                                    error=f"{type(exc).__name__}: {exc}"[:200],
                                )
                            )
                            continue
                        rows.append(
                            dict(
                                op="indexer_scores",
                                case=case,
                                config=str(kw),
                                ours_ms=ms,
                                floor_ms=floor,
                                frac_of_floor=floor / ms,
                            )
                        )
    return rows


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    return run_cli(__doc__, check, bench, argv, sweep_help="also sweep score-kernel launch knobs")


if __name__ == "__main__":
    prepare_smoke_env(sys.argv)
    sys.exit(main())
