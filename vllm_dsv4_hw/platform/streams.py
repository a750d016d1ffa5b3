# SPDX-License-Identifier: Apache-2.0
"""Device-agnostic auxiliary streams: run independent branches beside the main stream, then join.

Same call shape on every device::

    aux = AuxStreams(device, num_branches=2)
    with aux.branch(0):          # e.g. the indexer pipeline
        ...
    with aux.branch(1):          # e.g. main compression
        ...
    window_insert(...)           # stays on the current stream
    aux.join()                   # current stream waits for both branches

On CUDA and Ascend the branches run on the device module's own streams (``torch.cuda`` /
``torch.npu``: ``Stream``, ``Event``, ``stream()`` context, ``current_stream()``), ordered by events:
each branch first waits for the work already queued on the current stream, and ``join`` makes the
current stream wait for every branch. On CPU (or with ``VLLM_DSV4_HW_MULTI_STREAM=0``) branches run
inline, in order, so results are identical everywhere.

Memory rule (as with any multi-stream PyTorch code): tensors a branch reads or writes must stay
alive until ``join``; ``AuxStreams`` keeps the references passed to ``keep_alive`` until then.
Streams are created once per ``AuxStreams`` object, so CUDA-graph capture sees stable streams.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.platform.device import adaptor_for

logger = logging.getLogger(__name__)


def stream_module(device_type: str):
    """The torch device module that owns streams for ``device_type`` (None: run inline)."""
    return adaptor_for(device_type).stream_module


class AuxStreams:
    def __init__(
        self,
        device: torch.device | str,
        num_branches: int = 2,
        enabled: bool | None = None,
        module: Any = None,
    ) -> None:
        self.device = torch.device(device)
        self.num_branches = num_branches
        mod = module if module is not None else stream_module(self.device.type)
        want = envs.multi_stream() if enabled is None else enabled
        self._mod = mod if (want and mod is not None) else None
        self._streams: list[Any] = []
        self._done: list[Any] = []
        self._pending: list[Any] = []
        self._alive: list[Any] = []
        if self._mod is not None:
            with self._mod.device(self.device):
                self._streams = [self._mod.Stream() for _ in range(num_branches)]
                self._done = [self._mod.Event() for _ in range(num_branches)]

    @property
    def parallel(self) -> bool:
        """True when branches really run on separate streams."""
        return self._mod is not None

    @contextlib.contextmanager
    def branch(
        self, index: int, keep_alive: tuple = (), after: tuple[int, ...] = ()
    ) -> Iterator[None]:
        """Run the block on branch ``index``'s stream, after the work queued so far on the
        current stream and after what the branches in ``after`` queued since the last join."""
        for i in (index, *after):
            if not 0 <= i < self.num_branches:
                raise IndexError(
                    f"branch {i} out of range (this AuxStreams has {self.num_branches})"
                )
        self._alive.extend(keep_alive)
        if self._mod is None:
            yield
            return
        stream = self._streams[index]
        # The branch may read what the current stream produced so far.
        stream.wait_stream(self._mod.current_stream(self.device))
        for i in after:
            # only events recorded since the last join (an older one may predate a graph capture)
            if self._done[i] in self._pending:
                stream.wait_event(self._done[i])
        try:
            with self._mod.stream(stream):
                yield
        finally:
            # Record even when the branch raised, so join() still rejoins the stream (an unjoined
            # stream would turn the real error into "capturing stream has unjoined work").
            self._done[index].record(stream)
            self._pending.append(self._done[index])

    def join(self) -> None:
        """Make the current stream wait for every branch started since the last join."""
        if self._mod is not None:
            current = self._mod.current_stream(self.device)
            for event in self._pending:
                current.wait_event(event)
        self._pending.clear()
        self._alive.clear()

    def __enter__(self) -> "AuxStreams":
        return self

    def __exit__(self, *exc) -> None:
        self.join()


_SHARED: dict[tuple[str, bool, int], AuxStreams] = {}


def aux_streams(device: torch.device | str, num_branches: int = 3) -> AuxStreams:
    """The process's branch streams for ``device`` under the current ``VLLM_DSV4_HW_MULTI_STREAM``
    setting, shared by every layer (one set of side streams per device, not per layer; stable
    across steps, so graph captures see the same streams). Three by default: the attention
    layer's indexer, main compressor and indexer compressor branches."""
    dev = torch.device(device)
    key = (str(dev), envs.multi_stream(), num_branches)
    aux = _SHARED.get(key)
    if aux is None:
        aux = _SHARED[key] = AuxStreams(dev, num_branches=num_branches, enabled=key[1])
    return aux
