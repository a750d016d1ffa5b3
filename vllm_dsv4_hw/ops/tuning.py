# SPDX-License-Identifier: Apache-2.0
"""Launch choices as data: one frozen config per op family, the product's values as defaults.

Kernels read the config in force (:func:`current`) when they launch; a benchmark or a test that
compares choices passes its own for a scope (:func:`override`: a context variable, so nothing
mutates a module global and the product's values are restored on exit, also on an exception).
Each choice says in one line what it picks; the evidence (command, card, date) is in
``docs/tuning.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

SELECTS = ("auto", "radix", "torch")


@dataclass(frozen=True)
class IndexerTuning:
    """The indexer's selection after scoring."""

    # radix select kernels, torch.topk + one compaction, or auto: radix up to radix_max_scores
    select: str = "auto"
    radix_max_scores: int = 1 << 20
    # the radix select reads each row only up to the token's visible entries, and the score pass
    # stores nothing past them (block tables wider than the context: a long --max-model-len)
    bounded: bool = True

    def __post_init__(self) -> None:
        if self.select not in SELECTS:
            raise ValueError(f"IndexerTuning.select={self.select!r}; use one of {SELECTS}")

    def radix(self, rows: int, n: int) -> bool:
        """Whether ``rows`` score rows of ``n`` entries take the radix select."""
        return self.select == "radix" or (
            self.select == "auto" and rows * n <= self.radix_max_scores
        )


@dataclass(frozen=True)
class SparseAttentionTuning:
    # each split stops after its last compressed candidate instead of walking every tile
    trim: bool = True


@dataclass(frozen=True)
class LinearTuning:
    # FP8 linears that quantize x take the one-row GEMV up to this many rows (tiles above)
    gemv_max_rows: int = 1


@dataclass(frozen=True)
class MoETuning:
    # routed experts: one GEMV program per (token, slot) pair and weight tile up to this many
    # tokens (FP4 weights), the grouped GEMM over expert-sorted pairs above
    gemv_max_tokens: int = 16


@dataclass(frozen=True)
class RowsTuning:
    # CUDA: programs per SM before the row-wise kernels loop over rows (None: one per row)
    cuda_programs_per_sm: int | None = 32


@dataclass(frozen=True)
class Tuning:
    indexer: IndexerTuning = IndexerTuning()
    sparse_attention: SparseAttentionTuning = SparseAttentionTuning()
    linear: LinearTuning = LinearTuning()
    moe: MoETuning = MoETuning()
    rows: RowsTuning = RowsTuning()


PRODUCT = Tuning()
_CURRENT: ContextVar[Tuning] = ContextVar("vllm_dsv4_hw_tuning", default=PRODUCT)


def current() -> Tuning:
    """The configs in force: the product's, or an :func:`override`'s inside its scope."""
    return _CURRENT.get()


@contextlib.contextmanager
def override(**families) -> Iterator[Tuning]:
    """``with override(indexer=IndexerTuning(select="torch")): ...``: those families' configs
    for the scope (the others stay as they are). Unknown family names fail here."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    unknown = sorted(set(families) - names)
    if unknown:
        raise TypeError(f"override: no op family {unknown}; families: {sorted(names)}")
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **families))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
