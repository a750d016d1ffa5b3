# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` of the tiny FP8 checkpoint (what ``make serve`` runs: bf16 compute, default cache
formats) through the OpenAI API: completions, chat, streaming, the length limit, our model class in
the log, and no vLLM compiled operator (``torch.ops._C*``) inside the model.

One server for the module (about 35 s to start on 2 cores).
"""

from __future__ import annotations

import re

import pytest

from tests.serve.helpers import random_prompt, read_c_op_trap, summarize_c_ops
from tests.serve.server import ServerSpec

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
SERVERS = {
    "api_server": ServerSpec("api", checkpoint="fp8", max_model_len=MAX_MODEL_LEN, trap_c_ops=True)
}


@pytest.fixture(scope="module")
def api_server(vllm_servers):
    yield vllm_servers.get(SERVERS["api_server"])
    vllm_servers.stop("api")


def test_log_names_our_model_class_and_kv_layout(api_server):
    lines = api_server.log_lines("DSV4ForCausalLM (vllm_dsv4_hw)")
    assert lines, "our model class did not log its line\n" + api_server.log_tail()
    line = lines[0]
    assert re.search(r"with 5 layers, compress ratios \[0, 0, 4, 128, 4\]; KV layout: ", line), line
    layout = line.split("KV layout: ", 1)[1]
    for kind in ("window_kv", "c4a_kv", "c128a_kv", "indexer_kv", "c4a_state"):
        assert kind in layout, (kind, line)
    # vLLM sized the cache from our specs (its own line), not from a built-in model class.
    assert api_server.log_lines("CPU KV cache size:") or api_server.log_lines("KV cache size"), (
        api_server.log_tail()
    )


def test_completions(api_server):
    out = api_server.complete("The quick brown fox", ignore_eos=True)
    assert len(out["token_ids"]) == 32, out
    assert isinstance(out["text"], str) and out["text"], out
    assert out["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 32, out["usage"]
    # The same request again: greedy, alone on the server -> the same tokens.
    assert (
        api_server.complete("The quick brown fox", ignore_eos=True)["token_ids"] == out["token_ids"]
    )


def test_chat_completions(api_server):
    messages = [{"role": "user", "content": "Name three colours."}]
    out = api_server.chat(messages, ignore_eos=True)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"], out
    assert len(choice["token_ids"]) == 32 and out["usage"]["completion_tokens"] == 32, out
    # The chat template's prompt, sent as token ids to /v1/completions: the same greedy tokens.
    prompt_ids = out["prompt_token_ids"]
    assert prompt_ids and len(prompt_ids) == out["usage"]["prompt_tokens"], out
    again = api_server.complete(prompt_ids, ignore_eos=True)
    assert again["token_ids"] == choice["token_ids"], (again["token_ids"], choice["token_ids"])


def test_streaming_equals_non_streamed(api_server):
    prompt = "Once upon a time"
    want = api_server.complete(prompt, ignore_eos=True)
    chunks = api_server.stream_completion(prompt, ignore_eos=True)
    assert len(chunks) >= 2, chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in (c["choices"][0].get("token_ids") or [])]
    finish = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert ids == want["token_ids"], (ids, want["token_ids"])
    assert text == want["text"], (text, want["text"])
    assert finish == ["length"], finish

    messages = [{"role": "user", "content": "Count to five."}]
    want_chat = api_server.chat(messages, ignore_eos=True)["choices"][0]["message"]["content"]
    body = {
        "model": api_server.served_model_name,
        "messages": messages,
        "max_tokens": 32,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    deltas = [
        c["choices"][0]["delta"].get("content") or ""
        for c in api_server.stream("/v1/chat/completions", body)
        if c["choices"]
    ]
    assert "".join(deltas) == want_chat, ("".join(deltas), want_chat)


def test_prompt_over_max_model_len_is_rejected_and_server_keeps_serving(api_server):
    vocab = api_server.vocab_size
    status, raw = api_server.request(
        "POST",
        "/v1/completions",
        api_server.completion_body(random_prompt(MAX_MODEL_LEN + 10, seed=7, vocab=vocab)),
    )
    body = raw.decode(errors="replace")
    assert status == 400, (status, body)
    assert "maximum context length" in body and str(MAX_MODEL_LEN) in body, body

    status, raw = api_server.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": api_server.served_model_name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "word " * (3 * MAX_MODEL_LEN)}],
        },
    )
    body = raw.decode(errors="replace")
    assert status == 400 and "maximum context length" in body, (status, body)

    out = api_server.complete(random_prompt(300, seed=8, vocab=vocab), ignore_eos=True)
    assert len(out["token_ids"]) == 32, out


def test_no_vllm_compiled_ops_inside_the_model(api_server):
    """With every ``torch.ops._C*`` call trapped (``tests.support.c_op_trap``), serving requests of
    every kind records no call while our model loads, runs or computes logits (phase ``model``).
    vLLM's own worker code may call them (phase ``engine``): listed for the record."""
    vocab = api_server.vocab_size
    api_server.complete(random_prompt(600, seed=9, vocab=vocab), ignore_eos=True)
    api_server.chat([{"role": "user", "content": "hello"}], max_tokens=8)
    list(
        api_server.stream("/v1/completions", api_server.completion_body("stream me", max_tokens=8))
    )
    entries = read_c_op_trap(api_server.trap_path)
    summary = summarize_c_ops(entries)
    print(f"\ntorch.ops._C* calls while serving (phase, op: count):\n{summary}")
    model = [e for e in entries if e[0] == "model"]
    assert not model, f"vLLM compiled ops called inside our model:\n{summary}"
    # The trap is armed: vLLM's CPU worker calls some _C ops itself (init_cpu_memory_env, slot
    # mappings, greedy argmax), so an empty record means the trap was not installed.
    assert entries, (
        "the torch.ops._C* trap recorded nothing: not installed in the worker?\n"
        + api_server.log_tail()
    )
