# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from tests.model.checkpoints import SEED
from vllm_dsv4_hw.tools import checkpoint as ck


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for preset in ck.PRESETS:
        for dtype in ck.DTYPES:
            path = root / f"{preset}-{dtype}"
            summary = ck.make_checkpoint(path, preset, dtype, SEED, progress=lambda _m: None)
            out[preset, dtype] = summary
    return out
