"""pytest plugin for ``make test-ascend-triton``: Triton kernels under triton-ascend's interpreter.

Loaded only by that target (``-p tests.ascend_triton_plugin``). Ascend A2/A3 have no fp64 and no
fp8 dtypes, and triton-ascend rejects them ("[fp8, fp64] is unsupported on Ascend"): the fp64
cases of the shared tests are reported as xfailed with that reason instead of failing. Every other
failure stays a failure.
"""

from __future__ import annotations

import pytest

UNSUPPORTED = "is unsupported on Ascend"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and call.excinfo is not None \
            and UNSUPPORTED in str(call.excinfo.value):
        report.outcome = "skipped"
        report.wasxfail = "Ascend has no fp64 / fp8 dtypes (triton-ascend rejects them)"


def pytest_report_header(config):
    import triton

    return f"triton-ascend interpreter run: triton {triton.__version__} (fp64/fp8 cases xfail)"
