"""The product's decode step gives the same bits whatever the streams or graphs, and from run to
run: the network at V4-Flash dimensions (one layer of each kind, FP8 linears and FP4 experts
resident, random valid caches at 128K) stepped at one position, compared bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
CONTEXT = 131072
BATCH = 4


def build_stack(device: torch.device):
    """(network, caches, decode inputs, token ids): one decode step at CONTEXT - 2, batch BATCH."""
    from benchmarks.decode_stack import model_config
    from benchmarks.stack.decode_inputs import DecodeInputs
    from benchmarks.stack.model import build_network
    from benchmarks.stack.network_run import network_config
    from benchmarks.stack.pools import StackCaches

    cfg = network_config(model_config("v4-flash", None), 1)
    net = build_network(cfg, device, CONTEXT, seed=0)
    caches = StackCaches(cfg, BATCH, CONTEXT, device, "fp8", "mxfp4", seed=0)
    caches.fill_random(seed=0)
    dm = DecodeInputs(caches, device)
    dm.set_position(CONTEXT - 2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH,), device=device,
                        generator=torch.Generator(device=device).manual_seed(3))
    return net, caches, dm, ids


@pytest.fixture(scope="module")
def stack(_cuda_device):
    return build_stack(_cuda_device)


def _logits(stack) -> torch.Tensor:
    from vllm_dsv4_hw.attention.layer import running_step

    net, caches, dm, ids = stack
    with torch.no_grad(), running_step(dm.derive(), caches.layers):
        return net.compute_logits(net(ids))


def _step(stack, streams: bool) -> torch.Tensor:
    os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1" if streams else "0"  # read by aux_streams
    out = _logits(stack).clone()
    torch.cuda.synchronize()
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = float((a - b).abs().max())
    return "" if torch.equal(a, b) else f"max |diff| {diff:.4g}, argmax equal " \
                                        f"{bool(torch.equal(a.argmax(-1), b.argmax(-1)))}"


def test_run_to_run(stack):
    first, second = _step(stack, True), _step(stack, True)
    assert not _bits_equal(first, second), _bits_equal(first, second)


def test_streams_on_and_off(stack):
    on, off = _step(stack, True), _step(stack, False)
    assert not _bits_equal(on, off), _bits_equal(on, off)


def test_graph_replay_and_eager(stack):
    from benchmarks.stack.timing import capture_cuda_graph

    eager = _step(stack, True)
    g, out = capture_cuda_graph(lambda: _logits(stack))
    g.replay()
    torch.cuda.synchronize()
    assert not _bits_equal(eager, out), _bits_equal(eager, out)
