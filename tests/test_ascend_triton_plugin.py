# SPDX-License-Identifier: Apache-2.0
"""The marks of ``tests/ascend_triton_plugin.py`` (``make test-ascend-triton``) cover exactly the
hardware limit: a float64 case rejected by triton-ascend is a strict xfail, the same case failing
for another reason or passing fails the run, other cases are untouched. Runs a small pytest session
in a subprocess (about 1 s; the plugin needs no triton-ascend for its marks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the plugin's report header names the installed triton

ROOT = Path(__file__).resolve().parents[1]
CASES = '''
import pytest, torch

@pytest.mark.parametrize("dtype", [torch.float64])
def test_limit(dtype):
    raise RuntimeError("[fp8, fp64] is unsupported on Ascend")

@pytest.mark.parametrize("dtype", [torch.float64])
def test_other_error(dtype):
    raise ValueError("a real bug")

@pytest.mark.parametrize("dtype", [torch.float64])
def test_stale_mark(dtype):
    pass

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn])
def test_fp8_limit(dtype):
    raise RuntimeError("[fp8, fp64] is unsupported on Ascend")

@pytest.mark.parametrize("dtype", [torch.float32])
def test_plain_fails(dtype):
    raise RuntimeError("[fp8, fp64] is unsupported on Ascend")
'''


def test_marks_cover_only_the_hardware_limit(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "tests.ascend_triton_plugin",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            "test_cases.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout
    outcome = {
        line.split()[1].split("::")[1]: line.split()[0]
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in ("PASSED", "FAILED", "XFAIL", "XPASS")
    }
    assert outcome == {
        "test_limit[dtype0]": "XFAIL",
        "test_other_error[dtype0]": "FAILED",
        "test_stale_mark[dtype0]": "FAILED",
        "test_fp8_limit[dtype0]": "XFAIL",
        "test_plain_fails[dtype0]": "FAILED",
    }, out
    assert "hardware limit: Ascend A2/A3 have no float64" in out
    assert "3 failed, 2 xfailed" in out
