# SPDX-License-Identifier: Apache-2.0
"""``tests/aot/sass_count.py``: its parsing of ``cuobjdump -sass`` listings and one real count."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.aot.sass_count import parse_args, summarize
from tests.subprocess_scripts import HAS_PTXAS, ROOT

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA 0x40 ;
        /*0020*/                   FFMA R2, R3, R4, R2 ;
        /*0030*/                   FFMA R2, R3, R4, R2 ;
        /*0040*/                   ISETP.GE.AND P0, PT, R5, 0x10, PT ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   EXIT ;
"""


def test_importing_it_leaves_the_interpreter_on():
    """The suite imports this module under ``TRITON_INTERPRET``: importing it must not change
    the environment (it once popped the variable at import, and every later kernel test of the
    session tried to compile for a GPU)."""
    import importlib
    import os

    import tests.aot.sass_count as sc

    before = dict(os.environ)
    importlib.reload(sc)
    assert dict(os.environ) == before


def test_summarize_counts_instructions_loops_and_opcodes():
    s = summarize(LISTING)
    assert s["instructions"] == 7
    assert s["loops"] == [4]  # 0x20 .. 0x50: the backward branch only
    assert dict(s["ops"]) == {"LDC": 1, "BRA": 2, "FFMA": 2, "ISETP": 1, "EXIT": 1}


def test_parse_args_filters_and_knobs():
    assert parse_args(
        ["topk", "_fused_kernel", "BLOCK=512", "BOUND=True", "+HIST_RELAXED=False"]
    ) == ("topk", "_fused_kernel", {"BLOCK": 512, "BOUND": True}, {"HIST_RELAXED": False})
    with pytest.raises(SystemExit):
        parse_args(["topk", "_fused_kernel", "BLOCK"])


@pytest.mark.skipif(not HAS_PTXAS, reason="Triton's bundled ptxas is not installed")
def test_counts_a_recorded_launch_and_its_knob(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SASS_DUMP"] = str(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.aot.sass_count",
            "indexer",
            "_hist_kernel",
            "+HIST_RELAXED=False",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("_hist_kernel")]
    assert len(lines) == 4, out.stdout  # the four recorded passes, knob set
    for p, ln in enumerate(lines):
        assert "'HIST_RELAXED': False" in ln and f"'PASS': {p}" in ln, ln
        count = int(re.search(r"(\d+) instructions", ln).group(1))
        assert 100 < count < 10_000, ln
        # SASS_DUMP: the launch's key, then its instructions without addresses
        dump = (tmp_path / f"_hist_kernel-{p + 1}.sass").read_text().splitlines()
        assert f'"PASS": {p}' in dump[0] and len(dump) == count + 1, dump[:2]
        assert not any(re.match(r"/\*[0-9a-f]+\*/", d) for d in dump[1:])
