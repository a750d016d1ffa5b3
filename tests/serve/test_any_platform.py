# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` of the tiny FP8 checkpoint under platforms that are not the plugin's own, with
the plugin's platform off (``VLLM_DSV4_HW_PLATFORM=off``), each loaded through a
``vllm.platform_plugins`` entry point as a vendor's package is (``tests/foreign_platform``):

* ``foreign``: a vendor's out-of-tree platform (``PlatformEnum.OOT``, its own worker, nothing about
  DeepSeek V4): completions, chat and 8 concurrent requests give the greedy tokens of the plugin's
  own platform (the ``ref`` server of ``test_scheduling``, shared: this module sorts before it),
  and the launch rules the plugin registers (``engine/launch_rules.py``: block size, hybrid KV cache
  manager, the launch checks whose refusals ``test_dropin`` times) ran in the first process (the API
  server's), with no platform of ours;
* ``stock-cpu``: vLLM's own ``CpuPlatform`` handed out by another package: the same tokens.

All three serve in float32, for ``test_scheduling``'s reason: in bf16 a batch changes the rounding
of the hidden state and this random MoE turns one-ulp differences into other routed experts or
indexer picks (2026-12-07, on a CPU with AMX: prompt 4 of the concurrency test left a 1.4-nat
margin at step 18 in a batch; with every c4a entry selected, jumps of 0.55-0.69 nat remained). The
foreign servers load the FP8 checkpoint (the vendor's platform runs our ``dsv4_hw_fp8``), ours the
bf16 one with the same weights: the tokens agree within ``test_scheduling``'s float32 tolerances.
"""

from __future__ import annotations

import pytest

from tests.foreign_platform.entry_point import server_env
from tests.serve.helpers import (
    TOP,
    GaugeWatch,
    Greedy,
    compare_greedy,
    greedy_params,
    random_prompt,
)
from tests.serve.server import ServerSpec, map_concurrently
from tests.serve.test_scheduling import LP_TOL, TIE_GAP
from tests.serve.test_scheduling import SERVERS as SCHEDULING_SERVERS

pytestmark = pytest.mark.slow

KV_BYTES = 1 << 30  # a vendor's platform does not read VLLM_CPU_KVCACHE_SPACE: vLLM's own flag
# One OpenMP thread in the worker, as vLLM's CPU platform leaves its worker on these 2-core machines
# (bound to one core, the other reserved: "core ids=[0]" in its log). This platform has no such
# setup, so its worker ran 2 spinning OpenMP threads: 2.0 s for 32 tokens alone, but 36.5 s while
# one other process used a core (another server starting in the background); with one thread
# 2.3 s and 2.7 s (measured 2026-12-02). Thread placement only: the requests and checks are the same.
FLOAT32 = ("--dtype", "float32")
FOREIGN = ServerSpec(
    "foreign",
    checkpoint="fp8",
    max_model_len=2048,
    env={**server_env("foreign"), "OMP_NUM_THREADS": "1"},
    args=(*FLOAT32, "--kv-cache-memory-bytes", str(KV_BYTES)),
)
SERVERS = {
    "ref_server": SCHEDULING_SERVERS["ref_server"],
    "foreign_server": FOREIGN,
    "stock_cpu_server": ServerSpec(
        "stock-cpu", checkpoint="fp8", max_model_len=2048, env=server_env("stock_cpu"), args=FLOAT32
    ),
}
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
CONCURRENT = 4


@pytest.fixture(scope="module")
def ref_server(vllm_servers):
    yield vllm_servers.get(SERVERS["ref_server"])  # test_scheduling stops it after its own tests


@pytest.fixture(scope="module")
def foreign_server(vllm_servers):
    yield vllm_servers.get(SERVERS["foreign_server"])
    vllm_servers.stop("foreign")


@pytest.fixture(scope="module")
def stock_cpu_server(vllm_servers):
    yield vllm_servers.get(SERVERS["stock_cpu_server"])
    vllm_servers.stop("stock-cpu")


def _complete(server, prompt) -> Greedy:
    return Greedy.of(server.complete(prompt, **greedy_params()))


def _chat(server) -> Greedy:
    """The chat reply as a :class:`Greedy` (chat logprobs come per token, ids as "token_id:N")."""
    out = server.chat(
        MESSAGES, ignore_eos=True, logprobs=True, top_logprobs=TOP, return_tokens_as_token_ids=True
    )["choices"][0]
    steps = out["logprobs"]["content"]
    top = [
        {int(t["token"].split(":", 1)[1]): t["logprob"] for t in step["top_logprobs"]}
        for step in steps
    ]
    return Greedy(list(out["token_ids"]), [step["logprob"] for step in steps], top)


def _agree(got: dict[str, Greedy], want: dict[str, Greedy]) -> None:
    for what in want:
        compare_greedy(got[what], want[what], lp_tol=LP_TOL, tie_gap=TIE_GAP, what=what)


@pytest.fixture(scope="module")
def ours(ref_server):
    """Our platform's greedy tokens for PROMPT and MESSAGES, asked once for both platforms' tests
    (greedy on one server: the same request gives the same tokens, ``test_api`` checks that)."""
    return {"complete": _complete(ref_server, PROMPT), "chat": _chat(ref_server)}


def test_foreign_platform_is_active_and_the_launch_rules_ran_first(foreign_server):
    assert foreign_server.log_lines("foreign platform: worker tests.foreign_platform.worker"), (
        foreign_server.log_tail()
    )
    assert not foreign_server.log_lines("on the plugin's CPU platform"), "our platform was active"
    assert foreign_server.log_lines("DSV4ForCausalLM (vllm_dsv4_hw)"), "not our model class"
    rules = foreign_server.log_lines(
        "launch rules hold on platform ForeignPlatform: block size 256"
    )
    assert rules and all("APIServer" in line for line in rules), foreign_server.log_tail()


def test_foreign_platform_completions_and_chat_equal_ours(foreign_server, ours):
    _agree({"complete": _complete(foreign_server, PROMPT), "chat": _chat(foreign_server)}, ours)


def _concurrent_vs_solo(server) -> list[str]:
    vocab = server.vocab_size
    prompts = [random_prompt(9 + 37 * i, seed=300 + i, vocab=vocab) for i in range(CONCURRENT)]

    def run(i: int, how: str) -> Greedy:
        return Greedy.of(server.complete(prompts[i], **greedy_params(f"{how}-{i}")))

    solo = [run(i, "solo") for i in range(CONCURRENT)]
    with GaugeWatch(server) as watch:
        together = map_concurrently(lambda i: run(i, "together"), range(CONCURRENT))
    assert watch.max["vllm:num_requests_running"] >= 2, (
        f"requests did not run together: {watch.max}"
    )
    return [
        compare_greedy(got, ref, lp_tol=LP_TOL, tie_gap=TIE_GAP, what=f"prompt {i}")[0]
        for i, (got, ref) in enumerate(zip(together, solo))
    ]


def test_foreign_platform_concurrent_requests_equal_solo(foreign_server):
    """4 salted requests (no shared prefix-cache entries), 32 greedy tokens each, together and
    alone: a batch changes the GEMM shapes, so two greedy runs may part at a near-tie
    (``compare_greedy``'s rule, ``TIE_GAP``)."""
    print("\n" + "\n".join(_concurrent_vs_solo(foreign_server)))


def test_stock_cpu_platform_equals_ours(stock_cpu_server, ours):
    assert not stock_cpu_server.log_lines("on the plugin's CPU platform"), "our platform was active"
    _agree({"complete": _complete(stock_cpu_server, PROMPT), "chat": _chat(stock_cpu_server)}, ours)
