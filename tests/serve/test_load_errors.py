# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` of a broken checkpoint stops at load with a message naming the tensor or field.

The loader's own tests (tests/model/test_network.py) cover every error kind; these two check that
the message reaches the user through vLLM (model construction and weight loading run in vLLM's
worker process, and the server exits instead of serving).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.serve.helpers import drop_tensor
from tests.serve.server import ServerError, VllmServer

pytestmark = pytest.mark.slow


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _fails_with(tmp_path, ckpt, needle: str) -> str:
    server = VllmServer(ckpt, log_path=tmp_path / "server.log", name="broken", startup_timeout=240)
    with pytest.raises(ServerError):
        server.start()
    log = server.log_text()
    assert needle in log, log[-3000:]
    assert not server.alive
    return log


def test_unsupported_compress_ratio_names_the_field(tmp_path, ckpt_bf16):
    ckpt = _copy(ckpt_bf16, tmp_path / "bad-ratio")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["compress_ratios"][2] = 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    log = _fails_with(tmp_path, ckpt, "compress_ratios")
    assert "8" in log and "layer 2" in log, log[-3000:]


def test_missing_tensor_is_named(tmp_path, ckpt_bf16):
    ckpt = _copy(ckpt_bf16, tmp_path / "missing-tensor")
    name = "layers.3.attn.compressor.wkv.weight"
    drop_tensor(ckpt, name)
    _fails_with(tmp_path, ckpt, name)
