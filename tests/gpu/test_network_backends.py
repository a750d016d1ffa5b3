# SPDX-License-Identifier: Apache-2.0
"""The whole network step on the Triton backend against the same step on the reference backend
(itself checked against float64 oracles by ``make test``), on the GPU at V4-Flash dimensions: one
layer of each kind with FP8 linears and FP4 experts resident, random valid fp8 + MXFP4 caches at
128K, batch 4 (``benchmarks.stack.decode_case``). Every op of the step switches backend
(``VLLM_DSV4_HW_BACKEND``), nothing else: same weights, caches, metadata and inputs.

Both run the model in bf16, so they differ by rounding order (and where the indexer's 512th and
513th scores nearly tie, by one selected entry); the bound is on the logits relative to their
scale, and the greedy tokens must agree."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.stack.decode_case import build_decode_case, decode_step
from vllm_dsv4_hw.ops.registry import REGISTRY

pytestmark = pytest.mark.gpu

REL_TOL = 0.05  # max |dlogit| / max |logit|


def _on(backend: str | None, case) -> torch.Tensor:
    old = os.environ.pop("VLLM_DSV4_HW_BACKEND", None)
    if backend is not None:
        os.environ["VLLM_DSV4_HW_BACKEND"] = backend
    REGISTRY.clear_cache()
    try:
        return decode_step(case, True).float()
    finally:
        os.environ.pop("VLLM_DSV4_HW_BACKEND", None)
        if old is not None:
            os.environ["VLLM_DSV4_HW_BACKEND"] = old
        REGISTRY.clear_cache()


def test_triton_network_step_matches_the_reference(_cuda_device):
    case = build_decode_case(_cuda_device)
    triton_out = _on("triton", case)
    ref = _on("reference", case)
    assert torch.isfinite(triton_out).all() and torch.isfinite(ref).all()
    rel = float((triton_out - ref).abs().max() / ref.abs().max())
    agree = bool(torch.equal(triton_out.argmax(-1), ref.argmax(-1)))
    print(
        f"\nnetwork step, triton vs reference backend: max |dlogit| / max |logit| {rel:.3g}, "
        f"greedy tokens equal {agree}"
    )
    assert rel <= REL_TOL and agree, (rel, agree)
