# SPDX-License-Identifier: Apache-2.0
"""GPU checks and benchmarks of the Triton row-wise and fused prologue / epilogue ops.

Ops: rms_norm, rope, kv_insert, qnorm_rope_kv_insert, inv_rope_fp8_quant, qkv_rms_norm, at
DeepSeek-V4-Flash shapes (H 64, D 512, R 64, q_lora 1024, hidden 4096), bf16 activations.

* ``check(device) -> list[dict]``: the triton implementation against the reference one on the same
  device, with the tolerance stated in each row; caches are poisoned (0xFF = NaN bytes) and every
  byte outside the written entries must stay identical; op outputs are allocated from poisoned
  memory (a freed 0xFF block of the caching allocator) and must come back finite (fully written).
* ``bench(device) -> list[dict]``: ``triton.testing.do_bench(return_mode="median")`` of the triton
  op vs the unfused PyTorch version (the reference ops, on the same device) and vs the memory
  floor = bytes moved / 4.3e12 B/s (H200 HBM3e), for decode batches 1 / 8 / 64 and prefill 4096 /
  16384 tokens. Rows: op, case, ref_ms, ours_ms, speedup, floor_ms, frac_of_floor (= floor / ours).

``python -m benchmarks.gpu.fused [--smoke] [--json PATH]``: ``--smoke`` runs tiny sizes on the CPU
under the Triton interpreter (TRITON_INTERPRET=1; timings there are meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.gpu.timing import time_ms

HBM_BYTES_PER_S = 4.3e12
H, D, R, Q_LORA, HIDDEN, EPS = 64, 512, 64, 1024, 4096, 1e-6
E = 64  # entries per page of the window cache
MAX_POS = 1 << 17


# -- plumbing -----------------------------------------------------------------------------------------
def _torch():
    import torch

    return torch


def _impls(op: str):
    import vllm_dsv4_hw.ops  # noqa: F401  (registers every backend)
    from vllm_dsv4_hw.ops.registry import REGISTRY

    impls = REGISTRY.implementations(op)
    return impls["reference"].fn, impls["triton"].fn


def _poison_allocator(device, nbytes: int) -> None:
    """Fill a block of the caching allocator with 0xFF and free it: the next torch.empty of a similar
    size reuses it, so an output element a kernel forgets to write reads back as NaN."""
    torch = _torch()
    if device.type == "cuda":
        x = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        x.fill_(0xFF)
        del x


def _sync(device) -> None:
    if device.type == "cuda":
        _torch().cuda.synchronize()


def _table(device):
    from vllm_dsv4_hw.config import YarnParams
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    return rope_cos_sin(160000.0, R, MAX_POS, YarnParams(), device=device)


def _positions(torch, t: int, device, gen):
    """Positions with 4 / 8 / 128 / 256 boundaries in them, then random ones."""
    base = torch.tensor([0, 3, 4, 7, 8, 127, 128, 255, 256, 257, 4095, 65536, MAX_POS - 1])
    rnd = torch.randint(0, MAX_POS, (max(t - base.numel(), 0),), generator=gen)
    return torch.cat([base, rnd])[:t].to(device)


def _window(torch, fmt_name: str, t: int, device, gen, pad: int = 64):
    """A poisoned window cache with room for t entries and distinct slots (some -1)."""
    from vllm_dsv4_hw.kv_cache.formats import make_format

    fmt = make_format(fmt_name, "main", E)
    pages = t // E + 2
    cache = fmt.new_cache(pages, device=device, page_bytes=fmt.min_page_bytes + pad).fill_(0xFF)
    slots = torch.randperm(pages * E, generator=gen)[:t]
    if t >= 4:
        slots[torch.randperm(t, generator=gen)[: max(1, t // 16)]] = -1
    return fmt, cache, slots.to(device)


def _rows(torch, shape, device, gen, dtype=None):
    dtype = dtype or torch.bfloat16
    x = torch.randn(shape, generator=gen)
    mag = torch.exp2(torch.empty(shape[:-1] + (1,)).uniform_(-4, 4, generator=gen))
    return (x * mag).to(dtype).to(device)


def _rel_close(a, b, rtol: float, atol: float) -> tuple[bool, float]:
    a, b = a.double(), b.double()
    err = (a - b).abs()
    ok = bool(torch_all(err <= rtol * b.abs() + atol))
    return ok, float(err.max()) if err.numel() else 0.0


def torch_all(x) -> bool:
    return bool(x.all()) if x.numel() else True


def _written_mask(torch, cache, fmt, slots):
    m = torch.zeros(cache.shape, dtype=torch.bool)
    for s in slots.tolist():
        if s < 0:
            continue
        page, off = divmod(s, fmt.entries_per_page)
        d0 = off * fmt.data_bytes
        s0 = fmt.entries_per_page * fmt.data_bytes + off * fmt.scale_bytes
        m[page, d0 : d0 + fmt.data_bytes] = True
        m[page, s0 : s0 + fmt.scale_bytes] = True
    return m.to(cache.device)


def _compare_caches(torch, got, want, fmt, slots, before) -> dict:
    """Neighbours intact (both), written entries finite, and got vs want within one unit of the
    format's last place (fp8: 2^-3 |x| + s * 2^-9 per element; bf16: 2^-7 |x|; fp32: 1e-6 |x|)."""
    from vllm_dsv4_hw.kv_cache import paged

    mask = _written_mask(torch, got, fmt, slots)
    intact = bool(torch.equal(got[~mask], before[~mask])) and bool(
        torch.equal(want[~mask], before[~mask])
    )
    live = slots[slots >= 0].to(got.device)
    a = paged.gather_rows(got, live, fmt).double()
    b = paged.gather_rows(want, live, fmt).double()
    finite = torch_all(torch.isfinite(a))
    if fmt.name == "fp8_ds_mla":
        sb = fmt.page_views(want)[1][live // fmt.entries_per_page, live % fmt.entries_per_page]
        s = torch.exp2(sb[:, :7].double() - 127).repeat_interleave(64, -1)
        tol = torch.cat([0.125 * b[:, :448].abs() + s * 2**-9, 2**-7 * b[:, 448:].abs()], -1)
    elif fmt.name == "bf16":
        tol = 2**-7 * b.abs()
    else:
        tol = 1e-6 * b.abs() + 1e-6
    err = (a - b).abs()
    byte_diff = int((got != want).sum())
    return dict(
        ok=intact and finite and torch_all(err <= tol),
        neighbours_intact=intact,
        finite=finite,
        max_err=float(err.max()) if err.numel() else 0.0,
        bytes_differing=byte_diff,
    )


# -- checks --------------------------------------------------------------------------------------------
def check(device, smoke: bool | None = None) -> list[dict]:
    """Triton vs reference on ``device`` at real dims; one dict per (op, case) with ``ok``."""
    torch = _torch()
    device = torch.device(device)
    smoke = device.type == "cpu" if smoke is None else smoke
    h = 4 if smoke else H
    cases = [3, 19] if smoke else [1, 37, 300, 4096]
    gen = torch.Generator().manual_seed(1234)
    table = _table(device)
    rows: list[dict] = []
    ulp_bf16 = dict(rtol=2**-7, atol=1e-5)  # one bf16 ulp: approximate rsqrt, reduction order

    for t in cases:
        pos = _positions(torch, t, device, gen)

        # rms_norm: attn_norm-like [T, hidden] weighted, and the per-head weightless q norm
        ref, ours = _impls("rms_norm")
        x = _rows(torch, (t, HIDDEN), device, gen)
        w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(torch.bfloat16).to(device)
        want = ref(x, w, EPS)
        _poison_allocator(device, x.numel() * 2)
        got = ours(x, w, EPS)
        ok, err = _rel_close(got, want, **ulp_bf16)
        rows.append(
            dict(
                op="rms_norm",
                case=f"T={t} [T,{HIDDEN}] w",
                ok=ok and torch_all(torch.isfinite(got)),
                max_err=err,
                tol="2^-7 rel + 1e-5",
            )
        )
        xq = _rows(torch, (t, h, D), device, gen)
        ok, err = _rel_close(ours(xq, None, EPS), ref(xq, None, EPS), **ulp_bf16)
        rows.append(
            dict(
                op="rms_norm",
                case=f"T={t} [T,{h},{D}] no w",
                ok=ok,
                max_err=err,
                tol="2^-7 rel + 1e-5",
            )
        )

        # rope (forward and inverse)
        ref, ours = _impls("rope")
        for inverse in (False, True):
            want = ref(xq, pos, table, inverse)
            _poison_allocator(device, xq.numel() * 2)
            got = ours(xq, pos, table, inverse)
            ok, err = _rel_close(got, want, **ulp_bf16)
            ok = (
                ok
                and torch_all(torch.isfinite(got))
                and bool(torch.equal(got[..., : D - R], xq[..., : D - R]))
            )
            rows.append(
                dict(
                    op="rope",
                    case=f"T={t} H={h} inverse={inverse}",
                    ok=ok,
                    max_err=err,
                    tol="2^-7 rel + 1e-5; nope dims exact",
                )
            )

        # kv_insert (pure quantization of identical inputs: bytes must be identical)
        ref, ours = _impls("kv_insert")
        for name in ("fp8", "bf16"):
            fmt, cache_ref, slots = _window(torch, name, t, device, gen)
            before = cache_ref.clone()
            cache_ours = cache_ref.clone()
            kv = _rows(torch, (t, D), device, gen)
            ref(cache_ref, slots, kv, fmt)
            ours(cache_ours, slots, kv, fmt)
            res = _compare_caches(torch, cache_ours, cache_ref, fmt, slots.cpu(), before)
            res["ok"] = res["ok"] and res["bytes_differing"] == 0
            rows.append(
                dict(op="kv_insert", case=f"T={t} {fmt.name}", tol="bytes identical", **res)
            )

        # qnorm_rope_kv_insert
        ref, ours = _impls("qnorm_rope_kv_insert")
        for name in ("fp8", "bf16"):
            fmt, cache_ref, slots = _window(torch, name, t, device, gen)
            before = cache_ref.clone()
            cache_ours = cache_ref.clone()
            q = _rows(torch, (t, h, D), device, gen)
            kv = _rows(torch, (t, D), device, gen)
            want = ref(q, kv, pos, table, EPS, cache_ref, slots, fmt)
            _poison_allocator(device, q.numel() * 2)
            got = ours(q, kv, pos, table, EPS, cache_ours, slots, fmt)
            ok, err = _rel_close(got, want, **ulp_bf16)
            res = _compare_caches(torch, cache_ours, cache_ref, fmt, slots.cpu(), before)
            rows.append(
                dict(
                    op="qnorm_rope_kv_insert",
                    case=f"T={t} H={h} {fmt.name}",
                    ok=ok and res["ok"] and torch_all(torch.isfinite(got)),
                    max_err=err,
                    cache_max_err=res["max_err"],
                    cache_bytes_differing=res["bytes_differing"],
                    tol="q_out 2^-7 rel + 1e-5; cache within 1 ulp of its format",
                )
            )

        # inv_rope_fp8_quant
        ref, ours = _impls("inv_rope_fp8_quant")
        o = _rows(torch, (t, h, D), device, gen)
        q_ref, s_ref = ref(o, pos, table)
        _poison_allocator(device, o.numel())
        q_ours, s_ours = ours(o, pos, table)
        a = q_ours.double() * s_ours.double().repeat_interleave(128, -1)
        b = q_ref.double() * s_ref.double().repeat_interleave(128, -1)
        s_el = s_ref.double().repeat_interleave(128, -1)
        err = (a - b).abs()
        scale_mismatch = int((s_ours != s_ref).sum())
        # the hardware cvt and the integer encode must give the same bytes (round to nearest
        # even both; only a GPU rounds the cvt as the hardware does)
        q_int, s_int = ours(o, pos, table, hw_enc=False)
        q_hw, s_hw = ours(o, pos, table, hw_enc=True)
        enc_diff = int((q_int.view(torch.uint8) != q_hw.view(torch.uint8)).sum()) + int(
            (s_int != s_hw).sum()
        )
        # the memory-order kernel (``flat``) gives the pairs kernel's bytes, either encode
        for hw, (q_p, s_p) in ((False, (q_int, s_int)), (True, (q_hw, s_hw))):
            q_f, s_f = ours(o, pos, table, hw_enc=hw, flat=True)
            enc_diff += int((q_f.view(torch.uint8) != q_p.view(torch.uint8)).sum()) + int(
                (s_f != s_p).sum()
            )
        ok = (
            torch_all(torch.isfinite(a))
            and torch_all(err <= 0.125 * b.abs() + s_el * 2**-9)
            and scale_mismatch <= max(1, s_ref.numel() // 1000)
            and enc_diff == 0
        )
        rows.append(
            dict(
                op="inv_rope_fp8_quant",
                case=f"T={t} H={h}",
                ok=ok,
                max_err=float(err.max()),
                scale_mismatch=scale_mismatch,
                code_bytes_differing=int(
                    (q_ours.view(torch.uint8) != q_ref.view(torch.uint8)).sum()
                ),
                int_encode_bytes_differing=enc_diff,
                tol="dequant within 1 e4m3 ulp; scales equal in >= 99.9% of groups; "
                "hardware and integer encodes, pairs and flat kernels bit-equal",
            )
        )

        # qkv_rms_norm (inputs: column slices of one fused projection)
        ref, ours = _impls("qkv_rms_norm")
        fused = _rows(torch, (t, Q_LORA + D), device, gen)
        q_r, kvr = fused[:, :Q_LORA], fused[:, Q_LORA:]
        qw = (torch.rand(Q_LORA, generator=gen) + 0.5).to(torch.bfloat16).to(device)
        kw = (torch.rand(D, generator=gen) + 0.5).to(torch.bfloat16).to(device)
        w1, w2 = ref(q_r, qw, kvr, kw, EPS)
        _poison_allocator(device, fused.numel() * 2)
        g1, g2 = ours(q_r, qw, kvr, kw, EPS)
        ok1, e1 = _rel_close(g1, w1, **ulp_bf16)
        ok2, e2 = _rel_close(g2, w2, **ulp_bf16)
        rows.append(
            dict(
                op="qkv_rms_norm",
                case=f"T={t} q_lora={Q_LORA}",
                ok=ok1 and ok2 and torch_all(torch.isfinite(g1)) and torch_all(torch.isfinite(g2)),
                max_err=max(e1, e2),
                tol="2^-7 rel + 1e-5",
            )
        )
    _sync(device)
    return rows


# -- benchmarks ----------------------------------------------------------------------------------------
def bench(device, smoke: bool | None = None) -> list[dict]:
    """Triton op vs the unfused reference ops vs the memory floor; one dict per (op, case)."""
    torch = _torch()
    device = torch.device(device)
    smoke = device.type == "cpu" if smoke is None else smoke
    h = 4 if smoke else H
    cases = (
        [("decode", 1), ("decode", 2)]
        if smoke
        else [("decode", 1), ("decode", 8), ("decode", 64), ("prefill", 4096), ("prefill", 16384)]
    )
    gen = torch.Generator().manual_seed(4321)
    table = _table(device)
    rows: list[dict] = []

    from vllm_dsv4_hw.ops import tuning

    def add(op, case, ref_fn, ours_fn, nbytes):
        ref_ms = time_ms(ref_fn, device)
        ours_ms = time_ms(ours_fn, device)
        floor_ms = nbytes / HBM_BYTES_PER_S * 1e3
        row = dict(
            op=op,
            case=case,
            ref_ms=round(ref_ms, 5),
            ours_ms=round(ours_ms, 5),
            speedup=round(ref_ms / ours_ms, 3),
            floor_ms=round(floor_ms, 5),
            frac_of_floor=round(floor_ms / ours_ms, 4),
        )
        if device.type == "cuda" and case.startswith("prefill"):
            # grid cap sweep (rows per program loop beyond SMs x k programs; None = 1 row each)
            sweep = {}
            for k in (None, 8, 32, 128):
                with tuning.override(rows=tuning.RowsTuning(cuda_programs_per_sm=k)):
                    sweep[str(k)] = round(time_ms(ours_fn, device), 5)
            row["ours_ms_by_programs_per_sm"] = sweep
        rows.append(row)

    for kind, t in cases:
        case = f"{kind} T={t}"
        pos = _positions(torch, t, device, gen)
        cs_bytes = t * R * 4 + t * 8  # table rows + positions

        ref, ours = _impls("rms_norm")
        x = _rows(torch, (t, HIDDEN), device, gen)
        w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
        add(
            "rms_norm",
            f"{case} [T,{HIDDEN}]",
            lambda: ref(x, w, EPS),
            lambda: ours(x, w, EPS),
            2 * x.numel() * 2 + HIDDEN * 2,
        )

        ref, ours = _impls("rope")
        xq = _rows(torch, (t, h, D), device, gen)
        add(
            "rope",
            f"{case} H={h}",
            lambda: ref(xq, pos, table),
            lambda: ours(xq, pos, table),
            2 * xq.numel() * 2 + cs_bytes,
        )

        ref, ours = _impls("kv_insert")
        fmt, cache, _ = _window(torch, "fp8", t, device, gen)
        slots = torch.randperm(cache.shape[0] * E, generator=gen)[:t].to(device)  # all written
        kv = _rows(torch, (t, D), device, gen)
        add(
            "kv_insert",
            f"{case} fp8_ds_mla",
            lambda: ref(cache, slots, kv, fmt),
            lambda: ours(cache, slots, kv, fmt),
            kv.numel() * 2 + t * (fmt.entry_bytes + 8),
        )

        ref, ours = _impls("qnorm_rope_kv_insert")
        q = _rows(torch, (t, h, D), device, gen)
        add(
            "qnorm_rope_kv_insert",
            f"{case} H={h} fp8_ds_mla",
            lambda: ref(q, kv, pos, table, EPS, cache, slots, fmt),
            lambda: ours(q, kv, pos, table, EPS, cache, slots, fmt),
            2 * q.numel() * 2 + kv.numel() * 2 + t * (fmt.entry_bytes + 8) + cs_bytes,
        )

        ref, ours = _impls("inv_rope_fp8_quant")
        add(
            "inv_rope_fp8_quant",
            f"{case} H={h}",
            lambda: ref(q, pos, table),
            lambda: ours(q, pos, table),
            q.numel() * 2 + q.numel() + q.numel() // 128 * 4 + cs_bytes,
        )

        ref, ours = _impls("qkv_rms_norm")
        fused = _rows(torch, (t, Q_LORA + D), device, gen)
        q_r, kvr = fused[:, :Q_LORA], fused[:, Q_LORA:]
        qw = torch.ones(Q_LORA, dtype=torch.bfloat16, device=device)
        kw = torch.ones(D, dtype=torch.bfloat16, device=device)
        add(
            "qkv_rms_norm",
            f"{case} q_lora={Q_LORA}",
            lambda: ref(q_r, qw, kvr, kw, EPS),
            lambda: ours(q_r, qw, kvr, kw, EPS),
            2 * fused.numel() * 2 + (Q_LORA + D) * 2,
        )
        del x, xq, q, fused, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"== {title}")
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)"
    )
    ap.add_argument("--json", help="also write {'check': [...], 'bench': [...]} to this file")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    torch = _torch()
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: use --smoke for the CPU interpreter run", file=sys.stderr)
        return 2
    checks = check(device, smoke=args.smoke)
    _print_rows(f"check on {device}", checks)
    benches = [] if args.skip_bench else bench(device, smoke=args.smoke)
    _print_rows(f"bench on {device} (floor = bytes / {HBM_BYTES_PER_S:.1e} B/s)", benches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": str(device), "check": checks, "bench": benches}, f, indent=1, default=str
            )
    failed = [r for r in checks if not r["ok"]]
    print(f"checks: {len(checks) - len(failed)}/{len(checks)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
