# SPDX-License-Identifier: Apache-2.0
"""Worker of the ahead-of-time target matrix (``test_target_matrix.py``): compile recorded launches
for one target and print one ``RESULTS<json>`` line. Run as ``python -m tests.aot.compile_launches
RECORDS.json BACKEND ARCH WARP SHARED_LIMIT`` without ``TRITON_INTERPRET`` (under the interpreter the kernels
are not compilable JIT functions).

Each record is rebuilt as Triton's own ``ASTSource`` (the kernel object from its module, the
recorded signature, constexprs and divisibility attributes) and compiled with the recorded
``num_warps`` / ``num_stages`` for the target: every stage down to the device binary (cubin with
Triton's bundled ptxas; hsaco for AMD). The result keeps the kernel's shared memory.
"""

from __future__ import annotations

import importlib
import json
import re
import sys


def kernel_fn(record: dict):
    """The JIT function of a record, found by its op family (``ops.triton.<family>``: a module,
    or a sub-package whose modules are searched) and kernel name, so that moving a kernel between
    the files of its family changes no record."""
    fam = importlib.import_module(f"vllm_dsv4_hw.ops.triton.{record['family']}")
    if hasattr(fam, record["kernel"]):
        return getattr(fam, record["kernel"])
    found = [
        getattr(m, record["kernel"]) for m in _family_modules(fam) if hasattr(m, record["kernel"])
    ]
    found = list({id(f): f for f in found}.values())
    if len(found) != 1:
        raise KeyError(f"{len(found)} kernels named {record['kernel']} in {record['family']}")
    return found[0]


def _family_modules(package) -> list:
    import pkgutil

    return [
        importlib.import_module(f"{package.__name__}.{m.name}")
        for m in pkgutil.iter_modules(getattr(package, "__path__", []))
    ]


def family_of(module: str) -> str:
    """``vllm_dsv4_hw.ops.triton.<family>[.<file>]`` -> ``<family>``."""
    return module.split("vllm_dsv4_hw.ops.triton.", 1)[1].split(".")[0]


def unique(records: list[dict]) -> list[dict]:
    """One record per (kernel, signature, constexprs, launch options): the divisibility
    attributes of the runtime ints only change vectorization, not what a target accepts."""
    seen, out = set(), []
    for r in records:
        key = json.dumps(
            [
                r["family"],
                r["kernel"],
                r["signature"],
                r["constexprs"],
                r["num_warps"],
                r["num_stages"],
            ],
            sort_keys=True,
        )
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def for_backend(record: dict, backend: str, arch: str = "90") -> dict:
    """The record as the target's device would launch it: a ROCm device declares no inline PTX,
    so its e4m3 decode is the hardware cvt (``ops.triton.ptx_codecs.e4m3_mode``); programmatic
    dependent launch (``PDL``) where the target's declared capabilities have it (sm_90+), so the
    griddepcontrol instructions are compiled for every target that takes them; the hardware e4m3
    encode (``HW_ENC``) where the target declares ``fp8_cvt`` (sm_89+, ROCm)."""
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_PTX
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    c = record["constexprs"]
    if backend == "hip" and c.get("CVT") == CVT_PTX:
        c = dict(c, CVT=CVT_HW)
    major, minor = divmod(int(arch), 10) if backend == "cuda" else (9, 0)
    caps = cuda_capabilities(major, minor, hip=backend == "hip")
    if "PDL" in c:
        c = dict(c, PDL=caps.pdl)
    if "PF_BYTES" in c and not caps.pdl:  # the weight prefetch happens before a PDL wait only
        c = dict(c, PF_BYTES=0)
    if "HW_ENC" in c:
        c = dict(c, HW_ENC=caps.fp8_cvt)
    return dict(record, constexprs=c)


def forced_decode(record: dict, backend: str) -> bool:
    """A launch with an e4m3 decode the target never selects: the GPU tier also runs the FP8
    GEMM and the fp8 sparse attention with the integer decode and the hardware cvt on purpose
    (to compare them bit for bit); a CUDA part launches the packed PTX decode, ROCm the cvt."""
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_PTX
    from vllm_dsv4_hw.ops.triton.common.quant import FMT_FP8_DS_MLA

    c = record["constexprs"]
    decodes = record["kernel"] == "_fp8_block_linear_kernel" or (
        record["kernel"] == "_sparse_attn_fwd" and c.get("FMT") == FMT_FP8_DS_MLA
    )
    if not decodes or "CVT" not in c:
        return False
    return c["CVT"] != (CVT_HW if backend == "hip" else CVT_PTX)


FP8_DOT_KERNELS = ("_w8a8_block_linear_kernel", "_quantize_kernel")


def needs_fp8_dot(record: dict) -> bool:
    """A launch of the W8A8 GEMM (``ops.triton.fp8_dot_linear``), of its GEMV
    (``ops.triton.fp8_gemv``: taken only where ``fp8_block_linear`` quantizes x) or of the
    indexer's score pass on FP8 dots (``DOT_FP8``, an e4m3 query): only devices declaring
    ``fp8_dot`` take it (CUDA sm_89+, not ROCm, whose gfx942 e4m3 is the fnuz variant)."""
    from vllm_dsv4_hw.ops.triton.indexer.score import DOT_FP8

    if record["kernel"] == "_indexer_score_kernel":
        return record["constexprs"].get("DOT") == DOT_FP8
    if record["kernel"] == "_gemv_kernel":
        return True
    return record["family"] == "linear" and record["kernel"] in FP8_DOT_KERNELS


def selected_on(record: dict, limit: int) -> bool:
    """Whether a target with ``limit`` bytes of shared memory per block launches this recorded
    H200 launch: the tiles the product takes only where the declared shared memory holds them
    (the FP8 GEMM's prefill tile, sparse attention's full-device tiles) are not its launches, so
    they are not compiled for it."""
    from vllm_dsv4_hw.ops.triton.common.quant import FMT_BF16, FMT_FP8_DS_MLA
    from vllm_dsv4_hw.ops.triton.linear import block as fp8_linear
    from vllm_dsv4_hw.ops.triton.sparse_attention import launch as sal

    c = record["constexprs"]
    if record["kernel"] == "_fp8_block_linear_kernel":
        tile = fp8_linear.PREFILL_TILE
        return not (
            (c["BM"], c["BN"]) == (tile["block_m"], tile["block_n"])
            and limit < fp8_linear.PREFILL_TILE_SHARED
        )
    if record["kernel"] == "_sparse_attn_fwd":
        fmt = {FMT_BF16: "bf16", FMT_FP8_DS_MLA: "fp8_ds_mla"}.get(c["FMT"])
        for (_, name), choices in sal.FULL_DEVICE_TILES.items():
            for choice in choices:
                tiles, needs = choice.tiles, choice.needs(bool(c.get("DOT_BF16", True)))
                if (
                    name == fmt
                    and (needs is None or needs > limit)
                    and (c["BLOCK_H"], c["BLOCK_N"], record["num_stages"])
                    == (tiles["block_h"], tiles["block_n"], tiles.get("num_stages", 1))
                ):
                    return False
    return True


def with_new_defaults(record: dict, fn) -> dict:
    """The record with the constexpr parameters added to its kernel since it was recorded that
    have a default, at that default: a launch that leaves such a knob at its default is the
    recorded one (a knob added off, such as ``FLAT``). Any other difference stays
    drift (a renamed, removed or required parameter)."""
    import inspect

    params = inspect.signature(fn.fn).parameters
    added = {
        n: p.default
        for n, p in params.items()
        if n not in record["signature"]
        and p.default is not inspect.Parameter.empty
        and "constexpr" in str(p.annotation)
    }
    if not added:
        return record
    return dict(
        record,
        signature=dict(record["signature"], **{n: "constexpr" for n in added}),
        constexprs=dict(record["constexprs"], **added),
    )


# knobs built and off by default: each target also compiles one recorded launch of the kernel
# with the knob on (``PF_BYTES`` only where the target has PDL: it is dead code elsewhere). The
# GEMMs' read-ahead (``PF_BYTES``) is on by default since 2026-12-05: the native records carry it.
OFF_BY_DEFAULT: dict[str, dict] = {}  # none: a variant is timed and kept, or deleted

# Kernels added since the launches were recorded (no GPU lent to record them): their product
# launches written out here as records (with ``needs``: the declared capability that takes
# them), compiled like recorded ones, until the next GPU tier records them (then drop them here
# and from ``test_target_matrix.NOT_RECORDED``). None now: the 2026-12-06 H200 tier recorded
# the GEMV's.
SYNTHESIZED: list[dict] = []


def synthesized_for(backend: str, arch: str) -> list[dict]:
    """The ``SYNTHESIZED`` launches a target takes: those whose declared capability it has
    (the GEMV only where ``fp8_block_linear`` quantizes x: ``fp8_dot``)."""
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    major, minor = divmod(int(arch), 10) if backend == "cuda" else (9, 0)
    caps = cuda_capabilities(major, minor, hip=backend == "hip")
    return [r for r in SYNTHESIZED if getattr(caps, r["needs"])]


def knobs_on(records: list[dict]) -> list[dict]:
    """For each kernel of ``OFF_BY_DEFAULT``, its first record with the knobs on (PF_BYTES only
    in records with PDL on)."""
    out = []
    for kernel, knobs in OFF_BY_DEFAULT.items():
        for r in records:
            c = r["constexprs"]
            if r["kernel"] == kernel and ("PF_BYTES" not in knobs or c.get("PDL")):
                out.append(
                    dict(
                        r,
                        constexprs=dict(c, **knobs),
                        signature=dict(r["signature"], **{k: "constexpr" for k in knobs}),
                    )
                )
                break
    return out


def compile_record(record: dict, target):
    """``record`` compiled for ``target`` (a ``GPUTarget``) as Triton's own ``ASTSource``: the
    kernel from its module, the recorded signature, constexprs (those added since at their
    defaults) and divisibility attributes, ``num_warps`` / ``num_stages``. Raises on drift."""
    import triton
    from triton.compiler import ASTSource

    fn = kernel_fn(record)
    names = fn.arg_names
    r = with_new_defaults(record, fn)
    drift = sorted(set(names) ^ set(r["signature"]))
    if drift:
        raise KeyError(f"arguments changed since the launches were recorded: {drift}")
    attrs = {(names.index(k),): [tuple(a) for a in v] for k, v in r["attrs"].items() if v}
    return triton.compile(
        ASTSource(fn, r["signature"], constexprs=r["constexprs"], attrs=attrs),
        target=target,
        options={"num_warps": r["num_warps"], "num_stages": r["num_stages"]},
    )


def main(path: str, backend: str, arch: str, warp: str, limit: str) -> None:
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, int(warp))
    results = []
    records = [
        for_backend(r, backend, arch)
        for r in json.load(open(path))["launches"] + synthesized_for(backend, arch)
    ]
    chosen = [
        r
        for r in records
        if not forced_decode(r, backend)
        and selected_on(r, int(limit))
        and not (backend == "hip" and needs_fp8_dot(r))
    ]
    for r in unique(chosen) + knobs_on(chosen):
        name = f"{r['family']}.{r['kernel']}"
        row = {
            "kernel": name,
            "constexprs": r["constexprs"],
            "num_warps": r["num_warps"],
            "num_stages": r["num_stages"],
            "error": None,
            "shared": None,
            "pdl": None,
            "trap": None,
        }
        try:
            kernel = compile_record(r, target)
            row["shared"] = int(kernel.metadata.shared)
            ptx = kernel.asm.get("ptx", "")
            row["pdl"] = "griddepcontrol.wait" in ptx
            # compiled, but to nothing that can write: the body folded into a trap
            row["trap"] = "trap;" in ptx and not re.search(r"\b(st|atom|red)\.", ptx)
        except Exception as exc:  # report every failure, not just the first
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        results.append(row)
    print("RESULTS" + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:6])
