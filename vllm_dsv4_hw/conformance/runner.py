# SPDX-License-Identifier: Apache-2.0
"""Run the conformance kit on one device: ops x backends, cache layouts, page buckets, streams.

Which backends run for an op: the one the dispatcher selects on the device (``VLLM_DSV4_HW_*``
overrides apply, as in production), plus -- with ``backends="all"`` -- every other registered
backend that can run there (``ops/backends.py``) and whose required capabilities the device has.
On the CPU without ``TRITON_INTERPRET=1`` that is the reference alone; with it, the Triton kernels
run too (interpreted: slow, use ``--shapes small``).
"""

from __future__ import annotations

import datetime
import logging
import platform
import re
import time
from typing import Callable

import torch

from vllm_dsv4_hw.conformance import cases as C
from vllm_dsv4_hw.conformance import system

logger = logging.getLogger(__name__)

DEVICE_RE = re.compile(r"(cpu|cuda|npu)(?::(\d+))?")
# device-level checks that --ops can name besides the ops (they run by default)
SYSTEM_CHECKS = ("buckets", "streams")


class ConformanceSetupError(RuntimeError):
    """The device cannot be used (absent, driver missing) or an argument is invalid."""


def parse_device(spec: str) -> torch.device:
    m = DEVICE_RE.fullmatch(spec.strip())
    if not m:
        raise ConformanceSetupError(
            f"--device {spec!r}: use cpu, cuda or npu, optionally with :N (e.g. cuda:0)"
        )
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConformanceSetupError("--device cpu takes no index other than 0")
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConformanceSetupError(
                f"--device cuda: no CUDA device is visible to torch {torch.__version__}"
            )
        i = int(index or 0)
        if i >= torch.cuda.device_count():
            raise ConformanceSetupError(
                f"--device cuda:{i}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        torch.cuda.set_device(i)
        return torch.device("cuda", i)
    from vllm_dsv4_hw.platform.npu import probe_torch_npu

    ok, why = probe_torch_npu()
    if not ok:
        raise ConformanceSetupError(f"--device npu: {why}")
    i = int(index or 0)
    torch.npu.set_device(i)  # type: ignore[attr-defined]
    return torch.device("npu", i)


def synchronize(device: torch.device) -> None:
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def poison_allocator(device: torch.device) -> None:
    """Fill freed blocks of the device's caching allocator with 0xFF, so an output the op leaves
    partly unwritten shows NaN (CUDA / NPU; CPU allocations come from malloc and are not poisoned,
    caches are poisoned explicitly on every device)."""
    if device.type == "cpu":
        return
    big = torch.empty(256 << 20, dtype=torch.uint8, device=device).fill_(0xFF)
    small = [
        torch.empty(512 << 10, dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(16)
    ]
    del big, small


def default_registry():
    from vllm_dsv4_hw.ops import REGISTRY

    return REGISTRY


def backends_for(registry, op: str, device_type: str, mode: str) -> tuple[list[str], str]:
    """(backends to run, selected-backend note)."""
    from vllm_dsv4_hw.ops.backends import backend_available, device_capabilities
    from vllm_dsv4_hw.ops.registry import BackendUnavailableError

    try:
        res = registry.resolve(op, device_type)
    except BackendUnavailableError as exc:
        return [], f"no backend: {' '.join(str(exc).split())}"
    names = [res.impl.backend]
    if mode == "all":
        caps = device_capabilities(device_type)
        for b, impl in sorted(registry.implementations(op).items()):
            if b in names:
                continue
            ok, _ = backend_available(b, device_type)
            if ok and all(caps.has(r) for r in impl.requires):
                names.append(b)
    return names, res.reason


def _versions() -> dict:
    from vllm_dsv4_hw.cli.info import versions

    return versions()


def run(
    device_spec: str,
    shapes: str = "small",
    backends: str = "all",
    ops: list[str] | None = None,
    seed: int | None = None,
    registry=None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Run the kit; returns the report dict (``summary``, ``results``, environment)."""
    from vllm_dsv4_hw.kv_cache.format_choice import choose_formats, supported_formats
    from vllm_dsv4_hw.ops import api
    from vllm_dsv4_hw.platform.device import adaptor_for

    if shapes not in C.SHAPES:
        raise ConformanceSetupError(f"--shapes {shapes!r}: use one of {', '.join(C.SHAPES)}")
    if backends not in ("all", "selected"):
        raise ConformanceSetupError(f"--backends {backends!r}: use all or selected")
    known = set(api.ALL_OPS) | set(SYSTEM_CHECKS)
    if ops:
        unknown = sorted(set(ops) - known)
        if unknown:
            raise ConformanceSetupError(
                f"--ops: unknown op(s) {unknown}; ops: {', '.join(sorted(known))}"
            )
    device = parse_device(device_spec)
    registry = registry if registry is not None else default_registry()
    adaptor = adaptor_for(device.type)
    caps = adaptor.capabilities
    seed = int(time.time() * 1000) % 1_000_000 if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    choice = choose_formats(device.type, "auto", "auto", caps=caps, log=False)
    ctx = C.Ctx(
        device=device,
        caps=caps,
        dims=C.SHAPES[shapes],
        gen=gen,
        main_fmt=choice.main,
        indexer_fmt=choice.indexer,
        main_formats=supported_formats("main", caps),
        indexer_formats=supported_formats("indexer", caps),
    )
    started = time.time()
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    covered = {
        "layouts": (api.KV_INSERT, api.KV_GATHER),
        "compressor": (api.COMPRESSOR_POOL, api.COMPRESSOR_STORE),
        "mhc": (api.HC_PRE, api.HC_SEAM, api.HC_POST),
    }
    plans: dict[str, tuple[list[str], str]] = {}
    for key, builder in C.BUILDERS.items():
        its_ops = covered.get(key, (key,))
        if ops is not None and not set(its_ops) & set(ops):
            continue
        lacking = [c for op in its_ops for c in C.OP_NEEDS.get(op, ()) if not caps.has(c)]
        if lacking:
            for op in its_ops:
                emit(
                    dict(
                        check=op,
                        backend="-",
                        case="-",
                        ok=None,
                        detail=(
                            f"skipped: device {device.type} lacks {', '.join(lacking)}; the model does "
                            f"not use {op} there"
                        ),
                    )
                )
            continue
        try:
            built = builder(ctx)
        except Exception as exc:
            logger.debug("building %s cases failed", key, exc_info=True)
            emit(
                dict(
                    check=key,
                    backend="-",
                    case="inputs",
                    ok=False,
                    detail=f"building the cases failed: {type(exc).__name__}: {exc}",
                )
            )
            continue
        for case in built:
            if ops is not None and case.op not in ops:
                continue
            if case.op not in plans:
                plans[case.op] = backends_for(registry, case.op, device.type, backends)
            names, why = plans[case.op]
            if not names:
                emit(dict(check=case.op, backend="-", case=case.name, ok=False, detail=why))
                continue
            impls = registry.implementations(case.op)
            for i, b in enumerate(names):
                poison_allocator(device)
                t0 = time.perf_counter()
                try:
                    ok, detail, r = case.run(impls[b].fn)
                    synchronize(device)
                except Exception as exc:
                    logger.debug("%s/%s raised", case.op, b, exc_info=True)
                    ok, detail, r = (
                        False,
                        f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                        None,
                    )
                ms = (time.perf_counter() - t0) * 1e3
                emit(
                    dict(
                        check=case.op,
                        backend=b,
                        selected=(i == 0),
                        case=case.name,
                        ok=ok,
                        detail=detail,
                        err_over_tol=r,
                        ms=round(ms, 3),
                        **({"selection": why} if i == 0 else {}),
                    )
                )
    if ops is None or "buckets" in ops:
        for row in system.bucket_rows(device, ctx.main_formats, ctx.indexer_formats, gen):
            emit(dict(backend="-", **row))
    if ops is None or "streams" in ops:
        for row in system.stream_rows(device, caps, heavy=(shapes == "real")):
            emit(dict(backend="-", **row))

    passed = sum(1 for r in rows if r["ok"] is True)
    failed = sum(1 for r in rows if r["ok"] is False)
    skipped = sum(1 for r in rows if r["ok"] is None)
    return {
        "tool": "vllm-dsv4-hw conformance",
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 2),
        "device": {
            "spec": device_spec,
            "type": device.type,
            "index": device.index,
            "name": _device_name(device, adaptor.name),
            "capabilities": {k: v for k, v in vars(caps).items() if k != "device_type"},
            "backend_order": list(adaptor.backend_order),
        },
        "formats": {
            "main": choice.main,
            "indexer": choice.indexer,
            "held_main": list(ctx.main_formats),
            "held_indexer": list(ctx.indexer_formats),
        },
        "shapes": shapes,
        "dims": vars(ctx.dims) | {"positions": list(ctx.dims.positions)},
        "backends": backends,
        "ops": ops or "all",
        "seed": seed,
        "host": platform.node(),
        "versions": _versions(),
        "summary": {"passed": passed, "failed": failed, "skipped": skipped, "ok": failed == 0},
        "results": rows,
    }


def _device_name(device: torch.device, fallback: str) -> str:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        if device.type == "npu":
            return str(torch.npu.get_device_name(device.index or 0))  # type: ignore[attr-defined]
    except Exception:
        pass
    return fallback if device.type != "cpu" else (platform.processor() or "cpu")
