# SPDX-License-Identifier: Apache-2.0
"""The peer benchmark (benchmarks/peer): its verdicts and its --smoke path on CPU.

On CPU, vLLM's own kernels run under the Triton interpreter through the benchmark's shim, whose fp8
casts differ from the GPU's (ENVIRONMENT.md), so only our side's verdict is asserted end to end;
the upstream figures of record come from the H200 (docs/performance.md).
"""

from __future__ import annotations

import json
import math

from benchmarks.peer import upstream
from benchmarks.peer.__main__ import main
from benchmarks.peer.run import Row, markdown


def test_verdicts_follow_the_worst_part():
    r = Row("op", "case", ours_us=2.0, upstream_us=3.0)
    r.errors("a", 1e-3, 1e-3, tol=1e-2)
    r.errors("b", 5e-2, 1e-3, tol=1e-2)  # ours fails this part
    assert r.correct(1) is False and r.correct(2) is True
    assert math.isclose(r.ratio, 1.5)
    nan = Row("op", "case")
    nan.errors("a", float("nan"), None, tol=1.0)
    assert nan.correct(1) is False and nan.correct(2) is None
    table = markdown([r, Row("op", "mxfp4", ours_us=1.0, upstream_reason="needs sm_100")])
    assert "WRONG 5.0e-02 (b)" in table and "| ours only |" in table and "needs sm_100" in table


def test_missing_upstream_kernel_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setitem(upstream.KERNELS, "nope", ("vllm_dsv4_hw_no_such_module", "f"))
    try:
        upstream.kernel("nope")
    except upstream.Unavailable as exc:
        assert "vllm_dsv4_hw_no_such_module" in str(exc)
    else:
        raise AssertionError("an absent upstream module must raise Unavailable")


def test_missing_compiled_op_is_a_reason(monkeypatch):
    """An upstream call into a compiled op the installed vLLM lacks becomes Unavailable (the row
    keeps our figure and names the reason); any other failure of upstream still raises."""
    import sys
    import types

    mod = types.ModuleType("vllm_dsv4_hw_fake_upstream")

    def needs_c(x):
        import torch

        return torch.ops._C.vllm_dsv4_hw_no_such_op(x)

    def wrong(x):
        raise AttributeError("a plain bug")

    mod.needs_c, mod.wrong = needs_c, wrong
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(upstream.KERNELS, "needs_c", (mod.__name__, "needs_c"))
    monkeypatch.setitem(upstream.KERNELS, "wrong", (mod.__name__, "wrong"))
    row = Row("op", "case")
    row.time(lambda: None, lambda: upstream.kernel("needs_c")(1), "cpu")
    assert row.ours_us > 0 and row.upstream_us is None
    assert "vllm_dsv4_hw_no_such_op" in row.upstream_reason
    try:
        upstream.kernel("wrong")(1)
    except AttributeError as exc:
        assert "a plain bug" in str(exc)
    else:
        raise AssertionError("a failure that is not a missing compiled op must propagate")


def test_smoke_rows(tmp_path):
    rc = main(["--smoke", "--only", "kv_gather,indexer q prep", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "peer.json").read_text())["rows"]
    assert rc == 0
    assert {r["op"] for r in rows} == {"kv_gather", "indexer q prep"}
    for r in rows:
        assert r["ours_correct"] is True, r
        # upstream timed, or the reason it cannot run here named (a CPU wheel of vLLM may lack
        # the compiled op its CPU path of the indexer q prep calls)
        assert r["ours_us"] > 0 and ((r["upstream_us"] or 0) > 0 or r["upstream_reason"]), r
    assert all((r["upstream_us"] or 0) > 0 for r in rows if r["op"] == "kv_gather")  # interpreted
    assert (tmp_path / "peer.md").read_text().startswith("| op | case |")
