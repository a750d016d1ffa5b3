# SPDX-License-Identifier: Apache-2.0
"""compressor_store on the GPU: correctness check and benchmark of the Triton kernels.

    python -m benchmarks.gpu.compressor            # check + bench on cuda, prints tables
    python -m benchmarks.gpu.compressor --smoke    # tiny sizes on CPU (TRITON_INTERPRET=1)

Cases: main c4a (d 512, ratio 4, overlapping), main c128a (d 512, ratio 128), indexer (d 128,
ratio 4); the paged fp32 state with 64 rows per page; entry caches with 64 (ratio 4) or 2 (ratio
128) entries per page, as the spec's 256-token logical block.

``check(device)`` builds one step on fresh random inputs: decode tokens (some completing a group,
some not) plus a prefill chunk, pages shuffled; state pages no request owns hold NaN and entry
caches are poisoned (0x5A), so a stray read or a missing write shows. Triton vs the reference op
(pure PyTorch: the registry is forced to the reference backend for it) on copies: the state must be
identical (NaN-aware), every byte outside the written entries must still be poison, the written
entries, dequantized, must be within the format's rounding error of the exact fp32 entries (the
reference with the fp32 format), and the fraction of bytes differing from the reference's
quantized entries is reported (rounding flips from fp32 summation order; <= 1% required). Formats:
main bf16 / fp8_ds_mla / fp32, indexer bf16 / fp8 / mxfp4. Also ``compressor_pool`` vs reference.

``bench(device)`` times decode batches 1, 8, 64 (every request completes a group this step: the
worst case; contexts 4K-128K) and prefills of 4096 / 16384 tokens (one request from position 0),
for c4a and c128a main entries (fp8_ds_mla) and indexer keys (mxfp4, fp8), against the reference
op. Floor = max(bytes / 4.3e12, flops / 790e12) with bytes = kv + score read, state rows written,
member rows of earlier steps read (one channel half each), entries written, cos/sin rows read;
flops ~ 6 per member-row channel + 30 per entry channel. Medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from benchmarks.gpu.table import prepare_smoke_env, run_cli
from benchmarks.gpu.timing import time_ms

HBM_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
ROWS_PER_PAGE = 64
CASES = {  # name: (cache kind, d, ratio)
    "c4a": ("main", 512, 4),
    "c128a": ("main", 512, 128),
    "indexer": ("indexer", 128, 4),
}
CHECK_FORMATS = {"main": ("fp8", "bf16", "fp32"), "indexer": ("mxfp4", "fp8", "bf16")}


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def make_step(device, case, fmt_name, reqs, seed=None):
    """One compressor step. reqs: (first new position, new tokens) per request. Returns a dict
    with the op arguments (``args``), the entry format and the plan."""
    import torch

    from vllm_dsv4_hw.attention.compressor_plan import compressor_plan
    from vllm_dsv4_hw.config import YarnParams
    from vllm_dsv4_hw.kinds import kind_of
    from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
    from vllm_dsv4_hw.kv_cache.formats import make_format
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    kind, d, ratio = CASES[case]
    compressor = kind_of(ratio)
    coff, w = compressor.coff, compressor.group_width
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31) if seed is None else seed)
    rpp = ROWS_PER_PAGE
    nreq = len(reqs)
    max_pos = max(s + n for s, n in reqs)
    # state: page 0 = NaN (owned by nobody); each request gets pages for its live window + new rows
    width = max_pos // rpp + 1
    sbt = torch.zeros(nreq, width, dtype=torch.int32)
    next_page = 1
    for r, (s, n) in enumerate(reqs):
        for col in range(max(0, s - w + 1) // rpp, (s + n - 1) // rpp + 1):
            sbt[r, col] = next_page
            next_page += 1
    state = torch.randn(next_page * rpp, compressor.state_width(d), generator=gen)
    state[:rpp] = float("nan")
    # entry cache: page 0 poisoned and never written; distinct pages for completed entries
    e = BLOCK_POSITIONS // ratio  # one logical block per page
    fmt = make_format(fmt_name, kind, e)
    kwidth = max_pos // ratio // e + 1
    kbt = torch.zeros(nreq, kwidth, dtype=torch.int32)
    kpage = 1
    for r, (s, n) in enumerate(reqs):
        first = -(-(s + 1) // ratio) - 1  # entries i with s <= ratio*i + ratio - 1 < s + n
        last = (s + n) // ratio - 1
        for col in range(first // e, last // e + 1) if last >= first else ():
            kbt[r, col] = kpage
            kpage += 1
    cache = fmt.new_cache(kpage).fill_(0x5A)
    lens = torch.tensor([n for _, n in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    seq_start = torch.tensor([s for s, _ in reqs])
    plan = compressor_plan(
        qsl.to(device), seq_start.to(device), sbt.to(device), rpp, ratio, kbt.to(device), e
    )
    t = int(lens.sum())
    kv = torch.randn(t, coff * d, generator=gen)
    score = 2.0 * torch.randn(t, coff * d, generator=gen)
    ape = torch.randn(ratio, coff * d, generator=gen)
    norm_w = 1.0 + 0.3 * torch.randn(d, generator=gen)
    cos_sin = rope_cos_sin(160000.0, 64, max_pos + 1, YarnParams(), device=device)
    dev = torch.device(device)
    args = [
        kv.to(dev),
        score.to(dev),
        plan.positions,
        ape.to(dev),
        state.to(dev),
        plan.state_slots,
        plan.group_rows,
        ratio,
        norm_w.to(dev),
        1e-6,
        cos_sin,
        plan.group_entry_index,
        cache.to(dev),
        plan.cache_slots,
        fmt,
    ]
    return dict(args=args, fmt=fmt, plan=plan, d=d, ratio=ratio, coff=coff)


def _decode_reqs(batch, ratio, gen, all_complete=True, lo=4096, hi=131072):
    import torch

    out = []
    for _ in range(batch):
        i = int(torch.randint(lo // ratio, hi // ratio, (1,), generator=gen))
        pos = ratio * i + ratio - 1
        if not all_complete:
            pos -= int(torch.randint(0, 2, (1,), generator=gen))
        out.append((pos, 1))
    return out


@contextlib.contextmanager
def _pure_reference():
    """Force every op the reference compressor calls (rms_norm, rope) to the reference backend."""
    from vllm_dsv4_hw.ops.registry import REGISTRY

    old = os.environ.get("VLLM_DSV4_HW_BACKEND")
    os.environ["VLLM_DSV4_HW_BACKEND"] = "reference"
    REGISTRY.clear_cache()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_DSV4_HW_BACKEND", None)
        else:
            os.environ["VLLM_DSV4_HW_BACKEND"] = old
        REGISTRY.clear_cache()


def _impls():
    import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
    from vllm_dsv4_hw.ops.registry import REGISTRY

    store = REGISTRY.implementations("compressor_store")
    pool = REGISTRY.implementations("compressor_pool")
    return store["reference"].fn, store["triton"].fn, pool["reference"].fn, pool["triton"].fn


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------
def _entry_bound(fmt, exact):
    """Max |dequant - exact| of a correctly rounding codec (bf16 pre-rounding included), +5%."""
    import torch

    a = exact.abs()
    if fmt.name == "fp32":
        return 1e-5 * (1 + a)
    if fmt.name == "bf16":
        return 2**-8 * a + 1e-6
    if fmt.name == "fp8_ds_mla":
        blocks = exact[:, :448].reshape(-1, 7, 64).abs().amax(-1).clamp_min(1e-4)
        scale = 2.0 ** torch.ceil(torch.log2(blocks / 448.0))
        b = torch.cat(
            [2**-4 * a[:, :448] + 2**-9 * scale.repeat_interleave(64, 1), 2**-8 * a[:, 448:]], dim=1
        )
        return 1.05 * b + 1e-6
    if fmt.name == "fp8_indexer":
        scale = 2.0 ** torch.ceil(torch.log2(a.amax(-1, keepdim=True).clamp_min(1e-4) / 448.0))
        return 1.05 * (2**-4 * a + 2**-9 * scale) + 1e-6
    blocks = exact.reshape(-1, fmt.dim // 32, 32).abs().amax(-1).clamp_min(6 * 2.0**-126)
    scale = 2.0 ** torch.ceil(torch.log2(blocks / 6.0))
    return 1.05 * (0.25 * a + 0.25 * scale.repeat_interleave(32, 1)) + 1e-6


def _entries(cache, fmt, slots):
    data_v, scale_v = fmt.page_views(cache)
    e = fmt.entries_per_page
    s = slots[slots >= 0].long()
    return data_v[s // e, s % e], scale_v[s // e, s % e]


def _nan_equal(a, b) -> bool:
    import torch

    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _clone_args(args):
    out = list(args)
    out[4] = args[4].clone()  # state
    out[12] = args[12].clone()  # cache
    return out


def check(device, smoke: bool = False) -> list[dict]:
    import torch

    from vllm_dsv4_hw.kv_cache.formats import make_format

    device = torch.device(device)
    ref_store, tri_store, ref_pool, tri_pool = _impls()
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    rows = []
    for case, (kind, d, ratio) in CASES.items():
        n_dec, pre = (3, (50, 20)) if smoke else (16, (100, 600))
        if ratio == 128:
            pre = (60, 200) if smoke else (100, 1000)
        reqs = _decode_reqs(
            n_dec,
            ratio,
            gen,
            all_complete=False,
            lo=256 if smoke else 4096,
            hi=1024 if smoke else 131072,
        ) + [pre]
        for fmt_name in CHECK_FORMATS[kind]:
            seed = int(torch.randint(0, 2**31, (1,), generator=gen))
            step = make_step(device, case, fmt_name, reqs, seed=seed)
            args, fmt, plan = step["args"], step["fmt"], step["plan"]
            a_t, a_r = _clone_args(args), _clone_args(args)
            tri_store(*a_t)
            with _pure_reference():
                ref_store(*a_r)
                exact_fmt = make_format("fp32", kind, fmt.entries_per_page)
                a_x = _clone_args(args)
                a_x[12] = exact_fmt.new_cache(args[12].shape[0], device=device)
                a_x[14] = exact_fmt
                ref_store(*a_x)
            state_ok = _nan_equal(a_t[4], a_r[4])
            slots = plan.cache_slots
            dt, st = _entries(a_t[12], fmt, slots)
            dr, sr = _entries(a_r[12], fmt, slots)
            vt = fmt.dequantize(dt, st)
            exact = exact_fmt.dequantize(*_entries(a_x[12], exact_fmt, slots))
            err_ok = bool(torch.isfinite(vt).all()) and bool(
                (((vt - exact).abs()) <= _entry_bound(fmt, exact)).all()
            )
            max_err = float((vt - exact).abs().max()) if vt.numel() else 0.0
            byte_diff = float((dt != dr).float().mean()) if dt.numel() else 0.0
            mask = torch.ones_like(a_t[12])
            mv_d, mv_s = fmt.page_views(mask)
            s = slots[slots >= 0].long()
            e = fmt.entries_per_page
            mv_d[s // e, s % e] = 0
            if fmt.scale_bytes:
                mv_s[s // e, s % e] = 0
            untouched_ok = bool((a_t[12][mask.bool()] == 0x5A).all())
            bytes_ok = fmt.name == "fp32" or byte_diff <= 0.01
            ok = state_ok and err_ok and untouched_ok and bytes_ok and plan.num_groups > 0
            rows.append(
                dict(
                    op="compressor_store",
                    case=f"{case} {fmt.name} T={len(plan.positions)} G={plan.num_groups}",
                    state_equal=state_ok,
                    within_format_err=err_ok,
                    max_abs_err=max_err,
                    bytes_diff_vs_ref=byte_diff,
                    untouched_poison=untouched_ok,
                    ok=ok,
                )
            )
        # compressor_pool
        step = make_step(
            device, case, "fp32", reqs, seed=int(torch.randint(0, 2**31, (1,), generator=gen))
        )
        args = step["args"]
        st_t, st_r = args[4].clone(), args[4].clone()
        out_t = tri_pool(*args[:4], st_t, *args[5:8])
        with _pure_reference():
            out_r = ref_pool(*args[:4], st_r, *args[5:8])
        err = float((out_t - out_r).abs().max() / out_r.abs().max().clamp_min(1e-30))
        ok = _nan_equal(st_t, st_r) and err <= 1e-5 and bool(torch.isfinite(out_t).all())
        rows.append(
            dict(
                op="compressor_pool",
                case=f"{case} T={len(step['plan'].positions)} G={step['plan'].num_groups}",
                max_err_rel=err,
                ok=ok,
            )
        )
    if device.type == "cuda":
        from vllm_dsv4_hw.ops.registry import REGISTRY

        for op in ("compressor_store", "compressor_pool"):
            res = REGISTRY.resolve(op, device)
            rows.append(
                dict(
                    op=op,
                    case="dispatch on cuda",
                    backend=res.impl.backend,
                    ok=res.impl.backend == "triton",
                )
            )
    return rows


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------
def _floor_ms(step) -> float:
    import torch

    plan, fmt, d, coff, ratio = step["plan"], step["fmt"], step["d"], step["coff"], step["ratio"]
    t = int(plan.positions.numel())
    g = plan.num_groups
    new = plan.state_slots[plan.state_slots >= 0]
    members = plan.group_rows[plan.group_rows >= 0]
    old_rows = int((~torch.isin(members, new)).sum()) if members.numel() else 0
    bytes_moved = (
        t * coff * d * 4 * 2
        + t * 2 * coff * d * 4
        + old_rows * 2 * d * 4
        + g * fmt.entry_bytes
        + g * 64 * 4
        + ratio * coff * d * 4
    )
    flops = 6 * g * coff * ratio * d + 30 * g * d
    return max(bytes_moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3


def bench(device, smoke: bool = False) -> list[dict]:
    import torch

    device = torch.device(device)
    ref_store, tri_store, _, _ = _impls()
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    configs = [("c4a", "fp8"), ("c128a", "fp8"), ("indexer", "mxfp4"), ("indexer", "fp8")]
    batches = (1, 2) if smoke else (1, 8, 64)
    prefills = (256,) if smoke else (4096, 16384)
    rows = []
    for case, fmt_name in configs:
        ratio = CASES[case][2]
        shapes = [
            (
                f"decode B={b}",
                _decode_reqs(
                    b, ratio, gen, lo=256 if smoke else 4096, hi=1024 if smoke else 131072
                ),
            )
            for b in batches
        ]
        shapes += [(f"prefill T={t}", [(0, t)]) for t in prefills]
        for label, reqs in shapes:
            step = make_step(device, case, fmt_name, reqs)
            args = step["args"]
            ours = time_ms(lambda: tri_store(*args), device)
            with _pure_reference():
                ref = time_ms(lambda: ref_store(*args), device)
            floor = _floor_ms(step)
            rows.append(
                dict(
                    op="compressor_store",
                    case=f"{case} {step['fmt'].name} {label} G={step['plan'].num_groups}",
                    ref_ms=ref,
                    ours_ms=ours,
                    speedup=ref / ours,
                    floor_ms=floor,
                    frac_of_floor=floor / ours,
                )
            )
    return rows


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    return run_cli(__doc__, check, bench, argv)


if __name__ == "__main__":
    prepare_smoke_env(sys.argv)
    sys.exit(main())
