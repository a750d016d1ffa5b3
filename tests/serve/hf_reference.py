# SPDX-License-Identifier: Apache-2.0
"""transformers' ``DeepseekV4ForCausalLM`` as the reference for the served model (float32).

For a checkpoint directory and token-id prompts: the log-softmax after every prompt position and
``new_tokens`` greedy tokens (transformers' own KV cache, no EOS stop), computed once per process:
the model per checkpoint, and each result per (checkpoint, prompt[, new_tokens]) (several servers
are measured on the same prompts: the TP=1 / TP=2 / EP parity tests; ~20 s of the CPU reference
per FP8 measurement on 2 cores).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=2)
def _model(path: str):
    from transformers import DeepseekV4ForCausalLM

    # An FP8 / FP4 checkpoint is dequantized at load (needs accelerate), to bf16 on CPU whatever
    # dtype is asked for; its values are exact in bf16, so .float() is lossless.
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()


def prompt_logprobs(path: str | Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: row j = log p(. | ids[:j+1]) (a copy of the cached result)."""
    return _prompt_logprobs(str(path), tuple(ids)).clone()


def greedy(path: str | Path, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """(tokens, top-2 gap of each step's distribution) of greedy decoding from ``ids``."""
    tokens, gaps = _greedy(str(path), tuple(ids), new_tokens)
    return list(tokens), list(gaps)


@functools.lru_cache(maxsize=8)
@torch.no_grad()
def _prompt_logprobs(path: str, ids: tuple[int, ...]) -> torch.Tensor:
    model = _model(path)
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@functools.lru_cache(maxsize=64)
@torch.no_grad()
def _greedy(path: str, ids: tuple[int, ...], new_tokens: int) -> tuple[tuple, tuple]:
    model = _model(path)
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    gaps = []
    for scores in out.scores:
        top2 = scores[0].float().log_softmax(-1).topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tuple(tokens), tuple(gaps)
