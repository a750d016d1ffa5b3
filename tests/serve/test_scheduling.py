# SPDX-License-Identifier: Apache-2.0
"""vLLM's scheduling features must not change what DeepSeek V4 computes: concurrent batches, prefix-
cache hits, chunked prefill and preemption each give the greedy tokens of a plain run.

Two servers of the bf16 tiny checkpoint, both in float32 with the default cache formats (fp8 main,
MXFP4 indexer on CPU):

* ``ref``: vLLM's defaults (prefix caching on, 2048-token steps). Requests sent one at a time on it
  are the reference ("alone").
* ``stress``: prefix caching off, 64-token steps (chunked prefill), a 16-sequence limit, a block
  pool of ``STRESS_BLOCKS`` blocks (one 2048-token request needs 101) and admission on the first
  chunk only (``--no-scheduler-reserve-full-isl``), so that concurrent requests get preempted.

Why float32: in bf16, batch composition changes the rounding of the hidden state, and this random
model turns one-ulp differences into different routed experts / indexer picks, so greedy tokens of
the same prompt differ between a batch of 16 and a single request without any defect (measured:
6 of 16 prompts diverge, one with a 0.9 logprob margin). In float32 runs agree to ~1e-3 in logprob,
so a divergence means a real difference. Near-ties are still possible (the fp8 / MXFP4 cache
roundings can flip): a divergence is accepted only where both runs have a near-tie between the two
tokens (``TIE_GAP``), and is reported as a ``NearTieDivergence`` warning.

Requests carry distinct ``cache_salt`` values so that only the prefix-caching test shares cache
entries between requests.
"""

from __future__ import annotations

import json

import pytest

from tests.serve.helpers import (
    GaugeWatch,
    Greedy,
    GreedyMismatch,
    compare_greedy,
    greedy_params,
    random_prompt,
    read_c_op_trap,
    summarize_c_ops,
)
from tests.serve.server import ServerSpec, map_concurrently

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
LENGTHS = (5, 17, 40, 64, 100, 130, 200, 255, 256, 257, 300, 390, 512, 600, 777, 1000)
CHUNKED_LENGTHS = (600, 1000)
PREEMPT_LENGTHS = (200, 257, 390, 512, 600, 777)
STRESS_BLOCKS = 200
STEP_TOKENS = 64

# float32 runs: |dlogprob| of equal tokens measured up to ~0.07 (fp8 / MXFP4 cache roundings that
# flip with the order of float32 sums), typically 1e-4..1e-3.
LP_TOL = 0.15
TIE_GAP = 0.15

PREEMPTIONS = "vllm:num_preemptions_total"
HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"


SERVERS = {
    "ref_server": ServerSpec(
        "ref",
        checkpoint="bf16",
        max_model_len=MAX_MODEL_LEN,
        trap_c_ops=True,
        args=("--dtype", "float32", "--enable-prompt-tokens-details"),
    ),
    "stress_server": ServerSpec(
        "stress",
        checkpoint="bf16",
        max_model_len=MAX_MODEL_LEN,
        trap_c_ops=True,
        args=(
            "--dtype",
            "float32",
            "--no-enable-prefix-caching",
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
            "--max-num-seqs",
            "16",
            "--num-gpu-blocks-override",
            str(STRESS_BLOCKS),
            "--no-scheduler-reserve-full-isl",
        ),
    ),
    # The stress settings with prefix caching on, split over two tensor-parallel CPU workers (one
    # core each: vLLM binds a worker's threads to a NUMA node, these machines have one).
    "tp2_server": ServerSpec(
        "stress-tp2",
        checkpoint="bf16",
        max_model_len=MAX_MODEL_LEN,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        args=(
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--enable-prompt-tokens-details",
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
            "--max-num-seqs",
            "16",
            "--num-gpu-blocks-override",
            str(STRESS_BLOCKS),
            "--no-scheduler-reserve-full-isl",
        ),
    ),
}


@pytest.fixture(scope="module")
def ref_server(vllm_servers):
    yield vllm_servers.get(SERVERS["ref_server"])
    vllm_servers.stop("ref")


@pytest.fixture(scope="module")
def stress_server(vllm_servers):
    yield vllm_servers.get(SERVERS["stress_server"])
    vllm_servers.stop("stress")


@pytest.fixture(scope="module")
def tp2_server(vllm_servers):
    yield vllm_servers.get(SERVERS["tp2_server"])
    vllm_servers.stop("stress-tp2")


def _seed(n: int) -> int:
    return 1000 + n


@pytest.fixture(scope="module")
def prompts(ckpt_bf16):
    vocab = json.loads((ckpt_bf16 / "config.json").read_text())["vocab_size"]
    return {n: random_prompt(n, seed=_seed(n), vocab=vocab) for n in LENGTHS}


def _run(server, prompt, salt=None) -> Greedy:
    return Greedy.of(server.complete(prompt, **greedy_params(salt)))


@pytest.fixture(scope="module")
def alone(ref_server, prompts):
    """Each prompt sent alone to the default server: the reference greedy runs."""
    return {n: _run(ref_server, prompts[n], salt=f"alone-{n}") for n in LENGTHS}


def _compare_all(gots: dict[int, Greedy], refs: dict[int, Greedy], what: str) -> list[str]:
    """Compares every prompt; one failure lists all mismatching prompts (length and seed)."""
    lines, failures = [], []
    for n, got in gots.items():
        label = f"{what}, prompt of {n} tokens (random_prompt({n}, seed={_seed(n)}))"
        try:
            lines.append(
                compare_greedy(got, refs[n], lp_tol=LP_TOL, tie_gap=TIE_GAP, what=label)[0]
            )
        except GreedyMismatch as e:
            failures.append(str(e))
    print("\n" + "\n".join(lines))
    assert not failures, f"{len(failures)} of {len(gots)} differ:\n" + "\n\n".join(failures)
    return lines


def test_concurrent_requests_equal_each_alone(ref_server, prompts, alone):
    hits0 = ref_server.metric(HITS)
    with GaugeWatch(ref_server, (RUNNING,)) as watch:
        outs = map_concurrently(
            lambda n: (n, _run(ref_server, prompts[n], salt=f"conc-{n}")), LENGTHS
        )
    assert watch.max[RUNNING] >= 4, f"requests did not run together: {watch.max}"
    assert ref_server.metric(HITS) == hits0, "salted requests hit each other's cache entries"
    _compare_all(dict(outs), alone, "16 concurrent vs alone")


def test_prefix_cache_hit_gives_the_tokens_of_a_server_without_prefix_caching(
    ref_server, stress_server, ckpt_bf16
):
    vocab = json.loads((ckpt_bf16 / "config.json").read_text())["vocab_size"]
    shared = random_prompt(512, seed=77, vocab=vocab)
    first = shared + random_prompt(88, seed=78, vocab=vocab)
    second = shared + random_prompt(88, seed=79, vocab=vocab)

    hits0 = ref_server.metric(HITS)
    ref_server.complete(first, **greedy_params("prefix-test"))
    hits1 = ref_server.metric(HITS)
    out = ref_server.complete(second, **greedy_params("prefix-test"))
    hits2 = ref_server.metric(HITS)
    assert hits1 == hits0, "the first request hit the cache: stale entries?"
    assert hits2 - hits1 == 512, f"second request: {hits2 - hits1} prefix-cache hit tokens, not 512"
    details = out["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == 512, out["usage"]

    hit = Greedy.of(out)
    # The same server, the same request under a fresh salt (nothing cached): isolates the hit.
    fresh = _run(ref_server, second, salt="prefix-test-fresh")
    assert ref_server.metric(HITS) == hits2, "the fresh-salt request hit the cache"
    msg1, _ = compare_greedy(
        hit,
        fresh,
        lp_tol=LP_TOL,
        tie_gap=TIE_GAP,
        what="512 cached prompt tokens vs the same request uncached",
    )
    # A server with prefix caching off (it also prefills in 64-token chunks: see
    # test_chunked_prefill_equals_one_shot for that difference alone).
    assert "enable_prefix_caching=False" in stress_server.log_text(), stress_server.log_tail()
    uncached = _run(stress_server, second)
    msg2, _ = compare_greedy(
        hit,
        uncached,
        lp_tol=LP_TOL,
        tie_gap=TIE_GAP,
        what="512 cached prompt tokens vs a server without prefix caching",
    )
    print(f"\n{msg1}\n{msg2}")


def test_chunked_prefill_equals_one_shot(stress_server, prompts, alone):
    log = stress_server.log_text()
    assert f"max_num_batched_tokens={STEP_TOKENS}" in log and "chunked prefill True" in log, (
        stress_server.log_tail()
    )
    pre0 = stress_server.metric(PREEMPTIONS)
    gots = {n: _run(stress_server, prompts[n]) for n in CHUNKED_LENGTHS}
    assert stress_server.metric(PREEMPTIONS) == pre0, "a request alone was preempted"
    _compare_all(gots, alone, f"{STEP_TOKENS}-token chunks vs one-shot prefill")


def test_preemption_gives_the_tokens_of_the_default_server(stress_server, prompts, alone):
    pre0 = stress_server.metric(PREEMPTIONS)
    with GaugeWatch(stress_server, (RUNNING,)) as watch:
        outs = map_concurrently(lambda n: (n, _run(stress_server, prompts[n])), PREEMPT_LENGTHS)
    preempted = stress_server.metric(PREEMPTIONS) - pre0
    print(f"\n{preempted:.0f} preemptions, up to {watch.max[RUNNING]:.0f} requests running")
    assert preempted > 0, (
        f"no preemption with {len(PREEMPT_LENGTHS)} concurrent requests in "
        f"{STRESS_BLOCKS} blocks: the test tested nothing"
    )
    _compare_all(dict(outs), alone, f"preempted ({preempted:.0f} preemptions) vs alone")


def test_no_vllm_compiled_ops_inside_the_model_under_scheduling(ref_server, stress_server):
    """The trap of ``test_api`` on these servers, after concurrent, chunked, cached and preempted
    requests."""
    for server in (ref_server, stress_server):
        server.complete("one more", max_tokens=4)
        entries = read_c_op_trap(server.trap_path)
        summary = summarize_c_ops(entries)
        print(f"\n{server.name}: torch.ops._C* calls (phase, op: count):\n{summary}")
        assert entries, f"{server.name}: the trap recorded nothing (not installed?)"
        assert not [e for e in entries if e[0] == "model"], (
            f"{server.name}: vLLM compiled ops called inside our model:\n{summary}"
        )


def test_tp2_prefix_hit_chunked_prefill_and_preemption(tp2_server, prompts, alone, ckpt_bf16):
    server = tp2_server
    log = server.log_text()
    assert "tensor_parallel_size=2" in log and "chunked prefill True" in log, server.log_tail()
    vocab = json.loads((ckpt_bf16 / "config.json").read_text())["vocab_size"]
    # prefix caching: 512 shared tokens hit, and give the tokens of the same request uncached
    shared = random_prompt(512, seed=77, vocab=vocab)
    first = shared + random_prompt(88, seed=78, vocab=vocab)
    second = shared + random_prompt(88, seed=79, vocab=vocab)
    server.complete(first, **greedy_params("tp2-prefix"))
    hits1 = server.metric(HITS)
    out = server.complete(second, **greedy_params("tp2-prefix"))
    assert server.metric(HITS) - hits1 == 512, "the second request did not hit 512 cached tokens"
    msg, _ = compare_greedy(
        Greedy.of(out),
        _run(server, second, salt="tp2-fresh"),
        lp_tol=LP_TOL,
        tie_gap=TIE_GAP,
        what="TP=2: 512 cached prompt tokens vs the same request uncached",
    )
    print(f"\n{msg}")
    # chunked prefill (64-token steps) of long prompts alone, then preemption under concurrency
    _compare_all(
        {n: _run(server, prompts[n], salt=f"tp2-{n}") for n in CHUNKED_LENGTHS},
        alone,
        f"TP=2, {STEP_TOKENS}-token chunks vs one rank one-shot",
    )
    pre0 = server.metric(PREEMPTIONS)
    outs = map_concurrently(
        lambda n: (n, _run(server, prompts[n], salt=f"tp2c-{n}")), PREEMPT_LENGTHS
    )
    preempted = server.metric(PREEMPTIONS) - pre0
    assert preempted > 0, "no preemption at TP=2: the test tested nothing"
    _compare_all(dict(outs), alone, f"TP=2, preempted ({preempted:.0f} preemptions) vs one rank")
