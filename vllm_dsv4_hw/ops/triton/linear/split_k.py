# SPDX-License-Identifier: Apache-2.0
"""Split-K outputs of the weight GEMMs (``fp8_linear``, ``fp8_dot_linear``, ``dense_linear``):
the partials' buffers, their sum by the tiles' last splits inside the launch (``store_tile``,
per-stream arrival counters) or by a second launch (``splitk_sum_kernel``), and the store of a
tile in the output's dtype (``store_out``: bf16 rounded in fp32 first; int16 bits under the
interpreter)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.ops.reference.linear import Fp8LinearArgs
from vllm_dsv4_hw.ops.triton.common.counters import arrival_counters
from vllm_dsv4_hw.ops.triton.common.launch import cdiv
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.quant import f32_to_bf16_bits, round_to_bf16


@triton.jit
def store_out(ptr, v, mask, OUT_BF16: tl.constexpr):
    """Store ``v`` converted to ptr's dtype; bf16 is rounded (nearest even) in fp32 first.
    OUT_BF16 == 2 (the interpreter): ``ptr`` is an int16 view and the bf16 bits are stored as
    such, because the interpreter's conversion to bf16 garbles subnormal values."""
    if OUT_BF16 == 2:
        tl.store(ptr, f32_to_bf16_bits(v.to(tl.float32)).to(tl.int16, bitcast=True), mask=mask)
    elif OUT_BF16 == 1:
        tl.store(ptr, round_to_bf16(v.to(tl.float32)).to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(
    out_ptr,
    red_ptr,
    cnt_ptr,
    pid,
    pid_s,
    rel,
    acc,
    mask,
    sos,
    OUT_BF16: tl.constexpr,
    SERIAL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_BF16: tl.constexpr,
):
    """A GEMM tile's result: stored (split ``pid_s``'s partial, or the output); with SERIAL,
    the tile's last split to finish sums the partials in split order (the bits of the separate
    sum launch, whichever split is last) and resets the tile's counter for the next launch on
    this stream. The barrier orders every thread's partial stores before the acq_rel count; the
    partials are read from L2 (.cg), where they were written, all loads issued at once (unrolled
    over the SPLITS partials)."""
    store_out(out_ptr + pid_s.to(tl.int64) * sos + rel, acc, mask, OUT_BF16)
    if SERIAL:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            tot = tl.zeros(acc.shape, dtype=acc.dtype)
            for s in tl.static_range(SPLITS):
                tot += tl.load(out_ptr + s * sos + rel, mask=mask, other=0.0, cache_modifier=".cg")
            store_out(red_ptr + rel, tot, mask, RED_BF16)
            tl.store(cnt_ptr + pid, 0)


@triton.jit
def splitk_sum_kernel(
    part_ptr,
    out_ptr,
    n_splits,
    n_elems,
    stride_s,
    BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out = sum over the split-K partials [S, ...] (in split order), cast to out's dtype: one
    launch instead of a reduction and a cast."""
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elems
    acc = tl.zeros([BLOCK], dtype=part_ptr.dtype.element_ty)
    for s in range(0, n_splits):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=m, other=0.0)
    store_out(out_ptr + offs, acc, m, OUT_BF16)


# Split-K partials summed by the tile's last split inside the GEMM launch or by a second launch
# (``splitk_sum_kernel``); same bits either way. In the launch for one row tile of <= 16 rows
# (decode), where it wins; at 32 rows the last split's sum loses (evidence: docs/tuning.md,
# Split-K sum in the launch). Knob ``serial=`` for benchmarks and tests.
SERIAL_SPLIT_K = True
SERIAL_MAX_ROWS = 16


class SplitOutputs(NamedTuple):
    """A GEMM launch's output buffers: the output itself, or S split-K partials in the
    accumulator dtype plus the output their sum goes to (by the tiles' last splits when
    ``serial``, else by :meth:`finish`'s sum launch); int16 views where the interpreter stores
    bf16 bits (``store_out``)."""

    out: torch.Tensor
    out_arg: torch.Tensor
    red: torch.Tensor
    red_arg: torch.Tensor
    counters: torch.Tensor | None
    split_k: int
    sos: int
    bf16_mode: int
    direct_bf16: int

    @classmethod
    def make(
        cls, a: Fp8LinearArgs, split_k: int, acc_dtype: torch.dtype, serial: bool, tiles: int
    ) -> "SplitOutputs":
        m, g, n, dev = a.m, a.g, a.n, a.x.device
        if split_k == 1:
            out = torch.empty(m, g, n, dtype=a.out_dtype, device=dev)
        else:
            out = torch.empty(split_k, m, g, n, dtype=acc_dtype, device=dev)
        bf16_mode = (2 if dev.type == "cpu" else 1) if a.out_dtype == torch.bfloat16 else 0
        direct_bf16 = bf16_mode if split_k == 1 else 0
        out_arg = out.view(torch.int16) if direct_bf16 == 2 else out
        counters = arrival_counters(dev, tiles) if split_k > 1 and serial else None
        red = out if split_k == 1 else torch.empty(m, g, n, dtype=a.out_dtype, device=dev)
        red_arg = red.view(torch.int16) if bf16_mode == 2 else red
        return cls(
            out,
            out_arg,
            red,
            red_arg,
            counters,
            split_k,
            0 if split_k == 1 else out.stride(0),
            bf16_mode,
            direct_bf16,
        )

    @property
    def serial(self) -> bool:
        return self.counters is not None

    @property
    def splits(self) -> int:
        """The kernel's SPLITS constexpr (1 unless the tiles sum their partials)."""
        return self.split_k if self.serial else 1

    @property
    def cnt_arg(self) -> torch.Tensor:
        return self.counters if self.serial else self.out_arg

    def finish(self, a: Fp8LinearArgs) -> torch.Tensor:
        """The result after the launch: the partials summed by a second launch unless the tiles
        did, in a's shape."""
        if self.split_k > 1 and not self.serial:
            ne = self.red.numel()
            splitk_sum_kernel[(cdiv(ne, 1024),)](
                self.out,
                self.red_arg,
                self.split_k,
                ne,
                self.out.stride(0),
                BLOCK=1024,
                OUT_BF16=self.bf16_mode,
                num_warps=4,
                **pdl_launch(self.out.device),
            )
        return self.red if a.grouped else self.red.view(a.m, a.n)
