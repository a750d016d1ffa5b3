# SPDX-License-Identifier: Apache-2.0
"""The GPU tier (``pytest -m gpu tests/gpu``; ``make test-gpu`` on a CUDA machine). ``make test``
deselects it (``-m 'not gpu'`` in pyproject); selected on a machine without CUDA it fails instead
of skipping, so a run that checked nothing never reads as green. A kernel that fails to compile
raises (``VLLM_DSV4_HW_KERNEL_FAILURES=raise``, also set by importing ``benchmarks``) instead of
falling back to the reference it is compared with."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["VLLM_DSV4_HW_KERNEL_FAILURES"] = "raise"
if os.environ.get("DSV4_RECORD_LAUNCHES"):  # the launches for the AOT target matrix (tests/aot)
    from tests.gpu.launches import install

    install(os.environ["DSV4_RECORD_LAUNCHES"])


@pytest.fixture(autouse=True, scope="session")
def _cuda_device():
    if not torch.cuda.is_available():
        pytest.fail(
            "the gpu tier needs a CUDA device: run `make test-gpu` on the GPU machine "
            "(on the H200: bash benchmarks/with_vllm.sh python3 -m pytest -m gpu tests/gpu)"
        )
    from benchmarks.vllm_state import single_rank

    single_rank()  # the product's linears are vLLM layers
    return torch.device("cuda")
