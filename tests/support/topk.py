# SPDX-License-Identifier: Apache-2.0
"""The indexer's top-k selections of chosen attention layers, recorded by the test itself.

:func:`record_topk` wraps each layer's ``_indexer_select`` (on the instance) and the dispatched
``ops.indexer_topk`` for the duration of a ``with`` block: every selection a wrapped layer makes
(the ``[T, topk]`` entry indices, -1 padded) is appended to that layer's list, in call order. The
runtime layer keeps no test state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllm_dsv4_hw import ops


@contextlib.contextmanager
def record_topk(layers: Iterable[nn.Module]) -> Iterator[dict[nn.Module, list[torch.Tensor]]]:
    """``{layer: [top-k of each call, ...]}`` for ``layers`` (``DSV4Attention`` with an indexer),
    filled while the block runs."""
    layers = list(layers)
    records: dict[nn.Module, list[torch.Tensor]] = {layer: [] for layer in layers}
    selecting: list[nn.Module] = []  # the wrapped layer whose selection runs now
    real_topk = ops.indexer_topk

    def indexer_topk(*args, **kwargs):
        top = real_topk(*args, **kwargs)
        if selecting:
            records[selecting[-1]].append(top)
        return top

    def wrap(layer: nn.Module):
        select = layer._indexer_select  # the class's method, bound

        def recorded(*args, **kwargs):
            selecting.append(layer)
            try:
                return select(*args, **kwargs)
            finally:
                selecting.pop()

        return recorded

    for layer in layers:
        if "_indexer_select" in vars(layer):
            raise RuntimeError(f"{layer!r}: its top-k selections are already being recorded")
        object.__setattr__(layer, "_indexer_select", wrap(layer))
    ops.indexer_topk = indexer_topk
    try:
        yield records
    finally:
        ops.indexer_topk = real_topk
        for layer in layers:
            object.__delattr__(layer, "_indexer_select")


def last_topk(
    layer: nn.Module, records: dict[nn.Module, list[torch.Tensor]]
) -> torch.Tensor | None:
    """The last selection ``layer`` made in ``records`` (None when it made none)."""
    calls = records.get(layer) or []
    return calls[-1] if calls else None
