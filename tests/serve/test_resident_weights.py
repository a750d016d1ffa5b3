# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` of the FP8 tiny checkpoint keeps its weights as shipped, and the graph-safe decode
metadata (what vLLM captures in CUDA graphs on GPUs) decodes exactly what the general builder does.

Two servers of the FP8 checkpoint (FP8 128x128 linears, FP4 experts), bf16 as served by default:

* ``shipped``: the plugin's defaults. Its log has one ``resident weights`` line: the parameters'
  bytes must be within 10% of the checkpoint's tensor bytes (the MTP layer excluded; a dequantized
  copy of the FP8 / FP4 weights would be about 3x), with e4m3, ue8m0 and packed e2m1 tensors held;
* ``general``: ``VLLM_DSV4_HW_CUDA_GRAPHS=0``: every step, decode included, through the general
  (host-validated) metadata builder.

The ``shipped`` server is also the default served configuration against a reference: its prompt
logprobs (bf16 math, FP8 / FP4 weights, fp8 + MXFP4 caches) against transformers fp32 on the same
checkpoint, within the compact caches' bounds (``tests/compact_bounds.py``).

Prompts crossing 4 / 128 / 256 positions, sent one at a time to each server (so that batch
composition is the same), must decode to identical token ids and identical logprobs: both paths
produce the same slots, so the same kernels compute the same bits.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.serve.helpers import greedy_params, random_prompt
from tests.serve.server import ServerSpec
from tests.serve.test_parity import measure_compact_gap

pytestmark = pytest.mark.slow

LENGTHS = (3, 126, 255, 300)
SERVERS = {
    "shipped_server": ServerSpec("shipped", checkpoint="fp8", max_model_len=1024),
    "general_server": ServerSpec(
        "general", checkpoint="fp8", max_model_len=1024, env={"VLLM_DSV4_HW_CUDA_GRAPHS": "0"}
    ),
}
RESIDENT = re.compile(
    r"resident weights ([0-9.]+) MiB for ([0-9.]+) MiB of checkpoint tensors "
    r"\(([0-9.]+)x\): (.*)"
)


@pytest.fixture(scope="module")
def shipped_server(vllm_servers):
    yield vllm_servers.get(SERVERS["shipped_server"])
    vllm_servers.stop("shipped")


@pytest.fixture(scope="module")
def general_server(vllm_servers):
    yield vllm_servers.get(SERVERS["general_server"])
    vllm_servers.stop("general")


def test_weights_stay_as_shipped(shipped_server, ckpt_fp8):
    lines = [m for m in RESIDENT.finditer(shipped_server.log_text())]
    assert len(lines) == 1, "expected one 'resident weights' log line at load"
    resident, ckpt, ratio, parts = lines[0].groups()
    on_disk = json.loads((ckpt_fp8 / "model.safetensors.index.json").read_text())
    main = {n for n in on_disk["weight_map"] if not n.startswith("mtp.")}
    assert float(ckpt) > 0 and len(main) > 100
    assert 0.99 <= float(ratio) <= 1.10, lines[0].group(0)
    for fmt in ("fp8 e4m3", "ue8m0 scales", "fp4 e2m1 (packed)"):
        assert fmt in parts, parts


def test_graph_safe_decode_metadata_decodes_like_the_general_builder(
    shipped_server, general_server, ckpt_fp8
):
    vocab = json.loads((ckpt_fp8 / "config.json").read_text())["vocab_size"]
    for n in LENGTHS:
        prompt = random_prompt(n, seed=500 + n, vocab=vocab)
        a = shipped_server.complete(prompt, **greedy_params(f"g{n}"))
        b = general_server.complete(prompt, **greedy_params(f"g{n}"))
        assert a["token_ids"] == b["token_ids"], (n, a["token_ids"], b["token_ids"])
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"], n


def test_default_configuration_against_transformers(shipped_server, ckpt_fp8):
    measure_compact_gap(
        shipped_server,
        ckpt_fp8,
        "vLLM as served by default (bf16, FP8 / FP4 "
        "weights as shipped, fp8 main + MXFP4 indexer caches)",
    )
