# SPDX-License-Identifier: Apache-2.0
"""Parity of ``vllm serve`` (our plugin) with transformers' DeepseekV4ForCausalLM on one checkpoint.

The bf16 tiny checkpoint, served in float32 with the bf16 cache formats (main and indexer), against
transformers in float32 loading the same directory: at prompt lengths 1, 127, 128, 129, 255, 256,
257 and 600 (crossing the 4 / 128 / 256 boundaries of compression and logical blocks) the prompt
logprobs at every position (vLLM's top-5 token ids and values) and 32 greedy new tokens.

Tolerances: the intended differences are the bf16 rounding of cached KV entries (transformers keeps
fp32 KV) and its consequences: a rounding can flip a discrete choice (an expert of the router, an
entry of the indexer's top-k) where two scores are nearly equal, which moves that position's
logprobs a lot. Measured on a 600-token prompt: median |dlogprob| 0.005, 99th percentile 0.12,
4 of 599 positions above 0.25 (max 2.3). So per position the bound is 0.25 at 98% of positions, the
median at most 0.02, and no position beyond 5. Greedy tokens must be equal up to a step where the
reference's own top-2 gap is below 0.05 (a near-tie; then the continuations legitimately part);
the test prints where that happens. Measured (2026-11-29): median 0.0054, q99 0.079, max 2.3 over
1745 positions, 9 top-1 moves; greedy equal everywhere except one near-tie (gap 0.0027) after 29
tokens at length 257.

With the compact fp8 main / MXFP4 indexer cache the gap is bounded by ``tests/compact_bounds.py``
(median and top-1 move rate from measured correct runs over 24 checkpoint / prompt seeds, 1.25x
margin; a broken selection lands above them, ``tests/model/test_compact_parity.py``), plus loose
sanity bounds on the share within 1.0 and the max. Measured here: median 0.105, 94.7% of positions
within 1.0, q99 2.4, max 3.6, 49 top-1 moves (600 positions).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests import compact_bounds
from tests.serve import hf_reference as hf
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.engine.kv_pool import plan_vllm_pool

pytestmark = pytest.mark.slow

# Chunked prefill of the longer prompts, and a known value for the capacity check.
MAX_BATCHED = 512
KV_GIB = 1  # tests.serve.server.BASE_ENV VLLM_CPU_KVCACHE_SPACE


@pytest.fixture(scope="module")
def bf16_parity_server(vllm_servers, ckpt_bf16):
    server = vllm_servers.get(
        "bf16-parity",
        ckpt_bf16,
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
    vllm_servers.stop("bf16-parity")


@pytest.fixture(scope="module")
def compact_parity_server(vllm_servers, ckpt_bf16):
    server = vllm_servers.get(
        "compact-parity",
        ckpt_bf16,
        args=["--dtype", "float32", "--max-num-batched-tokens", str(MAX_BATCHED)],
    )
    yield server
    vllm_servers.stop("compact-parity")


LENGTHS = (1, 127, 128, 129, 255, 256, 257, 600)
NEW_TOKENS = 32
TOP = 5
BF16 = {"per_position": 0.25, "fraction_within": 0.98, "median": 0.02, "max": 5.0}
COMPACT = {"per_position": 1.0, "fraction_within": 0.90, "max": 8.0, **compact_bounds.SINGLE}
TIE_GAP = 0.05


def _prompt(vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # Skip the special ids at the start of the vocabulary (BOS/EOS/role markers).
    return torch.randint(16, vocab - 64, (max(LENGTHS),), generator=g).tolist()


def _prompt_diffs(client, ref: torch.Tensor, ids: list[int]) -> tuple[list[float], int]:
    """Per prompt position (from the 2nd): max |dlogprob| over vLLM's top-5 entries; and how
    many positions have a different top-1 token. ``ref`` holds transformers' log-softmax rows of
    a prompt that ``ids`` is a prefix of."""
    plp = client.complete(ids, max_tokens=1, prompt_logprobs=TOP)["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    diffs, top1_moves = [], 0
    for j in range(1, len(ids)):
        entries = {int(t): v for t, v in plp[j].items()}
        ranked = sorted((v["rank"], t) for t, v in entries.items() if v["rank"] <= TOP)
        assert len(ranked) == TOP, (j, entries)
        row = ref[j - 1]
        diffs.append(max(abs(v["logprob"] - float(row[t])) for t, v in entries.items()))
        top1_moves += ranked[0][1] != int(row.argmax())
    return diffs, top1_moves


def _check_diffs(diffs: list[float], top1_moves: int, tol: dict) -> dict:
    d = torch.tensor(diffs)
    stats = {
        "positions": len(diffs),
        "median": round(float(d.median()), 4),
        "q99": round(float(d.quantile(0.99)), 4),
        "max": round(float(d.max()), 4),
        "within": round(float((d <= tol["per_position"]).float().mean()), 4),
        "top1_moves": top1_moves,
    }
    assert stats["median"] <= tol["median"], stats
    assert stats["within"] >= tol["fraction_within"], stats
    assert stats["max"] <= tol["max"], stats
    assert top1_moves <= tol.get("move_rate", 1 - tol["fraction_within"]) * len(diffs), stats
    return stats


def _compare_greedy(path, client, ids: list[int]) -> str:
    got = client.complete(ids, max_tokens=NEW_TOKENS, ignore_eos=True)["token_ids"]
    want, gaps = hf.greedy(path, ids, NEW_TOKENS)
    assert len(got) == NEW_TOKENS
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < TIE_GAP, (
                f"greedy token {i} differs ({a} vs transformers {b}) with "
                f"a clear reference margin {gaps[i]:.3f}",
                got,
                want,
            )
            return f"equal for {i} tokens, then a near-tie (gap {gaps[i]:.4f})"
    return f"all {NEW_TOKENS} equal"


def measure_parity(client, ckpt, what: str, lengths=LENGTHS, seed: int = 1234) -> dict:
    """The bf16 measurement: prompt logprobs at every prefix length in ``lengths`` of one prompt
    and greedy tokens after each, against transformers on ``ckpt``; checked against BF16."""
    ids = _prompt(client.vocab_size, seed=seed)
    ref = hf.prompt_logprobs(ckpt, ids)
    diffs, moves, greedy = [], 0, {}
    for n in lengths:
        if n > 1:
            d, m = _prompt_diffs(client, ref, ids[:n])
            diffs += d
            moves += m
        greedy[n] = _compare_greedy(ckpt, client, ids[:n])
    stats = _check_diffs(diffs, moves, BF16)
    print(f"\n{what} vs transformers fp32, prompt logprobs (top-5) over lengths {lengths}: {stats}")
    for n, r in greedy.items():
        print(f"  greedy after {n:4d} prompt tokens: {r}")
    return stats


def test_parity_with_transformers_bf16_cache(bf16_parity_server, ckpt_bf16):
    measure_parity(bf16_parity_server, ckpt_bf16, "vLLM (fp32, bf16 caches)")


def measure_compact_gap(client, ckpt, what: str, seed: int = 4321) -> dict:
    """Prompt logprobs of one 600-token prompt against transformers on ``ckpt``, checked against
    the compact caches' bounds (``COMPACT``)."""
    ids = _prompt(client.vocab_size, seed=seed)
    stats = _check_diffs(*_prompt_diffs(client, hf.prompt_logprobs(ckpt, ids), ids), COMPACT)
    print(f"\n{what} vs transformers fp32, 600-token prompt: {stats}")
    return stats


def test_compact_cache_gap_is_bounded(compact_parity_server, ckpt_bf16):
    measure_compact_gap(
        compact_parity_server, ckpt_bf16, "vLLM (fp32, fp8 main + MXFP4 indexer caches)"
    )


def _logged_capacity(server) -> tuple[int, int, float]:
    lines = server.log_lines("KV cache size:")
    assert lines, server.log_tail(40)
    m = re.search(
        r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
        r"request: ([\d.]+)x",
        lines[-1],
    )
    assert m, lines[-1]
    return (int(m[1].replace(",", "")), int(m[2].replace(",", "")), float(m[3]))


@pytest.mark.parametrize(
    "which,formats", [("bf16", ("bf16", "bf16")), ("compact", ("fp8", "mxfp4"))]
)
def test_vllm_kv_capacity_matches_kv_plan(which, formats, request, ckpt_bf16):
    server = request.getfixturevalue(f"{which}_parity_server")
    tokens, max_len, concurrency = _logged_capacity(server)
    cfg = DSV4Config.from_hf_dict(json.loads((ckpt_bf16 / "config.json").read_text()))
    plan = plan_vllm_pool(cfg, *formats, KV_GIB << 30, max_len, MAX_BATCHED)
    print(
        f"\n{which}: vLLM logged {tokens} tokens, {concurrency}x at {max_len}; kv-plan "
        f"{plan.tokens} tokens, {plan.max_concurrency:.4f}x ({plan.num_blocks} blocks of "
        f"{plan.bytes_per_block} B, {plan.blocks_per_request} per request)"
    )
    # "within one block per cache kind": the block counts agree exactly, so do the figures.
    per_block = max_len / plan.blocks_per_request
    assert abs(tokens - plan.tokens) <= per_block * len(plan.groups), (tokens, plan.to_dict())
    assert abs(concurrency - round(plan.max_concurrency, 2)) <= 0.011
