# SPDX-License-Identifier: Apache-2.0
"""sparse_attention on the GPU: correctness check and benchmark of the Triton kernel.

    python -m benchmarks.gpu.sparse_attention            # check + bench on cuda, prints tables
    python -m benchmarks.gpu.sparse_attention --sweep    # + a small block / warp / split sweep
    python -m benchmarks.gpu.sparse_attention --smoke    # tiny sizes on CPU (TRITON_INTERPRET=1)

``check(device)`` compares the Triton op against the reference op evaluated in float64 on fresh
random inputs at V4 dims (D 512 = 448 + 64 rope, H 64, 512 compressed + 128 window candidates,
-1 holes, one token without candidates), for the fp8_ds_mla and bf16 caches, bf16 and fp32 queries,
through the split-K and the single-pass paths. The output and the split workspace are filled with
NaN first; every output element must be written. Tolerance: max |o - ref| <= tol * max |ref|,
tol = 1e-2 for bf16 queries (bf16 tensor-core dots: P is rounded to bf16, plus the bf16 output
rounding) and 1e-4 for fp32 queries (ieee fp32 dots).

``bench(device)`` times decode at V4-Flash shapes (H 64, topk 512 + window 128, bf16 q) for batches
1, 8, 64, with the compressed slots spread over caches of 8K, 128K and 1M entries (the window slots
point into a per-request window cache), plus one prefill row (T 2048) and one V4-Pro decode row
(H 128, topk 1024, B 8) per format. ``ref_ms`` is the reference op (the
unfused PyTorch version) on the same GPU; ``floor_ms = max(bytes / 4.3e12, flops / 790e12)`` with
bytes = q read + o written + every candidate entry read once per token at its format's size
(fp8_ds_mla 584 B, bf16 1024 B) and flops = 4 T H (W + K) D; ``frac_of_floor = floor_ms / ours_ms``.
Medians of ``triton.testing.do_bench(..., return_mode="median")`` (which flushes L2 between runs).
"""

from __future__ import annotations

import sys
import time

from benchmarks.gpu.table import prepare_smoke_env, run_cli, size_label
from benchmarks.gpu.timing import time_ms

HBM_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
FLASH = dict(h=64, d=512, topk=512, window=128)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def _fill_cache(fmt, num_entries, device, gen, pool_rows=4096, key_scale=1.0):
    """A paged cache of >= num_entries valid entries: a pool of random rows encoded once by the
    format, repeated over every slot (fast at 1M entries; every byte is a valid encoding)."""
    import torch

    e = fmt.entries_per_page
    pages = (num_entries + e - 1) // e
    cache = fmt.new_cache(pages, device=device)
    pool = torch.randn(min(pool_rows, pages * e), fmt.dim, generator=gen) * key_scale
    data, scales = fmt.quantize(pool.to(device))
    data_v, scale_v = fmt.page_views(cache)
    idx = torch.randint(0, pool.shape[0], (pages, e), generator=gen).to(device)
    data_v.copy_(data[idx])
    if fmt.scale_bytes:
        scale_v.copy_(scales[idx])
    return cache


def make_inputs(
    device,
    fmt_name,
    t,
    h=64,
    d=512,
    window=128,
    topk=512,
    cache_entries=131072,
    q_dtype=None,
    holes=0.0,
    empty_tokens=(),
    seed=None,
    entries_per_page=64,
):
    """(args tuple of the op, fmt): decode-style inputs, one token per request."""
    import torch

    from vllm_dsv4_hw.kv_cache.formats import make_format

    q_dtype = q_dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31) if seed is None else seed)
    fmt = make_format(fmt_name, "main", entries_per_page)
    comp_cache = _fill_cache(fmt, cache_entries, device, gen)
    win_cache = _fill_cache(fmt, t * window, device, gen)
    window_slots = torch.arange(t)[:, None] * window + torch.arange(window)[None, :]
    comp_slots = torch.randint(0, cache_entries, (t, topk), generator=gen)
    if holes:
        window_slots = torch.where(torch.rand(t, window, generator=gen) < holes, -1, window_slots)
        comp_slots = torch.where(torch.rand(t, topk, generator=gen) < holes, -1, comp_slots)
    for tok in empty_tokens:
        window_slots[tok] = -1
        comp_slots[tok] = -1
    q = (torch.randn(t, h, d, generator=gen) * 3).to(q_dtype)
    sink = torch.randn(h, generator=gen)
    args = (
        q.to(device),
        win_cache,
        window_slots.to(torch.int32).to(device),
        comp_cache,
        comp_slots.to(torch.int32).to(device),
        fmt,
        sink.to(device),
        d**-0.5,
    )
    return args, fmt


def _ops():
    import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
    from vllm_dsv4_hw.ops.registry import REGISTRY
    from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa

    return REGISTRY.implementations("sparse_attention")["reference"].fn, tsa


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------
def _variants(fmt_name, q_dtype, t, splits, smoke, device):
    """Kernel options checked per case: the defaults, plus (fp8, bf16 q, auto splits) the portable
    integer e4m3 decode, the hardware cvt where the device declares it, and the loop without
    prefetch."""
    import torch

    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_INT, e4m3_modes

    out = [{}]
    if fmt_name == "fp8_ds_mla" and q_dtype == torch.bfloat16 and splits is None:
        out += [dict(cvt=m) for m in (CVT_INT, CVT_HW) if m in e4m3_modes(device)]
        out += [dict(prefetch=False)]
    return out


def check(device, smoke: bool = False) -> list[dict]:
    import torch

    device = torch.device(device)
    ref_fn, tsa = _ops()
    if smoke:
        shape = dict(h=4, d=512, window=8, topk=24, cache_entries=512)
        batches = [(2, None), (3, 2)]
    else:
        shape = dict(
            h=FLASH["h"],
            d=FLASH["d"],
            window=FLASH["window"],
            topk=FLASH["topk"],
            cache_entries=131072,
        )
        batches = [(1, None), (8, None), (64, None), (8, 3), (8, 1)]
    rows = []
    for fmt_name in ("fp8_ds_mla", "bf16"):
        for q_dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-4)):
            for t, splits in batches:
                if q_dtype == torch.float32 and splits is not None:
                    continue
                for opts in _variants(fmt_name, q_dtype, t, splits, smoke, device):
                    args, fmt = make_inputs(
                        device,
                        fmt_name,
                        t,
                        q_dtype=q_dtype,
                        holes=0.1,
                        empty_tokens=(t - 1,) if t > 1 else (),
                        **shape,
                    )
                    q = args[0]
                    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
                    tsa.sparse_attention_triton(
                        *args, out=out, num_splits=splits, poison_workspace=True, **opts
                    )
                    ref = ref_fn(q.double(), *args[1:]).double()
                    written = bool(~torch.isnan(out).any())
                    scale = float(ref.abs().max())
                    err = (
                        float((out.double() - ref).abs().max()) / max(scale, 1e-30)
                        if written
                        else float("nan")
                    )
                    empty_ok = t == 1 or bool((out[t - 1] == 0).all())
                    ok = written and empty_ok and err <= tol
                    case = (
                        f"{fmt_name} q={str(q_dtype)[6:]} T={t} H={shape['h']} "
                        f"W={shape['window']} K={shape['topk']} splits={splits or 'auto'}"
                    )
                    if opts:
                        case += " " + " ".join(f"{k}={v}" for k, v in opts.items())
                    rows.append(
                        dict(
                            op="sparse_attention",
                            case=case,
                            max_err_rel=err,
                            tol=tol,
                            all_written=written,
                            empty_token_zero=empty_ok,
                            ok=ok,
                        )
                    )
    # dispatch: on the GPU the public op must resolve to the triton kernel
    if device.type == "cuda":
        from vllm_dsv4_hw.ops.registry import REGISTRY

        res = REGISTRY.resolve("sparse_attention", device)
        rows.append(
            dict(
                op="sparse_attention",
                case="dispatch on cuda",
                backend=res.impl.backend,
                ok=res.impl.backend == "triton",
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------
def _floor_ms(t, h, d, n_cand, entry_bytes, q_bytes):
    bytes_moved = 2 * t * h * d * q_bytes + t * n_cand * entry_bytes
    flops = 4 * t * h * n_cand * d
    return max(bytes_moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3


def _row(case, t, h, d, n_cand, fmt, q, ref_ms, ours_ms, **extra):
    floor = _floor_ms(t, h, d, n_cand, fmt.entry_bytes, q.element_size())
    row = dict(
        op="sparse_attention",
        case=case,
        ref_ms=ref_ms,
        ours_ms=ours_ms,
        speedup=(ref_ms / ours_ms) if ref_ms else None,
        floor_ms=floor,
        frac_of_floor=floor / ours_ms,
    )
    row.update(extra)
    return row


def bench(device, smoke: bool = False, sweep: bool = False) -> list[dict]:
    import torch

    device = torch.device(device)
    ref_fn, tsa = _ops()
    if smoke:
        h, d, w, k = 4, 512, 8, 24
        batches, contexts, prefills = (1, 2), (256, 1024), (4,)
    else:
        h, d, w, k = FLASH["h"], FLASH["d"], FLASH["window"], FLASH["topk"]
        batches, contexts, prefills = (1, 8, 64), (8192, 131072, 1048576), (4096, 16384)
    rows = []
    for fmt_name in ("fp8_ds_mla", "bf16"):
        for n_entries in contexts:
            for t in batches:
                args, fmt = make_inputs(
                    device, fmt_name, t, h=h, d=d, window=w, topk=k, cache_entries=n_entries
                )
                ours = time_ms(lambda: tsa.sparse_attention_triton(*args), device)
                ref = time_ms(lambda: ref_fn(*args), device)
                case = f"decode {fmt_name} B={t} cache={size_label(n_entries)}"
                rows.append(_row(case, t, h, d, w + k, fmt, args[0], ref, ours))
        for prefill in prefills:
            args, fmt = make_inputs(
                device, fmt_name, prefill, h=h, d=d, window=w, topk=k, cache_entries=contexts[1]
            )
            ours = time_ms(lambda: tsa.sparse_attention_triton(*args), device)
            ref = time_ms(lambda: ref_fn(*args), device)
            case = f"prefill {fmt_name} T={prefill} cache={size_label(contexts[1])}"
            rows.append(_row(case, prefill, h, d, w + k, fmt, args[0], ref, ours))
        # V4-Pro decode: 128 heads, top-1024
        hp, kp, tp = (8, 40, 2) if smoke else (128, 1024, 8)
        args, fmt = make_inputs(
            device, fmt_name, tp, h=hp, d=d, window=w, topk=kp, cache_entries=contexts[1]
        )
        ours = time_ms(lambda: tsa.sparse_attention_triton(*args), device)
        ref = time_ms(lambda: ref_fn(*args), device)
        case = f"decode-pro {fmt_name} B={tp} H={hp} K={kp} cache={size_label(contexts[1])}"
        rows.append(_row(case, tp, hp, d, w + kp, fmt, args[0], ref, ours))
    if sweep:
        rows += _sweep(device, tsa, smoke)
    return rows


def _sweep(device, tsa, smoke: bool) -> list[dict]:
    """Block / warp / prefetch / register-cap / split choices at fp8 decode (cache 128K) and one
    bf16 batch: which defaults to keep (``ops.triton.sparse_attention_launch.CONFIGS``)."""
    h, d, w, k = (4, 512, 8, 24) if smoke else (64, 512, 128, 512)
    base = dict(block_h=32, block_n=16, num_warps=8)
    configs = [
        dict(base, prefetch=True),
        dict(base, prefetch=False),
        dict(base, prefetch=False, maxnreg=128),
        dict(block_h=16, block_n=16, num_warps=4, prefetch=False),
        dict(block_h=16, block_n=16, num_warps=4, prefetch=True),
        dict(block_h=32, block_n=32, num_warps=8, prefetch=False),
        dict(block_h=64, block_n=16, num_warps=8, prefetch=False),
        dict(block_h=16, block_n=32, num_warps=4, prefetch=False),
    ]
    cases = [("fp8_ds_mla", t) for t in ((1, 2) if smoke else (1, 8, 64))]
    cases.append(("bf16", 2 if smoke else 8))
    return _sweep_cases(device, tsa, smoke, configs, cases, (None, 1, 4, 16), h, d, w, k)


def sweep_large(device, tsa, smoke: bool = False) -> list[dict]:
    """Choices for many tokens at once (prefill chunks, decode batches of 64): head blocks up to
    all 64 heads (each entry tile read once per head block), longer tiles, pipelining, and split-K
    on or off (the device is full without it)."""
    h, d, w, k = (4, 512, 8, 24) if smoke else (64, 512, 128, 512)
    configs = [
        dict(block_h=16, block_n=32, num_warps=4),
        dict(block_h=16, block_n=64, num_warps=4),
        dict(block_h=32, block_n=32, num_warps=4),
        dict(block_h=32, block_n=32, num_warps=8),
        dict(block_h=32, block_n=64, num_warps=8),
        dict(block_h=64, block_n=16, num_warps=8),
        dict(block_h=64, block_n=32, num_warps=8),
        dict(block_h=32, block_n=32, num_warps=8, num_stages=2),
        dict(block_h=64, block_n=32, num_warps=8, num_stages=2),
        dict(block_h=32, block_n=32, num_warps=8, prefetch=False),
        dict(block_h=64, block_n=32, num_warps=8, prefetch=False),
    ]
    if smoke:
        configs = configs[:2]
    cases = [(f, t) for f in ("bf16", "fp8_ds_mla") for t in ((2,) if smoke else (64, 4096))]
    return _sweep_cases(device, tsa, smoke, configs, cases, (None, 1), h, d, w, k)


def _sweep_cases(device, tsa, smoke, configs, cases, split_choices, h, d, w, k) -> list[dict]:
    rows = []
    for fmt_name, t in cases:
        args, fmt = make_inputs(
            device, fmt_name, t, h=h, d=d, window=w, topk=k, cache_entries=1024 if smoke else 131072
        )
        for i, cfg in enumerate(configs):
            for splits in split_choices:
                if smoke and (i > 1 or splits == 16):
                    continue
                kw = dict(cfg, num_splits=splits)
                try:
                    ours = time_ms(lambda: tsa.sparse_attention_triton(*args, **kw), device)
                except Exception as exc:  # e.g. out of shared memory / registers for a config
                    rows.append(
                        dict(
                            op="sparse_attention",
                            case=f"sweep {fmt_name} B={t}",
                            config=str(kw),
                            error=f"{type(exc).__name__}: {exc}"[:200],
                        )
                    )
                    continue
                rows.append(
                    _row(
                        f"sweep {fmt_name} B={t}",
                        t,
                        h,
                        d,
                        w + k,
                        fmt,
                        args[0],
                        None,
                        ours,
                        config=str(kw),
                    )
                )
    return rows


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    return run_cli(__doc__, check, bench, argv, sweep_help="also sweep blocks / warps / splits")


if __name__ == "__main__":
    prepare_smoke_env(sys.argv)
    sys.exit(main())
