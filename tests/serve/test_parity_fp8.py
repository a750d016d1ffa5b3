# SPDX-License-Identifier: Apache-2.0
"""Parity with transformers for the FP8 / FP4 checkpoint, served with its weights as shipped.

The same measurement and tolerances as ``test_parity.py``'s bf16 case (float32 math, bf16 main and
indexer caches, prompt lengths crossing 4 / 128 / 256, prompt logprobs and 32 greedy tokens), on the
FP8 tiny checkpoint: our server keeps its FP8 128x128 linears and FP4 experts resident and
multiplies them through ``fp8_block_linear`` / ``moe_experts``; transformers loads the same
directory (dequantizing it at load; the values equal the bf16 twin's exactly).
"""

from __future__ import annotations

import pytest

from tests.serve.test_parity import MAX_BATCHED, measure_parity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_parity_server(vllm_servers, ckpt_fp8):
    server = vllm_servers.get(
        "fp8-parity",
        ckpt_fp8,
        args=[
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "bfloat16",
            "--max-num-batched-tokens",
            str(MAX_BATCHED),
        ],
        env={"VLLM_DSV4_HW_INDEXER_FORMAT": "bf16"},
    )
    yield server
    vllm_servers.stop("fp8-parity")


def test_parity_with_transformers_fp8_checkpoint(fp8_parity_server, ckpt_fp8):
    client = fp8_parity_server
    assert client.log_lines("quantization=dsv4_hw_fp8"), "the FP8 method was not selected"
    # the bf16 case's prompt and lengths: the same measurement
    measure_parity(
        client,
        ckpt_fp8,
        "vLLM (FP8/FP4 weights as shipped, fp32 math, bf16 caches) on the same checkpoint",
    )
