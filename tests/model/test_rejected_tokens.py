# SPDX-License-Identifier: Apache-2.0
"""Draft tokens that speculative decoding rejects leave nothing behind, at the model level: a
verification chunk whose last tokens are wrong (one of them completing a c4a and a c128a
compressor group, so that its pooled entries and indexer keys were written from a wrong row),
then the accepted positions decoded again, gives the logits of a run that never saw the wrong
tokens (issue 48, "Rejected tokens leave nothing behind"). The caches are keyed by position:
decoding a position again rewrites its window row, its compressor state row and, where it
closes a group, the group's pooled entry and indexer key; and no step reads a position past its
own, so the stale rows above the accepted ones are never read before they are rewritten."""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import SEED
from tests.model.test_network import SingleSequenceRunner
from vllm_dsv4_hw.ops.registry import REGISTRY
from vllm_dsv4_hw.tools import checkpoint as ck

pytestmark = pytest.mark.usefixtures("vllm_single_rank", "one_thread")

PREFIX = 125  # the chunk covers 125..128: position 127 closes a c4a group and the c128a group
CLOSES = 127
TOL = 2e-4  # on log-probabilities


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "reference")
    REGISTRY.clear_cache()
    yield
    REGISTRY.clear_cache()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("rejected") / "tiny-flash-bf16"
    ck.make_checkpoint(path, "tiny-flash", "bf16", SEED, progress=lambda _m: None)
    return path


def _run(runner: SingleSequenceRunner, steps) -> list[torch.Tensor]:
    """Log-probabilities of each step, a step being (first position, token ids)."""
    runner._reset()
    out = []
    for pos, ids in steps:
        runner.pos = pos
        out.append(runner._step(ids).log_softmax(-1))
    return out


@pytest.mark.parametrize("formats", [("fp32", "fp32"), ("fp8", "mxfp4")])
def test_rejected_tokens_that_close_compressor_groups_leave_nothing_behind(ckpt, formats):
    runner = SingleSequenceRunner(ckpt, torch.float32, *formats, max_len=256)
    cfg = runner.cfg
    assert 4 in cfg.compress_ratios and 128 in cfg.compress_ratios
    assert (CLOSES + 1) % 128 == 0
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg.vocab_size, (PREFIX + 6,), generator=gen)
    # two drafts, never the right tokens
    wrong = (ids[CLOSES : CLOSES + 2] + 1 + torch.arange(2)) % cfg.vocab_size
    head = [(0, ids[:PREFIX])]
    tail = [(p, ids[p : p + 1]) for p in range(CLOSES, PREFIX + 6)]
    # without speculation: the chunk holds the accepted tokens only, then one token a step
    plain = _run(runner, [*head, (PREFIX, ids[PREFIX:CLOSES]), *tail])
    # with it: the verification chunk also holds two rejected drafts (positions 127, 128),
    # then decoding resumes at 127 with the right token
    chunk = torch.cat([ids[PREFIX:CLOSES], wrong])
    spec = _run(runner, [*head, (PREFIX, chunk), *tail])
    # the same up to fp32 rounding (a chunk of another length rounds its rows apart by ~1e-5;
    # a stale row or pooled entry moves them by more than 1e-2, see below)
    pairs = [(spec[1][: CLOSES - PREFIX], plain[1]), *zip(spec[2:], plain[2:])]
    errs = [float((got - want).abs().max()) for got, want in pairs]
    assert max(errs) <= TOL, errs
    # the check can fail: not rewriting 127 leaves the wrong row and pooled entries in use
    stale = _run(runner, [*head, (PREFIX, chunk), *tail[1:]])
    assert float((stale[-1] - plain[-1]).abs().max()) > 50 * TOL
