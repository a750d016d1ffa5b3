# SPDX-License-Identifier: Apache-2.0
"""Device-level checks of the conformance kit: page buckets on the device, and stream overlap."""

from __future__ import annotations

import statistics
import time

import torch

from vllm_dsv4_hw.config import PRESETS
from vllm_dsv4_hw.conformance.tolerances import entry_bound, ratio
from vllm_dsv4_hw.kv_cache.buckets import MAX_PAGE_SIZES, fold_buckets
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.kv_cache.specs import layer_cache_specs
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.platform.streams import AuxStreams, stream_module

# cache kind -> (format kind, the format name to use: "main" / "indexer")
_KV_KINDS = {"c4a_kv": "main", "c128a_kv": "main", "window_kv": "main", "indexer_kv": "indexer"}


def bucket_rows(device: torch.device, main_formats, indexer_formats, gen) -> list[dict]:
    """For each preset model and format pair the device holds: the cache kinds fold into <= 3 page
    sizes; every KV kind's entry format matches the planning table's bytes; and on the device,
    a cache with the kind's real bucketed page round-trips entries through the dispatched
    kv_insert / kv_gather at the page's first and last slot (padding untouched)."""
    rows = []
    for model, cfg in PRESETS.items():
        for main in main_formats:
            for idx in indexer_formats:
                name = f"page buckets {model} {main}/{idx}"
                try:
                    detail = _check_buckets(cfg, main, idx, device, gen)
                    rows.append(dict(check="buckets", case=name, ok=True, detail=detail))
                except Exception as exc:  # any failure is this check's failure
                    rows.append(
                        dict(
                            check="buckets",
                            case=name,
                            ok=False,
                            detail=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
                        )
                    )
    return rows


def _check_buckets(cfg, main: str, idx: str, device: torch.device, gen) -> str:
    specs = layer_cache_specs(cfg, main, idx)
    buckets = fold_buckets(specs)
    if len(buckets) > MAX_PAGE_SIZES:
        raise AssertionError(f"{len(buckets)} page sizes")
    for spec in specs:
        if spec.natural_page_bytes > spec.page_bytes:
            raise AssertionError(f"{spec.kind}: natural page exceeds its bucket")
        kind = _KV_KINDS.get(spec.kind)
        if kind is None:  # compressor state rows: a power of two that fits
            r = spec.entries_per_page
            if r & (r - 1) or r * spec.entry_bytes > spec.page_bytes:
                raise AssertionError(
                    f"{spec.kind}: {r} rows of {spec.entry_bytes} B in a {spec.page_bytes} B page"
                )
            continue
        fmt = make_format(main if kind == "main" else idx, kind, spec.entries_per_page)
        if fmt.entry_bytes != spec.entry_bytes:
            raise AssertionError(
                f"{spec.kind}: format {fmt.name} has {fmt.entry_bytes} B entries, "
                f"the plan {spec.entry_bytes} B"
            )
        cache = fmt.new_cache(2, device=device, page_bytes=spec.page_bytes).fill_(0xFF)
        e = spec.entries_per_page
        slots = torch.tensor([0, 2 * e - 1], device=device)
        x = torch.randn(2, fmt.dim, generator=gen).to(torch.bfloat16).to(device)
        api.kv_insert(cache, slots, x, fmt)
        got = api.kv_gather(cache, slots, fmt).cpu()
        want = fmt.decode(fmt.encode(x.cpu()))
        if not torch.equal(got, want):  # another rounding than the codec's: one code step at most
            x64 = x.cpu().double()
            if ratio(got, x64, entry_bound(fmt.name, x64)) > 1:
                raise AssertionError(
                    f"{spec.kind}: entries do not round-trip in a {spec.page_bytes} B page"
                )
        pad = cache[:, fmt.min_page_bytes :]
        if pad.numel() and not bool((pad == 0xFF).all()):
            raise AssertionError(f"{spec.kind}: page padding was written")
    sizes = ", ".join(f"{b.name} {b.page_bytes} B" for b in buckets)
    return f"{len(buckets)} page sizes ({sizes}); entries round-trip in every KV page"


def _sync(mod) -> None:
    if mod is not None:
        mod.synchronize()


def stream_rows(device: torch.device, caps, heavy: bool) -> list[dict]:
    """Two independent matmul chains on ``AuxStreams`` branches: with streams (parallel) they must
    finish sooner than one after the other (serial), with identical results."""
    mod = stream_module(device.type) if caps.streams else None
    if mod is None:
        return [
            dict(
                check="streams",
                case="two-branch overlap",
                ok=None,
                detail=f"skipped: {device.type} has no streams (branches run inline, in order)",
            )
        ]
    try:
        n, k = (256, 4096) if heavy else (128, 2048)
        a = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
        w = torch.randn(k, k, device=device, dtype=torch.bfloat16) * k**-0.5
        # A branch = a fixed-length single-block spin kernel (where the device module has one:
        # torch.cuda._sleep) + a few small matmuls. The spin occupies one SM for ~1 ms, so the
        # measurement is not drowned by launch overhead and the overlap is unambiguous; the
        # matmuls check that the branches' results do not depend on the schedule.
        spin = getattr(mod, "_sleep", None)
        cycles = 2_000_000

        def chain(x):
            if spin is not None:
                spin(cycles)
            for _ in range(4 if spin is not None else 16):
                x = (x @ w).clamp_(-1, 1)
            return x

        serial_aux = AuxStreams(device, 2, enabled=False)
        par_aux = AuxStreams(device, 2, enabled=True)
        if not par_aux.parallel:
            return [
                dict(
                    check="streams",
                    case="two-branch overlap",
                    ok=False,
                    detail="AuxStreams did not create streams on this device",
                )
            ]

        def run(aux):
            outs = []
            for i in range(2):
                with aux.branch(i, keep_alive=(a[i],)):
                    outs.append(chain(a[i]))
            aux.join()
            return outs

        def timed(aux, reps=20):
            for _ in range(3):
                run(aux)
            _sync(mod)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run(aux)
                _sync(mod)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e3

        ser, par = timed(serial_aux), timed(par_aux)
        same = all(torch.equal(x, y) for x, y in zip(run(serial_aux), run(par_aux)))
        _sync(mod)
        ok = bool(same and par < ser)
        return [
            dict(
                check="streams",
                case="two-branch overlap",
                ok=ok,
                detail=f"serial {ser:.3f} ms, parallel {par:.3f} ms "
                f"({ser / par:.2f}x), results equal={same}; per branch: "
                + (f"{cycles:.0e}-cycle spin kernel + 4" if spin is not None else "16")
                + f" matmuls [{n}x{k}] @ [{k}x{k}] bf16",
            )
        ]
    except Exception as exc:
        return [
            dict(
                check="streams",
                case="two-branch overlap",
                ok=False,
                detail=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
            )
        ]
