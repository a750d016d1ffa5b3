# SPDX-License-Identifier: Apache-2.0
"""The product's decode step gives the same bits whatever the streams or graphs, and from run to
run: the network at V4-Flash dimensions (one layer of each kind, FP8 linears and FP4 experts
resident, random valid caches at 128K, batch 4: ``benchmarks.stack.decode_case``) stepped at one
position, compared bit for bit."""

from __future__ import annotations

import pytest
import torch

from benchmarks.stack.decode_case import build_decode_case, decode_logits, decode_step

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def stack(_cuda_device):
    return build_decode_case(_cuda_device)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = float((a - b).abs().max())
    return (
        ""
        if torch.equal(a, b)
        else f"max |diff| {diff:.4g}, argmax equal {bool(torch.equal(a.argmax(-1), b.argmax(-1)))}"
    )


def test_run_to_run(stack):
    first, second = decode_step(stack, True), decode_step(stack, True)
    assert not _bits_equal(first, second), _bits_equal(first, second)


def test_streams_on_and_off(stack):
    on, off = decode_step(stack, True), decode_step(stack, False)
    assert not _bits_equal(on, off), _bits_equal(on, off)


def test_graph_replay_and_eager(stack):
    from benchmarks.stack.timing import capture_cuda_graph

    eager = decode_step(stack, True)
    g, out = capture_cuda_graph(lambda: decode_logits(stack))
    g.replay()
    torch.cuda.synchronize()
    assert not _bits_equal(eager, out), _bits_equal(eager, out)
