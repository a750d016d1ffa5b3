# SPDX-License-Identifier: Apache-2.0
"""Programmatic dependent launch (PDL) for the Triton kernels.

With PDL a kernel is launched while its predecessor in the stream is still running; it must wait
(``griddepcontrol.wait``: the predecessor has completed and its memory is visible) before it
touches memory. Every kernel here starts with :func:`pdl_start`, which waits and then signals that
its own successor may launch, so the kernels still run one after another as far as memory is
concerned (each waits for the one before it) and only the next kernel's launch and start overlap
this one's run. The other order (signal, then wait: what upstream vLLM's PDL kernels do) lets a
whole chain of kernels launch at once, each holding its programs' registers and shared memory
while it waits, which made the decode step slower (evidence: docs/tuning.md, Launch choices in
force, and their evidence: the PDL row). Kernels without PDL (torch's, or any launched without
the attribute) keep the usual stream order; a PDL kernel after one of them starts when it ends.

``pdl_launch(device)`` gives the launch arguments: the kernel's ``PDL`` constexpr and Triton's
``launch_pdl`` option, where the device declares ``pdl`` (CUDA sm_90+) and ``VLLM_DSV4_HW_PDL``
is on (read at a device's first launch); nothing elsewhere (the kernels' ``PDL`` defaults to
False, so no griddepcontrol instruction is emitted for older GPUs, ROCm, Ascend or the
interpreter).

A GEMM's weight does not depend on the kernel before it, so a GEMM may ask L2 for the first bytes
of its weight rows before it waits (:func:`pdl_start_prefetching`; ``weight_prefetch(device)``
gives the byte count, ``VLLM_DSV4_HW_WEIGHT_PREFETCH``): those bytes then stream while the
predecessor (often a small kernel that leaves HBM idle) finishes, instead of after it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.ops.triton.common.launch import capabilities

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without griddepcontrol (triton-ascend): PDL is never on there

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


def pdl_launch(device: torch.device) -> dict:
    """``**`` into a launch: PDL where the device and the setting allow it (decided once per
    device: every launch asks, and eager decode makes ~1,300 launches a step)."""
    return _ON if _pdl_on(device.type, device.index) else _OFF


@functools.lru_cache(maxsize=None)
def _pdl_on(kind: str, index: int | None) -> bool:
    return kind == "cuda" and capabilities(torch.device(kind, index)).pdl and envs.pdl()


def weight_prefetch(device: torch.device, nbytes: int | None = None) -> dict:
    """``**`` into a GEMM launch next to ``pdl_launch``: ``PF_BYTES``, the bytes of each weight
    row its programs ask L2 for before the PDL wait (``nbytes``, else the setting
    ``VLLM_DSV4_HW_WEIGHT_PREFETCH``; 0 where PDL is off: nothing before the wait on any other
    device, no prefetch instruction compiled there)."""
    if nbytes is None:
        return {"PF_BYTES": _prefetch_bytes(device.type, device.index)}
    return {"PF_BYTES": nbytes if _pdl_on(device.type, device.index) else 0}


@functools.lru_cache(maxsize=None)
def _prefetch_bytes(kind: str, index: int | None) -> int:
    return envs.weight_prefetch() if _pdl_on(kind, index) else 0


@triton.jit
def _prefetch_l2(ptrs, ok):
    """``prefetch.global.L2`` of the 128-byte line of each address where ``ok``: a hint, one
    instruction a lane, nothing waits for it."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, ok.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def pdl_start_prefetching(PDL: tl.constexpr, PF_BYTES: tl.constexpr, rows, row_bytes_left):
    """:func:`pdl_start`, after asking L2 for the 128-byte lines holding the first ``PF_BYTES``
    of each weight row from ``rows`` (pointers [R]; ``row_bytes_left`` [R]: the row's bytes from
    there that this program reads, so nothing past the tensor is asked for). Only memory no
    earlier kernel writes may be named here: the wait comes after."""
    if PDL:
        if PF_BYTES > 0:
            line = tl.arange(0, (PF_BYTES + 127) // 128) * 128
            addr = rows.to(tl.pointer_type(tl.uint8))[:, None] + line[None, :]
            _prefetch_l2(addr, line[None, :] < row_bytes_left[:, None])
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
