# SPDX-License-Identifier: Apache-2.0
"""One decode step of the product network at V4-Flash dimensions (one layer of each kind, FP8
linears and FP4 experts resident, random valid caches), for the GPU tier's determinism checks
(``tests/gpu/test_determinism.py``) and ``benchmarks/determinism.py``."""

from __future__ import annotations

import os

import torch

CONTEXT = 131072
BATCH = 4


def build_decode_case(device: torch.device, context: int = CONTEXT, batch: int = BATCH):
    """(network, caches, decode inputs, token ids): one decode step at ``context - 2``."""
    from benchmarks.decode_stack import model_config
    from benchmarks.stack.decode_inputs import DecodeInputs
    from benchmarks.stack.model import build_network
    from benchmarks.stack.network_run import network_config
    from benchmarks.stack.pools import StackCaches

    cfg = network_config(model_config("v4-flash", None), 1)
    net = build_network(cfg, device, context, seed=0)
    caches = StackCaches(cfg, batch, context, device, "fp8", "mxfp4", seed=0)
    caches.fill_random(seed=0)
    dm = DecodeInputs(caches, device)
    dm.set_position(context - 2)
    ids = torch.randint(
        0,
        cfg.vocab_size,
        (batch,),
        device=device,
        generator=torch.Generator(device=device).manual_seed(3),
    )
    return net, caches, dm, ids


def decode_logits(case) -> torch.Tensor:
    """The step's logits (no synchronization: capturable in a CUDA graph)."""
    from vllm_dsv4_hw.attention.layer import running_step

    net, caches, dm, ids = case
    with torch.no_grad(), running_step(dm.derive(), caches.layers):
        return net.compute_logits(net(ids))


def decode_step(case, streams: bool) -> torch.Tensor:
    """A copy of the step's logits with the auxiliary streams on or off, synchronized."""
    os.environ["VLLM_DSV4_HW_MULTI_STREAM"] = "1" if streams else "0"  # read by aux_streams
    out = decode_logits(case).clone()
    torch.cuda.synchronize()
    return out
