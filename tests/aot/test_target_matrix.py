# SPDX-License-Identifier: Apache-2.0
"""Every Triton kernel of the package compiled ahead of time for each GPU target, with the launch
options the product really uses, on a machine without a GPU.

The launches are recorded on the H200 by the GPU tier (``DSV4_RECORD_LAUNCHES``,
``tests/gpu/launches.py``): every kernel specialization the tier compiled, natively
(``launches-h200-native.json``: sm_89+ paths, hardware e4m3 conversion, the packed PTX decode in
the FP8 GEMM) and with ``VLLM_DSV4_HW_CUDA_CAPABILITY=8.0`` (``launches-h200-declared-sm80.json``:
what an sm_80 / sm_86 part launches, integer e4m3 paths). ROCm targets compile the native set with
the hardware cvt where the record has the PTX decode (``compile_launches.for_backend``). Each target compiles the set its capability selects, down to
the device binary, and its shared memory must fit the target's per-block limit (Triton checks that
only when it loads a binary on the device). A kernel whose arguments changed since the recording,
or a launched kernel with no record, fails here: re-record on a GPU with
``DSV4_RECORD_LAUNCHES=tests/aot/launches-h200-native.json bash benchmarks/with_vllm.sh python3 -m
pytest -m gpu tests/gpu`` (and again with the declared capability for the sm_80 file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.aot import background
from tests.subprocess_scripts import HAS_PTXAS, ROOT

pytest.importorskip("triton")

HERE = Path(__file__).parent
NATIVE = HERE / "launches-h200-native.json"
SM80 = HERE / "launches-h200-declared-sm80.json"
KIB = 1024
# target -> (GPUTarget fields, launches, shared memory per block the target allows)
TARGETS = {
    "sm_80": (("cuda", "80", "32"), SM80, 163 * KIB),  # A100 / A800
    "sm_86": (("cuda", "86", "32"), SM80, 99 * KIB),  # RTX 3090, A5000, A40
    "sm_89": (("cuda", "89", "32"), NATIVE, 99 * KIB),  # L40, L20, RTX 4090
    "sm_90": (("cuda", "90", "32"), NATIVE, 227 * KIB),  # H100 / H200
    "sm_100": (("cuda", "100", "32"), NATIVE, 227 * KIB),  # B200
    "sm_120": (("cuda", "120", "32"), NATIVE, 99 * KIB),  # RTX 5090, RTX PRO 6000
    "gfx942": (("hip", "gfx942", "64"), NATIVE, 64 * KIB),  # MI300X (LDS)
    "gfx950": (("hip", "gfx950", "64"), NATIVE, 160 * KIB),  # MI355X (LDS)
}
# Launches whose compile folds the whole body into a trap on a target (Triton 3.9's sm_100
# lowering of the indexer's e4m3-query score pass with MXFP4 keys at 4 tokens a program: the
# LLVM IR is `llvm.trap`, no store), with the reason: asserted to still trap, so the entry goes
# when Triton compiles it. (target, kernel, constexprs the launch has) -> why it is tolerated.
KNOWN_TRAPS = {
    (
        "sm_100",
        "indexer._indexer_score_kernel",
        (("DOT", 3), ("FMT", 4), ("TB", 4)),
    ): "the e4m3 indexer query (VLLM_DSV4_HW_INDEXER_Q=e4m3/auto, off by default: slower on "
    "the H100) in prefill-sized calls; found 2026-12-06 when the H200 tier first recorded "
    "it; B200 unverified (no such GPU here)"
}


def _known_trap(target: str, row: dict) -> bool:
    return any(
        t == target and row["kernel"] == k and all(row["constexprs"].get(n) == v for n, v in c)
        for t, k, c in KNOWN_TRAPS
    )


# Kernels the GPU tier does not launch (so nothing recorded them), with the reason.
NOT_RECORDED = {
    "kv_cache._kv_gather_kernel": "kv_gather serves the conformance kit and tests, not the "
    "served layer; the GPU tier has no case for it"
}


@pytest.fixture(scope="module")
def compiled(request):
    """All targets' rows, from the compiles the session started in the background
    (``tests/aot/background.py``; these tests run last), or starts now."""
    jobs = background.start(request.config)
    return {t: jobs.result(t) for t in TARGETS}


@pytest.mark.skipif(not HAS_PTXAS, reason="Triton's bundled ptxas is not installed")
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_launch_compiles_for(target, compiled):
    rows = compiled[target]
    limit = TARGETS[target][2]
    failed = [
        f"{r['kernel']} {r['constexprs']} (num_warps {r['num_warps']}): {r['error']}"
        for r in rows
        if r["error"]
    ]
    over = [
        f"{r['kernel']} {r['constexprs']}: {r['shared']} B shared > {limit} B"
        for r in rows
        if r["shared"] is not None and r["shared"] > limit
    ]
    traps = [
        f"{r['kernel']} {r['constexprs']}" for r in rows if r["trap"] and not _known_trap(target, r)
    ]
    known = [r for r in rows if _known_trap(target, r)]
    kernels = {r["kernel"] for r in rows}
    print(
        f"\n{target}: {len(rows)} launches of {len(kernels)} kernels compiled, max shared "
        f"{max((r['shared'] or 0) for r in rows)} B of {limit}"
    )
    assert len(rows) >= 80 and len(kernels) >= 20, (len(rows), sorted(kernels))
    assert not failed, f"{len(failed)} of {len(rows)} launches failed:\n" + "\n".join(failed)
    assert not over, "\n".join(over)
    assert not traps, "compiled to a bare trap (no store left):\n" + "\n".join(traps)
    assert all(r["trap"] for r in known), "a KNOWN_TRAPS launch compiles now: drop its entry"
    assert bool(known) == any(t == target for t, _, _ in KNOWN_TRAPS), "stale KNOWN_TRAPS entry"
    # the knobs off by default compile too (compile_launches.OFF_BY_DEFAULT); the GEMMs' weight
    # read-ahead (on by default, in the native records) only where the target has PDL
    # the one-row GEMV only where fp8_block_linear quantizes x (fp8_dot: sm_89+, not ROCm)
    gemv = any(r["kernel"] == "linear._gemv_kernel" for r in rows)
    assert gemv == (target in ("sm_89", "sm_90", "sm_100", "sm_120")), (target, gemv)
    pf = [r for r in rows if r["constexprs"].get("PF_BYTES")]
    assert bool(pf) == (target in ("sm_90", "sm_100", "sm_120")), (target, len(pf))
    assert all(r["pdl"] for r in pf)


def test_targets_without_e4m3_conversion_take_the_integer_paths():
    """The sm_80 file holds no launch with the hardware e4m3 conversion switched on, the native
    one does (sm_80 / sm_86 have none); the FP8 GEMM and the fp8 sparse attention decode e4m3 with
    the packed PTX integer decode on every CUDA part (``ops.triton.ptx_codecs``), ROCm never
    (``compile_launches.for_backend``: the hardware cvt)."""
    from tests.aot.compile_launches import for_backend
    from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_HW, CVT_PTX

    def modes(path, kernel, backend="cuda"):
        return {
            for_backend(r, backend)["constexprs"]["CVT"]
            for r in json.loads(path.read_text())["launches"]
            if r["kernel"] == kernel
        }

    gemm, attn = "_fp8_block_linear_kernel", "_sparse_attn_fwd"
    assert CVT_HW not in modes(SM80, gemm) | modes(SM80, attn)
    # (the GPU tier also runs every decode on purpose: the weight of every e4m3 code)
    # (the integer decode appears too: the GPU tier runs it on purpose against the auto one)
    assert CVT_PTX in modes(SM80, gemm) and CVT_PTX in modes(NATIVE, gemm)
    assert CVT_PTX in modes(SM80, attn) and {CVT_PTX, CVT_HW} <= modes(NATIVE, attn)
    assert CVT_PTX not in modes(NATIVE, gemm, "hip") | modes(NATIVE, attn, "hip")


@pytest.mark.skipif(not HAS_PTXAS, reason="Triton's bundled ptxas is not installed")
def test_programmatic_dependent_launch_only_where_declared(compiled):
    """Every kernel waits for its predecessor (griddepcontrol.wait) on the targets whose declared
    capabilities take PDL (sm_90 / 100 / 120), and carries no such instruction for sm_80 / 86 /
    89 (which have none: the ptx would not assemble) or ROCm (no PTX at all)."""
    for target, rows in compiled.items():
        ok = [r for r in rows if not r["error"] and not _known_trap(target, r)]
        want = target in ("sm_90", "sm_100", "sm_120")
        wrong = sorted({r["kernel"] for r in ok if bool(r["pdl"]) != want})
        assert ok and not wrong, f"{target}: PDL {'missing' if want else 'present'} in {wrong}"


def _launched_kernels() -> set[str]:
    """``family.kernel`` for every @triton.jit function of ops/triton launched as
    ``kernel[grid](...)`` in its module (device helpers are called, not launched); the family is
    the module, or the sub-package that holds it."""
    out = set()
    base = ROOT / "vllm_dsv4_hw" / "ops" / "triton"
    for path in sorted(base.rglob("*.py")):
        src = path.read_text()
        jit = set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+)", src))
        family = path.relative_to(base).parts[0].removesuffix(".py")
        out |= {f"{family}.{k}" for k in jit if re.search(rf"\b{k}\[", src)}
    return out


def test_every_launched_kernel_is_recorded():
    recorded = set()
    for path in (NATIVE, SM80):
        launches = json.loads(path.read_text())["launches"]
        recorded |= {f"{r['family']}.{r['kernel']}" for r in launches}
    launched = _launched_kernels()
    assert len(launched) >= 20, launched
    missing = launched - recorded - set(NOT_RECORDED)
    assert not missing, (
        f"launched but never recorded on a GPU (re-record, see the docstring): {sorted(missing)}"
    )
    assert not set(NOT_RECORDED) & recorded, "recorded now: drop it from NOT_RECORDED"
    assert not recorded - launched, f"recorded kernels that are gone: {sorted(recorded - launched)}"
