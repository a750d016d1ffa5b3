# SPDX-License-Identifier: Apache-2.0
"""``vllm serve --tensor-parallel-size 2`` (two CPU workers in one vLLM tensor-parallel group, gloo /
shared-memory communicator) against transformers, with ``test_parity.py``'s measurement and bf16
tolerances: the bf16 tiny checkpoint, the FP8 / FP4 one, and the FP8 one with
``--enable-expert-parallel``; each rank's resident bytes; a split the checkpoint cannot take
refused at startup. (Prefix caching, chunked prefill and preemption at TP=2:
``test_scheduling.py``; the split network in fp32 against the whole one: ``tests/model``.)

The TP=1 servers of ``test_parity.py`` / ``test_parity_fp8.py`` pass the same checks on the same
prompt, so the two sizes agree with each other within the same bounds.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.serve.server import ServerSpec
from tests.serve.test_parity import KV_GIB, MAX_BATCHED, _logged_capacity, measure_parity
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.engine.kv_pool import plan_vllm_pool

pytestmark = pytest.mark.slow

# vLLM binds each CPU worker's OpenMP threads to a NUMA node; these machines have one, so the two
# workers get one core each.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_DSV4_HW_INDEXER_FORMAT": "bf16"}
PARITY_ARGS = (
    "--tensor-parallel-size",
    "2",
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "bfloat16",
    "--max-num-batched-tokens",
    str(MAX_BATCHED),
)
FP8_LENGTHS = (1, 129, 257, 600)  # the FP8 runs: a subset of LENGTHS (suite time)

SERVERS = {
    "tp2_bf16": ServerSpec("tp2-bf16", checkpoint="bf16", args=PARITY_ARGS, env=TP_ENV),
    "tp2_fp8": ServerSpec("tp2-fp8", checkpoint="fp8", args=PARITY_ARGS, env=TP_ENV),
    "tp2_fp8_ep": ServerSpec(
        "tp2-fp8-ep", checkpoint="fp8", args=PARITY_ARGS + ("--enable-expert-parallel",), env=TP_ENV
    ),
}
RESIDENT = re.compile(
    r"resident weights ([0-9.]+) MiB for ([0-9.]+) MiB of checkpoint tensors "
    r"\(([0-9.]+)x\): .* \(TP rank (\d) of 2, experts by (expert \(EP\)|"
    r"intermediate)\)"
)


def _server(name):
    @pytest.fixture(scope="module", name=name)
    def fixture(vllm_servers):
        yield vllm_servers.get(SERVERS[name])
        vllm_servers.stop(SERVERS[name].name)

    return fixture


tp2_bf16 = _server("tp2_bf16")
tp2_fp8 = _server("tp2_fp8")
tp2_fp8_ep = _server("tp2_fp8_ep")


def _rank_lines(server, experts: str) -> list[tuple[float, float]]:
    got = {}
    for m in RESIDENT.finditer(server.log_text()):
        assert m[5] == experts, m[0]
        got[int(m[4])] = (float(m[1]), float(m[2]))
    assert sorted(got) == [0, 1], server.log_tail(40)
    return [got[0], got[1]]


def test_tp2_bf16_parity_with_transformers(tp2_bf16, ckpt_bf16):
    log = tp2_bf16.log_text()
    assert "tensor_parallel_size=2" in log, tp2_bf16.log_tail()
    for rank in (0, 1):
        assert (
            f"split over vLLM's tensor-parallel group: TP rank {rank} of 2, experts by "
            f"intermediate (2 of 4 query heads, 8 of 8 experts here)"
        ) in log, rank
    measure_parity(tp2_bf16, ckpt_bf16, "tp2-bf16: vLLM TP=2 (fp32 math, bf16 caches)")


@pytest.mark.parametrize(
    "which,experts", [("tp2_fp8", "intermediate"), ("tp2_fp8_ep", "expert (EP)")]
)
def test_tp2_fp8_parity_with_transformers(which, experts, request, ckpt_fp8):
    server = request.getfixturevalue(which)
    assert server.log_lines("quantization=dsv4_hw_fp8"), "the FP8 method was not selected"
    _rank_lines(server, experts)
    measure_parity(server, ckpt_fp8, f"{which}: vLLM TP=2 (fp32 math, bf16 caches)", FP8_LENGTHS)


def _whole_model_bytes(ckpt, dtype: torch.dtype) -> float:
    """MiB the one-rank model holds for this checkpoint in ``dtype`` (built on the meta device,
    counted as the server counts its own: ``model.resident``)."""
    from vllm_dsv4_hw.attention.layer import DSV4Attention
    from vllm_dsv4_hw.config import validate_hf_config
    from vllm_dsv4_hw.model.network import DSV4Network
    from vllm_dsv4_hw.model.resident import MIB, resident_summary

    cfg = validate_hf_config(json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        net = DSV4Network(
            cfg, lambda i, r: DSV4Attention(cfg, i, dtype=dtype, max_positions=256), dtype=dtype
        )
    return resident_summary(net, 0).resident_bytes / MIB


@pytest.mark.usefixtures("vllm_single_rank")
@pytest.mark.parametrize(
    "which,experts", [("tp2_fp8", "intermediate"), ("tp2_fp8_ep", "expert (EP)")]
)
def test_each_rank_holds_its_shard(which, experts, request, ckpt_fp8):
    """Both ranks log the same resident bytes, well under what one rank holds. Not half: the
    tiny checkpoint keeps the real one-head KV vector, compressors and indexer, replicated on
    every rank, at a quarter of its bytes (V4-Flash as shipped: 0.504 per rank,
    ``tests/model/test_tensor_parallel.py``)."""
    (r0, ckpt0), (r1, ckpt1) = _rank_lines(request.getfixturevalue(which), experts)
    assert r0 == r1 and ckpt0 == ckpt1
    whole = _whole_model_bytes(ckpt_fp8, torch.float32)  # the servers run --dtype float32
    share = r0 / whole
    print(f"\n{which}: {r0:.2f} MiB per rank, {whole:.2f} MiB on one rank ({share:.3f}x)")
    assert 0.5 <= share <= 0.8, share


def test_tp2_kv_capacity_matches_kv_plan_per_rank(tp2_bf16, ckpt_bf16):
    """The KV cache is replicated (one shared KV head): vLLM's figures at TP=2, with
    VLLM_CPU_KVCACHE_SPACE per worker, are kv-plan's for one rank of that memory."""
    tokens, max_len, concurrency = _logged_capacity(tp2_bf16)
    cfg = DSV4Config.from_hf_dict(json.loads((ckpt_bf16 / "config.json").read_text()))
    plan = plan_vllm_pool(cfg, "bf16", "bf16", KV_GIB << 30, max_len, MAX_BATCHED)
    print(
        f"\nTP=2: vLLM logged {tokens} tokens, {concurrency}x at {max_len}; kv-plan per rank "
        f"{plan.tokens} tokens, {plan.max_concurrency:.4f}x"
    )
    per_block = max_len / plan.blocks_per_request
    assert abs(tokens - plan.tokens) <= per_block * len(plan.groups), (tokens, plan.to_dict())
    assert abs(concurrency - round(plan.max_concurrency, 2)) <= 0.011
