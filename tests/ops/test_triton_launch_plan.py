# SPDX-License-Identifier: Apache-2.0
"""The Triton launch plans follow the device's declared capabilities (``ops/triton/common/launch.py``):
on a device with Ascend's limits (grid bound to the physical cores, at most ``max_grid`` programs)
no launch exceeds them and the results are the same bits as one unbounded launch; tl.dot
dimensions are padded up to ``dot_min``. The capabilities are swapped on the CPU device (the
kernels run under the Triton interpreter), so the NPU plans are exercised here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.ops.test_moe_experts import make_case  # noqa: E402
from vllm_dsv4_hw.ops import tuning  # noqa: E402
from vllm_dsv4_hw.ops.triton.common import launch  # noqa: E402
from vllm_dsv4_hw.ops.triton.indexer import score as indexer  # noqa: E402
from vllm_dsv4_hw.ops.triton.indexer.select import indexer_topk  # noqa: E402
from vllm_dsv4_hw.ops.triton.linear import block as fp8_linear  # noqa: E402
from vllm_dsv4_hw.ops.triton.linear import fp8_block_linear as fp8_op  # noqa: E402
from vllm_dsv4_hw.ops.triton.moe import grouped as moe  # noqa: E402
from vllm_dsv4_hw.platform.capabilities import CPU, NPU_A2_A3  # noqa: E402
from vllm_dsv4_hw.quant.formats import quantize_fp8_block  # noqa: E402

CPU_DEV = torch.device("cpu")


@pytest.fixture
def caps(monkeypatch):
    """Set the capabilities the launch plans see for the CPU device."""

    def use(**changes):
        monkeypatch.setattr(
            launch, "capabilities", lambda device: dataclasses.replace(CPU, **changes)
        )

    return use


class Recorder:
    """Stands for a @triton.jit kernel: records each launch's grid size, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(int(torch.tensor(grid).prod()))
        return self.kernel[grid]


def test_npu_declares_its_limits():
    assert NPU_A2_A3.grid_cores and NPU_A2_A3.max_grid == 65535 and NPU_A2_A3.dot_min == 16
    assert not NPU_A2_A3.fp8 and not NPU_A2_A3.fp64


def test_program_cap_binds_to_the_cores(caps, monkeypatch):
    cores = {True: 20, False: 40}  # AI (cube) and vector cores of an A2-class part
    monkeypatch.setattr(launch, "physical_cores", lambda device, cube: cores[cube])
    caps(max_grid=65535, grid_cores=True)
    assert launch.program_cap(CPU_DEV, cube=True) == 20
    assert launch.program_cap(CPU_DEV) == 40
    assert launch.grid_limit(CPU_DEV) == 65535  # kernels without grid-stride loops
    monkeypatch.setattr(launch, "physical_cores", lambda device, cube: None)  # count unknown
    assert launch.program_cap(CPU_DEV) == 65535
    caps(max_grid=2**31 - 1, grid_cores=False)  # GPUs: the cores do not bound the grid
    assert launch.program_cap(CPU_DEV) == 2**31 - 1


def test_dot_dims_are_padded_to_the_smallest_dot(caps):
    caps(dot_min=16)
    assert [launch.dot_dim(n, CPU_DEV) for n in (1, 8, 16, 64)] == [16, 16, 16, 64]
    caps(dot_min=1)
    assert launch.dot_dim(8, CPU_DEV) == 8


def _indexer_case(gen, t=6, h=16, di=16, pages=3, e=8):
    from vllm_dsv4_hw.kv_cache import paged
    from vllm_dsv4_hw.kv_cache.formats.fp32 import FP32Format

    fmt = FP32Format(dim=di, entries_per_page=e)
    cache = fmt.new_cache(pages)
    paged.insert(cache, torch.arange(pages * e), torch.randn(pages * e, di, generator=gen), fmt)
    bt = torch.arange(pages, dtype=torch.int32).repeat(2, 1)
    return (
        torch.randn(t, h, di, generator=gen),
        torch.rand(t, h, generator=gen),
        cache,
        fmt,
        bt,
        torch.tensor([0, 0, 1, 1, -1, 1]),
        torch.tensor([3, 40, 17, 95, 9, 60]),
    )


@pytest.mark.parametrize("select", ["torch", "radix"])
def test_indexer_on_few_programs_matches_one_per_unit(caps, monkeypatch, gen, select):
    """Score and compaction kernels grid-strided over 3 programs: the same scores and selection
    as with one program per unit; K = di/2 = 8 padded to 16 (the dots see zero pairs)."""
    q, w, cache, fmt, bt, req, pos = _indexer_case(gen)
    outs = {}
    for cap in (None, 3):
        caps() if cap is None else caps(max_grid=cap)
        rec = Recorder(indexer._select_compact_kernel)
        monkeypatch.setattr(indexer, "_select_compact_kernel", rec)
        scores = indexer.indexer_scores(q, w, cache, fmt, bt, req, pos, 4)
        with tuning.override(indexer=tuning.IndexerTuning(select=select)):
            outs[cap] = (scores, indexer_topk(q, w, cache, fmt, bt, req, pos, 5, 4))
        assert all(g <= (cap or 6) for g in rec.grids)
        assert rec.grids if select == "torch" else not rec.grids
    torch.testing.assert_close(outs[3][0], outs[None][0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(outs[3][1].sort(dim=1).values, outs[None][1].sort(dim=1).values)
    want = (
        (q[:, :, None, :] * paged_keys(cache, fmt, bt)[None, None]).sum(-1).relu() * w[:, :, None]
    ).sum(1)  # [t, entries], dense, before masking
    vis = torch.isfinite(outs[3][0])
    torch.testing.assert_close(outs[3][0][vis], want[vis], rtol=1e-5, atol=1e-5)
    assert int(vis.sum()) > 0 and not vis[4].any()  # the request -1 token sees nothing


def paged_keys(cache, fmt, bt):
    from vllm_dsv4_hw.kv_cache import paged

    n = bt.shape[1] * fmt.entries_per_page
    return paged.gather(cache, torch.arange(n), fmt)


def test_moe_over_the_grid_bound_launches_by_tokens(caps, monkeypatch, gen):
    t, k, n_exp, d, inter = 9, 2, 4, 64, 32
    args = make_case(gen, t, k, n_exp, d, inter, torch.float32, torch.float32)
    want = moe.grouped_experts(*args, None)
    cap = moe._programs(t, k, n_exp, inter, d) - 1  # one program short of one launch
    caps(max_grid=cap)
    rec = Recorder(moe._moe_down_kernel)
    monkeypatch.setattr(moe, "_moe_down_kernel", rec)
    got = moe.grouped_experts(*args, None)
    assert len(rec.grids) > 1 and max(rec.grids) <= cap
    one_token = moe._programs(1, k, n_exp, inter, d)
    assert torch.equal(got, want)
    caps(max_grid=one_token - 1)
    with pytest.raises(ValueError, match="over the device's grid bound"):
        moe.grouped_experts(*args, None)


def test_fp8_linear_over_the_grid_bound_launches_by_rows(caps, monkeypatch, gen):
    m, n, k = 70, 96, 64
    w, s = quantize_fp8_block(torch.randn(n, k, generator=gen), 32)
    x = torch.randn(m, k, generator=gen)
    want = fp8_op.fp8_block_linear(x, w, s, (32, 32), block_n=32, block_m=16)
    caps(max_grid=7)  # 3 column tiles: 2 row blocks of 16 per launch
    rec = Recorder(fp8_linear._fp8_block_linear_kernel)
    monkeypatch.setattr(fp8_linear, "_fp8_block_linear_kernel", rec)
    got = fp8_op.fp8_block_linear(x, w, s, (32, 32), block_n=32, block_m=16)
    assert len(rec.grids) == 3 and max(rec.grids) <= 7
    assert torch.equal(got, want)
    caps(max_grid=2)
    with pytest.raises(ValueError, match="exceed the device's grid bound 2"):
        fp8_op.fp8_block_linear(x, w, s, (32, 32), block_n=32)


def test_programmatic_dependent_launch_where_declared(monkeypatch):
    """``pdl_launch`` turns PDL on only for CUDA devices whose declared capabilities have it
    (sm_90+; not sm_80 / 89 nor ROCm) and while ``VLLM_DSV4_HW_PDL`` is on."""
    from vllm_dsv4_hw.ops.triton.common import pdl
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    cuda = torch.device("cuda", 0)
    for (major, minor, hip), want in (
        ((9, 0, False), True),
        ((10, 0, False), True),
        ((12, 0, False), True),
        ((8, 0, False), False),
        ((8, 9, False), False),
        ((9, 4, True), False),
    ):
        caps = cuda_capabilities(major, minor, hip)
        monkeypatch.setattr(pdl, "capabilities", lambda device, caps=caps: caps)
        pdl._pdl_on.cache_clear()  # decided once per device
        assert pdl.pdl_launch(cuda) == ({"PDL": True, "launch_pdl": True} if want else {})
        assert pdl.pdl_launch(CPU_DEV) == {}  # the interpreter: never
    monkeypatch.setattr(pdl, "capabilities", lambda device: cuda_capabilities(9, 0))
    monkeypatch.setenv("VLLM_DSV4_HW_PDL", "0")
    pdl._pdl_on.cache_clear()
    assert pdl.pdl_launch(cuda) == {}
    pdl._pdl_on.cache_clear()  # nothing cached for later tests


def test_weight_prefetch_only_before_a_pdl_wait(monkeypatch):
    """A GEMM asks L2 for its weight rows before the wait only where it waits (PDL on): the
    setting's bytes there, 0 on devices without PDL, with PDL off and in the interpreter."""
    from vllm_dsv4_hw.ops.triton.common import pdl
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    cuda = torch.device("cuda", 0)

    def case(major, pdl_env, prefetch_env):
        monkeypatch.setattr(pdl, "capabilities", lambda device: cuda_capabilities(major, 0))
        monkeypatch.setenv("VLLM_DSV4_HW_PDL", pdl_env)
        monkeypatch.setenv("VLLM_DSV4_HW_WEIGHT_PREFETCH", prefetch_env)
        pdl._pdl_on.cache_clear()
        pdl._prefetch_bytes.cache_clear()
        return pdl.weight_prefetch(cuda)["PF_BYTES"], pdl.weight_prefetch(CPU_DEV)["PF_BYTES"]

    try:
        monkeypatch.delenv("VLLM_DSV4_HW_WEIGHT_PREFETCH", raising=False)
        monkeypatch.setattr(pdl, "capabilities", lambda device: cuda_capabilities(9, 0))
        monkeypatch.setenv("VLLM_DSV4_HW_PDL", "1")
        pdl._pdl_on.cache_clear()
        pdl._prefetch_bytes.cache_clear()
        assert pdl.weight_prefetch(cuda)["PF_BYTES"] == 256  # the default (H100, 2026-12-05)
        assert case(9, "1", "384") == (384, 0)
        assert case(9, "1", "0") == (0, 0)
        assert case(9, "0", "384") == (0, 0)
        assert case(8, "1", "384") == (0, 0)
    finally:
        pdl._pdl_on.cache_clear()
        pdl._prefetch_bytes.cache_clear()


def _index_math(stmt) -> bool:
    """An assignment that only computes indices or pointers (no load, store or other call than
    ``tl.program_id`` / ``tl.arange`` / ``.to``): what a GEMM may compute before its wait."""
    import ast

    if not isinstance(stmt, ast.Assign):
        return False
    for node in ast.walk(stmt.value):
        if isinstance(node, ast.Call):
            f = node.func
            if not (
                isinstance(f, ast.Attribute)
                and f.attr in ("program_id", "arange", "to", "minimum", "maximum")
            ):
                return False
    return True


def _weight_read_ahead(stmt):
    """``if KNOB: t = _w_tile(w_rows, ...)``: a GEMM's first weight tile, read before the wait
    (no kernel writes a weight), behind a constexpr knob."""
    import ast

    return (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Name)
        and not stmt.orelse
        and all(
            isinstance(s, ast.Assign)
            and isinstance(s.value, ast.Call)
            and getattr(s.value.func, "id", "") == "_w_tile"
            and getattr(s.value.args[0], "id", "") == "w_rows"
            for s in stmt.body
        )
    )


def _first_after_preamble(src: str) -> str:
    """A kernel's first statement after its docstring, index math and weight read-ahead."""
    import ast

    body = ast.parse(src).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    while _index_math(body[0]) or _weight_read_ahead(body[0]):
        body = body[1:]  # indices, pointers, the weight's tile
    return ast.unparse(body[0])


def test_pdl_preamble_check_catches_a_read_before_the_wait():
    """The check above is not vacuous: an activation load, a store or an unguarded tile read
    before the wait is what it reports."""
    head = "def k(x_ptr, w_ptr, PDL: tl.constexpr):\n    pid = tl.program_id(0)\n"
    wait = "    pdl_start(PDL)\n"
    assert _first_after_preamble(head + wait) == "pdl_start(PDL)"
    ahead = "    if AHEAD:\n        wq = _w_tile(w_rows, r_ok, 0, K, BK)\n"
    assert _first_after_preamble(head + ahead + wait) == "pdl_start(PDL)"
    for bad in (
        "    x = tl.load(x_ptr + pid)\n",
        "    tl.store(w_ptr, 0)\n",
        "    if AHEAD:\n        xq = _w_tile(x_ptr, r_ok, 0, K, BK)\n",
        "    wq = _w_tile(w_rows, r_ok, 0, K, BK)\n",
    ):
        assert _first_after_preamble(head + bad + wait) != "pdl_start(PDL)", bad


def test_every_kernel_launched_with_pdl_waits_first():
    """A kernel launched with PDL may start while its predecessor still runs: every launch site
    of ops/triton passes ``**pdl_launch(...)`` and every kernel so launched has the ``PDL``
    constexpr and begins with ``pdl_start(PDL)`` (after its docstring), before any memory op;
    a GEMM may first compute its indices, read its first weight tile (behind a constexpr knob)
    and ask L2 for its weight rows (``pdl_start_prefetching``): no earlier kernel writes a
    weight."""
    import ast
    import importlib
    import inspect
    import textwrap
    from pathlib import Path

    root = Path(launch.__file__).parent.parent  # ops/triton (launch lives in common/)
    checked = 0
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        launched = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
            ):
                pdl_kw = any(
                    k.arg is None
                    and isinstance(k.value, ast.Call)
                    and getattr(k.value.func, "id", "") == "pdl_launch"
                    for k in node.keywords
                )
                launched.setdefault(node.func.value.id, []).append(pdl_kw)
        rel = path.relative_to(root).with_suffix("").parts
        rel = rel[:-1] if rel[-1] == "__init__" else rel
        mod = importlib.import_module(".".join(("vllm_dsv4_hw.ops.triton",) + rel))
        for name, sites in launched.items():
            fn = getattr(mod, name, None)
            if not (hasattr(fn, "arg_names") and hasattr(fn, "fn")):  # a @triton.jit kernel
                continue
            assert all(sites), f"{path.stem}.{name}: a launch without **pdl_launch(...)"
            assert "PDL" in fn.arg_names, f"{path.stem}.{name} has no PDL constexpr"
            first = _first_after_preamble(textwrap.dedent(inspect.getsource(fn.fn)))
            assert first == "pdl_start(PDL)" or first.startswith(
                "pdl_start_prefetching(PDL, PF_BYTES, w_rows"
            ), f"{path.stem}.{name} starts with {first!r}"
            checked += 1
    assert checked >= 25, checked


def test_host_integer_helpers_match_triton():
    """``launch.cdiv`` / ``launch.next_pow2`` (plain Python: Triton's are constexpr functions,
    2-3 us a host call) give Triton's values."""
    import triton

    from vllm_dsv4_hw.ops.triton.common.launch import cdiv, next_pow2

    for a in [0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 1000, 2**20 + 1, 2**31 + 5]:
        assert next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 64, 128, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
