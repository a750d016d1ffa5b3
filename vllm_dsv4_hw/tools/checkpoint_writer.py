# SPDX-License-Identifier: Apache-2.0
"""How ``make-checkpoint`` lays out and writes its tensors: the shard plan, and safetensors files
filled in place by worker threads.

* :func:`plan_checkpoint` knows, before any weight exists, every on-disk tensor's name, dtype,
  shape, shard file and byte offset (``TensorSpec.stored``): shards of about ``shard_bytes`` in
  checkpoint order, each file's tensors ordered as ``safetensors.save_file`` orders them (widest
  dtype first, then by name, so every tensor is aligned to its element size).
* :func:`write_shards` writes each file's header, sizes the file, then runs ``work`` items (one
  tensor, or a block of rows of a large one) on a thread pool; each item generates its values,
  encodes them and ``pwrite``s the bytes at their offsets. No shard is ever held in memory, the
  cores work on different tensors at once (torch ops release the GIL; one intra-op thread each),
  and ``say`` gets a progress line per layer and every few seconds.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_dsv4_hw.model.layout import TensorSpec, tensor_specs

SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.int64: "I64",
}
REPORT_SECONDS = 10.0


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: int  # index into CheckpointPlan.files
    offset: int  # byte offset of its data in the file (header included)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class CheckpointPlan:
    """Everything a checkpoint of ``cfg`` in ``dtype`` holds, before a weight is drawn."""

    cfg: dict
    dtype: str
    specs: list[TensorSpec]
    tensors: dict[str, StoredTensor]  # in checkpoint order
    files: list[str]
    headers: list[bytes]  # each file's 8-byte length + JSON header (padded)
    file_sizes: list[int]
    num_params: int = 0
    num_params_main: int = 0
    tensor_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.tensor_bytes = sum(t.nbytes for t in self.tensors.values())

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape), as ``model.layout.stored_layout`` gives it."""
        return {n: (t.dtype, t.shape) for n, t in self.tensors.items()}

    def weight_map(self) -> dict[str, str]:
        return {n: self.files[t.shard] for n, t in self.tensors.items()}


def plan_checkpoint(cfg: dict, dtype: str, shard_bytes: int) -> CheckpointPlan:
    """The shard plan of a checkpoint (see the module docstring)."""
    specs = tensor_specs(cfg)
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for spec in specs:
        for name, (dt, shape) in spec.stored(dtype).items():
            nbytes = math.prod(shape) * dt.itemsize
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dt, tuple(shape)))
            size += nbytes
    n = len(groups)
    placed: dict[str, StoredTensor] = {}
    files, headers, sizes = [], [], []
    for i, group in enumerate(groups):
        files.append(f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        entries, start = {}, 0
        order = sorted(group, key=lambda e: (-e[1].itemsize, e[0]))
        for name, dt, shape in order:
            end = start + math.prod(shape) * dt.itemsize
            entries[name] = {
                "dtype": SAFETENSORS_DTYPES[dt],
                "shape": list(shape),
                "data_offsets": [start, end],
            }
            start = end
        text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":"))
        text += " " * (-len(text) % 8)  # as safetensors pads it: data starts 8-byte aligned
        header = len(text).to_bytes(8, "little") + text.encode()
        headers.append(header)
        sizes.append(len(header) + start)
        for name, dt, shape in group:
            placed[name] = StoredTensor(
                name, dt, shape, i, len(header) + entries[name]["data_offsets"][0]
            )
    ordered = {name: placed[name] for group in groups for name, _, _ in group}
    main = sum(s.numel for s in specs if not s.name.startswith("mtp."))
    return CheckpointPlan(
        cfg=cfg,
        dtype=dtype,
        specs=specs,
        tensors=ordered,
        files=files,
        headers=headers,
        file_sizes=sizes,
        num_params=sum(s.numel for s in specs),
        num_params_main=main,
    )


# -- writing --------------------------------------------------------------------------------------
def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def store(fd: int, t: torch.Tensor, offset: int) -> None:
    """Write ``t``'s bytes (little-endian, row-major) at ``offset`` of the open file ``fd``."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    _pwrite_all(fd, memoryview(raw.numpy()).cast("B"), offset)


def _human(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class _Progress:
    def __init__(self, total: int, say: Callable[[str], None]) -> None:
        self.total, self.say, self.done = max(total, 1), say, 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * round(20 * frac) + "." * (20 - round(20 * frac))
        dt = time.monotonic() - self.t0
        rate = self.done / dt if dt > 0 else 0.0
        eta = f", ETA {_human((self.total - self.done) / rate)}" if rate and frac < 1 else ""
        return (
            f"[{bar}] {100 * frac:3.0f}% {self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB, "
            f"{rate / 2**20:.0f} MiB/s, {_human(dt)}{eta}"
        )

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes

    def tick(self, what: str | None = None) -> None:
        now = time.monotonic()
        if what is not None:
            self.say(f"{what} {self.line()}")
        elif now - self.last >= REPORT_SECONDS:
            self.say(self.line())
        else:
            return
        self.last = now


@dataclass(frozen=True)
class WorkItem:
    """One unit of generation: ``run(fds)`` writes its bytes and returns how many. ``label``: the
    block it belongs to (``layers.3``, ``mtp.0``; None for the top-level tensors)."""

    run: Callable[[dict[int, int]], int]
    label: str | None


def write_shards(
    root: Path,
    plan: CheckpointPlan,
    items: Iterable[WorkItem],
    workers: int,
    say: Callable[[str], None],
) -> None:
    """Create ``plan``'s files under ``root`` and fill them by running ``items`` on ``workers``
    threads (at most ``2 * workers`` queued at a time)."""
    fds: dict[int, int] = {}
    try:
        for i, (fname, header, size) in enumerate(
            zip(plan.files, plan.headers, plan.file_sizes, strict=True)
        ):
            fd = os.open(root / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds[i] = fd
            os.fchmod(fd, 0o644)
            _pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, size)
        progress = _Progress(plan.tensor_bytes, say)
        threads = torch.get_num_threads()
        pool = ThreadPoolExecutor(
            max_workers=workers, initializer=torch.set_num_threads, initargs=(1,)
        )
        pending: deque = deque()
        label = None
        try:
            for item in items:
                if item.label != label and item.label is not None:
                    progress.tick(f"generating {item.label}")
                label = item.label
                pending.append(pool.submit(item.run, fds))
                while len(pending) >= 2 * workers or (pending and pending[0].done()):
                    progress.add(pending.popleft().result())
                    progress.tick()
            while pending:
                progress.add(pending.popleft().result())
                progress.tick()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        progress.tick("generated")
    finally:
        for fd in fds.values():
            os.close(fd)
