# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw info``: device, versions, and the backend per op with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from vllm_dsv4_hw.cli import info as info_mod
from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.ops import REGISTRY
from vllm_dsv4_hw.platform.device import current_adaptor


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_info_text(capsys):
    rc, out, err = run_main(capsys, "info")
    assert rc == 0, err
    adaptor = current_adaptor()
    assert f"device: {adaptor.device_type} ({adaptor.name})" in out
    assert f"torch {torch.__version__}" in out
    assert "triton " in out and "vllm " in out
    rows = REGISTRY.explain(adaptor.device_type)
    assert rows, "no ops registered"
    for op, backend, reason in rows:
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [op])
        assert line.split()[1] == backend and line.rstrip().endswith(reason)


def test_info_json(capsys):
    rc, out, _ = run_main(capsys, "info", "--json")
    assert rc == 0
    d = json.loads(out)
    adaptor = current_adaptor()
    assert d["device"]["type"] == adaptor.device_type
    assert d["device"]["backend_order"] == list(adaptor.backend_order)
    assert d["versions"]["torch"] == torch.__version__
    assert [(r["op"], r["backend"], r["reason"]) for r in d["ops"]] == REGISTRY.explain(
        adaptor.device_type
    )
    assert "VLLM_DSV4_HW_BACKEND" in d["settings"]


def test_info_follows_backend_setting(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "reference")
    REGISTRY.clear_cache()
    d = json.loads(run_main(capsys, "info", "--json")[1])
    assert d["ops"] and all(r["backend"] == "reference" for r in d["ops"])
    assert all("VLLM_DSV4_HW_BACKEND" in r["reason"] for r in d["ops"])


def test_info_bad_setting_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "warp-drive")
    REGISTRY.clear_cache()
    rc, out, err = run_main(capsys, "info")
    assert rc != 0 and out == ""
    assert len(err.splitlines()) == 1 and "VLLM_DSV4_HW_BACKEND" in err
    assert "Traceback" not in err


def test_missing_vllm_says_not_installed(monkeypatch):
    real = info_mod.importlib.util.find_spec
    monkeypatch.setattr(
        info_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real(name, *a),
    )
    assert info_mod.versions()["vllm"] == "not installed"
    assert info_mod.package_version("surely_not_a_module_xyz") == "not installed"


def test_vllm_version_reported():
    v = info_mod.versions()["vllm"]
    try:
        import importlib.util

        present = importlib.util.find_spec("vllm") is not None
    except ImportError:
        present = False
    assert (v != "not installed") == present


def test_broken_op_registry_still_reports_device(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_dsv4_hw.ops", None)  # import now fails
    rc, out, err = run_main(capsys, "info")
    assert rc != 0
    assert "device:" in out and f"torch {torch.__version__}" in out
    assert len(err.splitlines()) == 1 and "op registry" in err and "Traceback" not in err


def test_info_subprocess():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DSV4_HW_")}
    p = subprocess.run(
        [sys.executable, "-m", "vllm_dsv4_hw", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert "device:" in p.stdout
    for op in REGISTRY.ops():
        assert op in p.stdout
