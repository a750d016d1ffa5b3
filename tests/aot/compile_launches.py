"""Worker of the ahead-of-time target matrix (``test_target_matrix.py``): compile recorded launches
for one target and print one ``RESULTS<json>`` line. Run as ``python -m tests.aot.compile_launches
RECORDS.json BACKEND ARCH WARP`` without ``TRITON_INTERPRET`` (under the interpreter the kernels
are not compilable JIT functions).

Each record is rebuilt as Triton's own ``ASTSource`` (the kernel object from its module, the
recorded signature, constexprs and divisibility attributes) and compiled with the recorded
``num_warps`` / ``num_stages`` for the target: every stage down to the device binary (cubin with
Triton's bundled ptxas; hsaco for AMD). The result keeps the kernel's shared memory.
"""

from __future__ import annotations

import importlib
import json
import sys


def unique(records: list[dict]) -> list[dict]:
    """One record per (kernel, signature, constexprs, launch options): the divisibility
    attributes of the runtime ints only change vectorization, not what a target accepts."""
    seen, out = set(), []
    for r in records:
        key = json.dumps([r["module"], r["kernel"], r["signature"], r["constexprs"],
                          r["num_warps"], r["num_stages"]], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def for_backend(record: dict, backend: str) -> dict:
    """The record as the target's device would launch it: a ROCm device declares no inline PTX,
    so its e4m3 decode is the hardware cvt (``ops.triton.ptx_codecs.e4m3_mode``)."""
    from vllm_dsv4_hw.ops.triton.ptx_codecs import CVT_HW, CVT_PTX

    if backend == "hip" and record["constexprs"].get("CVT") == CVT_PTX:
        record = dict(record, constexprs=dict(record["constexprs"], CVT=CVT_HW))
    return record


def main(path: str, backend: str, arch: str, warp: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, int(warp))
    results = []
    for r in unique(json.load(open(path))["launches"]):
        r = for_backend(r, backend)
        name = f"{r['module'].rsplit('.', 1)[-1]}.{r['kernel']}"
        row = {"kernel": name, "constexprs": r["constexprs"], "num_warps": r["num_warps"],
               "num_stages": r["num_stages"], "error": None, "shared": None}
        try:
            fn = getattr(importlib.import_module(r["module"]), r["kernel"])
            names = fn.arg_names
            drift = sorted(set(names) ^ set(r["signature"]))
            if drift:
                raise KeyError(f"arguments changed since the launches were recorded: {drift}")
            attrs = {(names.index(k),): [tuple(a) for a in v] for k, v in r["attrs"].items() if v}
            kernel = triton.compile(ASTSource(fn, r["signature"], constexprs=r["constexprs"],
                                              attrs=attrs), target=target,
                                    options={"num_warps": r["num_warps"],
                                             "num_stages": r["num_stages"]})
            row["shared"] = int(kernel.metadata.shared)
        except Exception as exc:  # report every failure, not just the first
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        results.append(row)
    print("RESULTS" + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:5])
