# SPDX-License-Identifier: Apache-2.0
"""``benchmarks.decode_kernels``'s options that act before it needs a GPU."""

from __future__ import annotations

import pytest

from benchmarks import decode_kernels, topk_sweeps


def test_topk_blocks_sets_the_sweeps_blocks(monkeypatch):
    monkeypatch.setattr(topk_sweeps, "BLOCKS", topk_sweeps.BLOCKS)
    monkeypatch.setattr(decode_kernels.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        decode_kernels.main(["--only", "topk_sync", "--topk-blocks", "auto,1024"])
    assert topk_sweeps.BLOCKS == (None, 1024)
