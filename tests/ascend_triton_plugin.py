# SPDX-License-Identifier: Apache-2.0
"""pytest plugin of ``make test-ascend-triton``: Triton kernels under triton-ascend's interpreter.

Loaded only by that target (``-p tests.ascend_triton_plugin``). Ascend A2/A3 have no float64 and no
fp8 dtypes, and triton-ascend rejects them ("[fp8, fp64] is unsupported on Ascend"). The cases that
hand the kernels such tensors are marked at collection as strict xfails with that reason: a case
parametrized with a float64 / float8 dtype, or one listed in :data:`FP64_INSIDE` (it builds float64
inputs itself). Strict: such a case that passes fails the run (the mark is stale). A marked case
that fails for any other reason than the rejected dtype stays a failure (the mark covers exactly
the hardware limit, not whatever else may break). Every other failure is a failure.
"""

from __future__ import annotations

import pytest
import torch

UNSUPPORTED = "is unsupported on Ascend"  # triton-ascend's message for fp64 / fp8 tensors
REASON = "hardware limit: Ascend A2/A3 have no {} (triton-ascend rejects it)"

# Cases without a dtype parameter whose inputs are float64 (test file :: function name).
FP64_INSIDE = {
    "test_rope.py::test_rope_pair_convention_is_gptj",
    "test_rope.py::test_rope_scores_depend_on_relative_position",
}

_LIMIT = pytest.StashKey[str]()


def _limit(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    dtypes = [v for v in callspec.params.values() if isinstance(v, torch.dtype)] if callspec else []
    if torch.float64 in dtypes:
        return "float64"
    if any(d.is_floating_point and d.itemsize == 1 for d in dtypes):
        return "fp8 dtypes"
    name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    return "float64" if name in FP64_INSIDE else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        what = _limit(item)
        if what is not None:
            item.stash[_LIMIT] = what
            item.add_marker(pytest.mark.xfail(reason=REASON.format(what), strict=True))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: after pytest's xfail handling
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        call.when == "call"
        and _LIMIT in item.stash
        and hasattr(report, "wasxfail")
        and report.skipped
        and call.excinfo is not None
        and UNSUPPORTED not in str(call.excinfo.value)
    ):
        # failed, but not on the rejected dtype: a real failure the mark must not cover
        report.outcome = "failed"
        del report.wasxfail


def pytest_report_header(config):
    import triton

    return (
        f"triton-ascend interpreter run: triton {triton.__version__}; float64 / fp8 cases are "
        f"strict xfails (Ascend A2/A3 hardware limit)"
    )
