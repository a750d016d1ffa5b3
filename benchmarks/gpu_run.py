# SPDX-License-Identifier: Apache-2.0
"""The whole GPU check and benchmark in one call (``make bench`` on a CUDA machine).

    python -m benchmarks.gpu_run [--out DIR] [--skip-bench] [--only fused,sparse_attention,...]

1. measures the two ceilings on this card (device-to-device copy bandwidth, bf16 matmul rate);
2. for every kernel module under ``benchmarks/gpu/`` runs ``check(device)`` (triton vs the reference
   op at the real dimensions, fresh random inputs, poisoned outputs) and ``bench(device)``
   (``triton.testing.do_bench`` medians vs the unfused PyTorch version and vs the floor);
3. captures the decode-path kernels in a CUDA graph and checks that replay equals eager;
4. checks that ``AuxStreams`` overlaps two independent branches on this device;
then prints a pass/fail table and a benchmark table, and writes ``gpu_run.json`` (and
``roofline.png`` when matplotlib is there) into ``--out`` (default ``$OUT`` or ``./out``).
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import platform
import sys
import time
import traceback

logger = logging.getLogger("gpu_run")

MODULES = ("fused", "sparse_attention", "indexer", "compressor", "weights", "mhc", "moe_ops")
HBM_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12


def measure_ceilings(torch) -> dict:
    import triton.testing

    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_tb_s = 2 * n / (ms * 1e-3) / 1e12
    src = dst = None  # free the 2 GiB before the matmul
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    tflops = 2 * m**3 / (ms * 1e-3) / 1e12
    return {"copy_tb_s": round(copy_tb_s, 3), "bf16_matmul_tflops": round(tflops, 1)}


def graph_check(torch) -> list[dict]:
    """Capture each decode-path op in a CUDA graph; replay on new inputs copied into the captured
    buffers must equal eager on the same inputs."""
    from benchmarks.gpu import graph_cases

    rows = []
    for name, make in graph_cases.CASES.items():
        try:
            ok, detail = graph_cases.run_case(torch, make)
        except Exception as exc:  # a capture failure is a failed check, not a crash of the run
            ok, detail = False, f"{type(exc).__name__}: {exc}"
            logger.debug(traceback.format_exc())
        rows.append({"check": f"cuda_graph/{name}", "ok": ok, "detail": detail})
    return rows


def streams_check(torch) -> list[dict]:
    """AuxStreams overlaps independent branches: two branches of spin kernels (one thread block
    each, ~0.2 ms) take about the time of one on aux streams, twice that inline."""
    from vllm_dsv4_hw.platform.streams import AuxStreams

    dev = torch.device("cuda")
    cycles = 400_000

    def run(aux):
        for i in range(2):
            with aux.branch(i):
                torch.cuda._sleep(cycles)
        aux.join()

    rows = []
    for name, aux in (
        ("inline", AuxStreams(dev, 2, enabled=False)),
        ("aux streams", AuxStreams(dev, 2, enabled=True)),
    ):
        run(aux)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            run(aux)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rows.append((name, sorted(times)[len(times) // 2], aux.parallel))
    (_, serial, _), (_, par, parallel) = rows
    return [
        {
            "check": "streams/overlap",
            "ok": bool(parallel and par < 0.75 * serial),
            "detail": f"two 400k-cycle spin branches: inline {serial:.3f} ms, "
            f"aux streams {par:.3f} ms (must be < 0.75x)",
        }
    ]


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_checks(rows: list[dict]) -> None:
    print("\n== checks ==")
    for r in rows:
        name = r.get("check") or "/".join(str(r[k]) for k in ("op", "case") if k in r)
        detail = r.get("detail") or ", ".join(
            f"{k}={_fmt(v)}"
            for k, v in r.items()
            if k not in ("op", "case", "ok", "module", "check")
        )
        print(f"{'PASS' if r.get('ok') else 'FAIL'}  {name}  {detail}"[:240])
    n_fail = sum(1 for r in rows if not r.get("ok"))
    print(f"{len(rows) - n_fail} passed, {n_fail} failed")


def print_bench(rows: list[dict]) -> None:
    print("\n== benchmarks (ms, medians) ==")
    cols = ("op", "case", "ref_ms", "ours_ms", "speedup", "floor_ms", "frac_of_floor")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c, "")) for c in cols))


def roofline_png(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    pts = [r for r in rows if r.get("ours_ms") and r.get("floor_ms")]
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(9, 6))
    for op in sorted({r["op"] for r in pts}):
        sel = [r for r in pts if r["op"] == op]
        ax.scatter([r["floor_ms"] for r in sel], [r["ours_ms"] for r in sel], label=op, s=18)
    lo = min(r["floor_ms"] for r in pts)
    hi = max(r["ours_ms"] for r in pts)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="at the floor")
    ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=1, label="2x the floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor: max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) [ms]")
    ax.set_ylabel("measured median [ms]")
    ax.set_title("vllm-dsv4-hw Triton kernels on H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--only", default=",".join(MODULES))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    if not torch.cuda.is_available():
        print("gpu_run: no CUDA device; run it on the GPU machine (make bench)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    import triton

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(),
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python -m benchmarks.gpu_run " + " ".join(argv or sys.argv[1:]),
        "ceilings": {},
        "checks": [],
        "bench": [],
    }
    t0 = time.time()
    report["ceilings"] = measure_ceilings(torch)
    logger.info("ceilings %s", report["ceilings"])
    for name in args.only.split(","):
        try:
            mod = importlib.import_module(f"benchmarks.gpu.{name}")
        except Exception as exc:
            report["checks"].append({"check": f"{name}/import", "ok": False, "detail": repr(exc)})
            continue
        for phase in ("check",) + (() if args.skip_bench else ("bench",)):
            logger.info("%s.%s ...", name, phase)
            try:
                rows = getattr(mod, phase)(dev)
            except Exception as exc:
                report["checks"].append(
                    {
                        "check": f"{name}/{phase}",
                        "ok": False,
                        "detail": f"{type(exc).__name__}: {exc}",
                    }
                )
                traceback.print_exc()
                continue
            for r in rows:
                r.setdefault("module", name)
            report["checks" if phase == "check" else "bench"].extend(rows)
            with open(os.path.join(args.out, "gpu_run.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
    for fn in (graph_check, streams_check):
        logger.info("%s ...", fn.__name__)
        try:
            report["checks"].extend(fn(torch))
        except Exception as exc:
            report["checks"].append(
                {"check": fn.__name__, "ok": False, "detail": f"{type(exc).__name__}: {exc}"}
            )
            traceback.print_exc()
    try:
        from benchmarks.gpu import timing

        report["launch_floor_ms"] = {n: timing.launch_floor_ms(dev, n) for n in (1, 2)}
        report["timing_modes"] = dict(timing.MODES)
    except Exception as exc:
        report["launch_floor_ms"] = repr(exc)
    report["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "gpu_run.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    roofline_png(report["bench"], os.path.join(args.out, "roofline.png"))
    print_bench(report["bench"])
    print(
        f"\nceilings: {report['ceilings']}  launch floor (graph replay of 1/2 empty kernels, ms): "
        f"{report.get('launch_floor_ms')}  timing modes: {report.get('timing_modes')}  "
        f"wall {report['wall_s']} s"
    )
    print_checks(report["checks"])
    return 1 if any(not r.get("ok") for r in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
