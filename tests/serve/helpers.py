# SPDX-License-Identifier: Apache-2.0
"""Prompts, greedy-output comparison and the ``torch.ops._C*`` trap file, for the serve tests."""

from __future__ import annotations

import random
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

NEW_TOKENS = 32
TOP = 5


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids, reproducible in ``seed``; skips the special ids at both ends of the
    vocabulary (BOS / EOS / role markers at the start, reserved ids at the end)."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab - 64) for _ in range(n)]


def greedy_params(salt: str | None = None, **extra) -> dict:
    """Request fields for a comparable greedy run: 32 tokens (EOS ignored), token ids, the top-5
    logprobs keyed by token id; ``salt`` (vLLM's ``cache_salt``) keeps the request out of other
    requests' prefix-cache entries."""
    params = {
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": TOP,
        "return_tokens_as_token_ids": True,
    }
    if salt is not None:
        params["cache_salt"] = salt
    params.update(extra)
    return params


@dataclass
class Greedy:
    ids: list[int]
    logprobs: list[float]  # of the chosen token at each step
    top: list[dict[int, float]]  # top-5 at each step, by token id

    @classmethod
    def of(cls, choice: dict) -> Greedy:
        lp = choice["logprobs"]
        top = [{int(k.split(":", 1)[1]): v for k, v in step.items()} for step in lp["top_logprobs"]]
        return cls(list(choice["token_ids"]), list(lp["token_logprobs"]), top)


class GreedyMismatch(AssertionError):
    pass


def compare_greedy(
    got: Greedy, ref: Greedy, *, lp_tol: float, tie_gap: float, what: str = ""
) -> tuple[str, float]:
    """Check ``got`` against ``ref`` (same prompt, another server or batch); returns
    (summary, max |dlogprob| of the chosen tokens over the equal steps).

    Tokens must be equal, with the chosen token's logprob within ``lp_tol``, up to the end or up
    to a step where both runs have a near-tie between the two tokens (each run's margin of its
    own token over the other's within ``tie_gap``): from there on the continuations condition on
    different tokens and are not compared. Any other difference raises :class:`GreedyMismatch`.
    """
    assert len(got.ids) == len(ref.ids) == NEW_TOKENS, (what, len(got.ids), len(ref.ids))
    worst = 0.0
    for i, (a, b) in enumerate(zip(got.ids, ref.ids)):
        if a == b:
            d = abs(got.logprobs[i] - ref.logprobs[i])
            worst = max(worst, d)
            if d > lp_tol:
                raise GreedyMismatch(
                    f"{what}: step {i}: same token {a} but logprob {got.logprobs[i]:.4f} vs "
                    f"{ref.logprobs[i]:.4f} (|d| {d:.4f} > {lp_tol})\n got {got.ids}\n ref {ref.ids}"
                )
            continue
        ref_alt, got_alt = ref.top[i].get(a), got.top[i].get(b)
        ref_margin = None if ref_alt is None else ref.logprobs[i] - ref_alt
        got_margin = None if got_alt is None else got.logprobs[i] - got_alt
        if ref_margin is None or got_margin is None or max(ref_margin, got_margin) > tie_gap:
            raise GreedyMismatch(
                f"{what}: step {i}: token {a} vs reference {b}, not a near-tie (reference margin "
                f"{ref_margin}, this run's margin {got_margin}, tie gap {tie_gap})\n"
                f" got {got.ids}\n ref {ref.ids}\n got top-5 {got.top[i]}\n ref top-5 {ref.top[i]}"
            )
        msg = (
            f"{what}: equal for {i} tokens, then a near-tie ({a} vs {b}; margins "
            f"{got_margin:.4f} / {ref_margin:.4f})"
        )
        warnings.warn(msg, NearTieDivergence, stacklevel=2)
        return msg, worst
    return f"{what}: all {NEW_TOKENS} tokens equal (max |dlogprob| {worst:.2e})", worst


class NearTieDivergence(UserWarning):
    """Two greedy runs took different tokens where both had a near-tie (reported, not a failure)."""


def read_c_op_trap(path: str | Path) -> list[tuple[str, str, int]]:
    """(phase, op, pid) lines written by ``tests.support.c_op_trap``; [] if the file is absent."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            out.append((parts[0], parts[1], int(parts[2])))
    return out


def summarize_c_ops(entries: list[tuple[str, str, int]]) -> str:
    counts = Counter((phase, op) for phase, op, _ in entries)
    if not counts:
        return "(no torch.ops._C* calls recorded)"
    return "\n".join(f"  {phase:6s} {op}: {n}" for (phase, op), n in sorted(counts.items()))


class GaugeWatch:
    """Polls ``/metrics`` in a thread while a block runs; ``max[name]`` is the largest value seen
    (e.g. ``vllm:num_requests_running``: did requests really run together?)."""

    def __init__(
        self,
        server,
        names: tuple[str, ...] = ("vllm:num_requests_running",),
        interval: float = 0.25,
    ) -> None:
        import threading

        self.server, self.names, self.interval = server, names, interval
        self.max = {n: 0.0 for n in names}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                m = self.server.metrics()
            except (OSError, ValueError, RuntimeError):  # a failed poll is not the subject
                m = {}
            for n in self.names:
                if n in m:
                    self.max[n] = max(self.max[n], m[n])
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def drop_tensor(ckpt: Path, name: str) -> None:
    """Remove tensor ``name`` from a checkpoint directory: from its shard file and from
    ``model.safetensors.index.json``."""
    import json

    from safetensors.torch import load_file, save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
