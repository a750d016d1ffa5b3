# SPDX-License-Identifier: Apache-2.0
"""Every Triton path the GPU takes, at real dimensions, against the reference backend (itself checked
against float64 oracles by ``make test``): the checks of ``benchmarks/gpu`` (fresh random inputs,
poisoned outputs; fused prologue / epilogue, sparse attention incl. split-K, indexer incl. the bf16
dot modes and the radix top-k with real atomics, compressor pools, the FP8 / FP4 weight GEMMs), CUDA
graph replay of the decode-path ops against eager, and the auxiliary streams' overlap."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.gpu import graph_cases
from benchmarks.gpu_run import MODULES, streams_check

pytestmark = pytest.mark.gpu


def _report(rows: list[dict]) -> list[str]:
    bad = [r for r in rows if not r.get("ok")]
    for r in rows:
        name = r.get("check") or "/".join(str(r[k]) for k in ("op", "case") if k in r)
        print(f"{'PASS' if r.get('ok') else 'FAIL'} {name}")
    return [str(r) for r in bad]


@pytest.mark.parametrize("module", MODULES)
def test_kernels_match_the_reference_at_real_dimensions(module, _cuda_device):
    rows = importlib.import_module(f"benchmarks.gpu.{module}").check(_cuda_device)
    assert rows, f"benchmarks.gpu.{module}.check returned no case"
    bad = _report(rows)
    assert not bad, f"{len(bad)} of {len(rows)} cases failed:\n" + "\n".join(bad)


@pytest.mark.parametrize("case", sorted(graph_cases.CASES))
def test_cuda_graph_replay_equals_eager(case, _cuda_device):
    import torch

    ok, detail = graph_cases.run_case(torch, graph_cases.CASES[case])
    assert ok, detail


def test_aux_streams_overlap(_cuda_device):
    import torch

    (row,) = streams_check(torch)
    assert row["ok"], row["detail"]
