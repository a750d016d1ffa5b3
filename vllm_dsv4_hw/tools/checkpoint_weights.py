# SPDX-License-Identifier: Apache-2.0
"""The random weights of the generated checkpoints: each tensor's master values (fp32, or int64 for
``tid2eid``), drawn from its own generator keyed by the seed and its name (a tensor of more than
``CHUNK_ELEMENTS`` elements: each block of rows from its own), and their on-disk encoding (FP8
128x128 blocks, FP4 experts, bf16 / fp32 / int64 as the official checkpoints store them).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from vllm_dsv4_hw.model.layout import SPECIAL_HEAD_SCALE, TensorSpec, tensor_specs
from vllm_dsv4_hw.numerics import FP4_BLOCK, FP8_WEIGHT_BLOCK, WEIGHT_AMAX_FLOOR, ceil_log2, pow2
from vllm_dsv4_hw.numerics import e8m0_from_exponent as _e8m0
from vllm_dsv4_hw.quant.formats import (
    dequantize_fp4_experts,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from vllm_dsv4_hw.tools import tokenizer_gen


# -- weights ----------------------------------------------------------------------------------------
def _generator(seed: int, name: str, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(
        (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
    )


def _init_tensor(spec: TensorSpec, seed: int, special_ids: list[int], device="cpu") -> torch.Tensor:
    """The fp32 (or int64) master values of one tensor, deterministic in (seed, name, device)."""
    return _draw(spec, spec.shape, _generator(seed, spec.name, device), special_ids, device)


def _draw(
    spec: TensorSpec, shape, g: torch.Generator, special_ids, device, out=None
) -> torch.Tensor:
    """``out``: an fp32 buffer of at least ``prod(shape)`` elements on ``device`` to draw the
    normal values into (the same values; no fresh pages to fault in per tensor)."""
    how = spec.init[0]
    kw = {"generator": g, "device": device}
    if how in ("normal", "head") and out is not None:
        kw["out"] = out[: math.prod(shape)].view(shape)
    if how == "normal":
        if out is not None:
            return torch.randn(shape, **kw).mul_(spec.init[1])
        return torch.randn(shape, **kw) * spec.init[1]
    if how == "around_one":
        return (1.0 + torch.randn(shape, **kw) * spec.init[1]).clamp(0.5, 1.5)
    if how == "uniform":
        lo, hi = spec.init[1], spec.init[2]
        return lo + (hi - lo) * torch.rand(shape, **kw)
    if how == "head":
        w = torch.randn(shape, **kw).mul_(spec.init[1])
        ids = [i for i in special_ids if 0 <= i < shape[0]]
        w[ids] *= SPECIAL_HEAD_SCALE
        return w
    if how == "tid2eid":
        # Each token goes to k distinct experts.
        n_experts = spec.init[1]
        rows, k = shape
        return torch.rand(rows, n_experts, **kw).argsort(dim=1)[:, :k].to(torch.int64)
    raise AssertionError(f"unknown init {spec.init!r} for {spec.name}")


# A tensor of more elements than this (the real embedding, head, tid2eid and largest projections)
# is drawn and encoded in blocks of rows (a multiple of the FP8 block for FP8 linears), each from
# its own generator: the cores share the largest tensors, and memory stays bounded.
CHUNK_ELEMENTS = 1 << 25


def row_chunks(spec: TensorSpec) -> list[tuple[int, int]]:
    """The ``[start, end)`` row blocks ``spec`` is drawn in (one block: the whole tensor)."""
    rows = spec.shape[0]
    if spec.numel <= CHUNK_ELEMENTS or len(spec.shape) < 2:
        return [(0, rows)]
    step = max(1, CHUNK_ELEMENTS // (spec.numel // rows))
    if spec.kind == "fp8":
        step = max(FP8_WEIGHT_BLOCK, step // FP8_WEIGHT_BLOCK * FP8_WEIGHT_BLOCK)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def master_rows(
    spec: TensorSpec,
    seed: int,
    special: list[int],
    device,
    chunk: int,
    rows: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The master values of rows ``rows`` (block ``chunk`` of :func:`row_chunks`), drawn into
    ``out`` where given (see :func:`_draw`)."""
    r0, r1 = rows
    if (r0, r1) == (0, spec.shape[0]):
        g = _generator(seed, spec.name, device)
        return _draw(spec, spec.shape, g, special, device, out)
    g = _generator(seed, f"{spec.name}#{chunk}", device)
    return _draw(spec, (r1 - r0, *spec.shape[1:]), g, [i - r0 for i in special], device, out)


# Encoding works on blocks of about this many elements (whole FP8 128-row blocks): temporaries
# small enough to be reused from the allocator's heap instead of faulting in fresh pages.
ENCODE_ELEMENTS = 1 << 19


def encode_rows(spec: TensorSpec, shape: tuple[int, ...]) -> int:
    """How many rows of a ``shape`` master block of ``spec`` are encoded at once."""
    if len(shape) < 2:
        return max(shape[0], 1) if shape else 1
    rows = max(1, ENCODE_ELEMENTS // math.prod(shape[1:]))
    if spec.kind == "fp8":
        rows = max(FP8_WEIGHT_BLOCK, rows // FP8_WEIGHT_BLOCK * FP8_WEIGHT_BLOCK)
    return rows


def master_tensor(spec: TensorSpec, seed: int, special: list[int], device="cpu") -> torch.Tensor:
    """The whole master tensor of ``spec``, as a checkpoint stores it (block by block)."""
    chunks = row_chunks(spec)
    parts = [master_rows(spec, seed, special, device, i, r) for i, r in enumerate(chunks)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.formats.quantize_fp4_experts`` of a finite fp32 ``w``, bit for bit, about 5x faster
    (the e2m1 rounding as uint8 comparisons: '>' where the tie keeps the lower, even code, '>='
    where it goes to the upper one)."""
    n, k = w.shape
    blocks = w.reshape(n, k // FP4_BLOCK, FP4_BLOCK)
    e = ceil_log2(blocks.abs().amax(dim=-1).clamp_min(WEIGHT_AMAX_FLOOR) / 6.0)
    v = blocks / pow2(e).unsqueeze(-1)
    a = v.abs()
    code = (a > 0.25).view(torch.uint8)
    for t, up in (
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ):
        code += (a >= t if up else a > t).view(torch.uint8)
    code |= torch.signbit(v).view(torch.uint8) << 3
    code = code.reshape(n, k)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8), _e8m0(e)


def random_tensors(
    specs: list[TensorSpec], dtype: str, seed: int, device="cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, stored tensor) of ``specs`` generated and encoded on ``device`` (e.g. the
    layers of a real-size model for a benchmark, loaded through the product's loader)."""
    for spec in specs:
        yield from encode_tensor(spec, _init_tensor(spec, seed, [], device), dtype).items()


def master_weights(
    cfg: dict, seed: int, include_mtp: bool = True
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """(spec, fp32 master values) for every logical tensor, before any quantization."""
    special = tokenizer_gen.special_token_ids(cfg["vocab_size"])
    for spec in tensor_specs(cfg, include_mtp):
        yield spec, master_tensor(spec, seed, special)


def encode_tensor(spec: TensorSpec, master: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one logical tensor in checkpoint ``dtype``."""
    if spec.kind in ("fp8", "fp4"):
        fp8 = spec.kind == "fp8"
        q, s = (quantize_fp8_block if fp8 else _quantize_fp4)(master.float())
        if dtype == "fp8":
            return {spec.name + ".weight": q, spec.name + ".scale": s}
        # bf16 checkpoint: the very values the quantized one encodes (exact in bf16).
        deq = (dequantize_fp8_block if fp8 else dequantize_fp4_experts)(q, s)
        w = deq.to(torch.bfloat16)
        if not torch.equal(w.float(), deq):
            raise AssertionError(f"{spec.name}: dequantized weight is not exact in bf16")
        return {spec.name + ".weight": w}
    if spec.kind == "bf16":
        return {spec.name: master.to(torch.bfloat16)}
    if spec.kind == "f32":
        return {spec.name: master.float().contiguous()}
    return {spec.name: master.to(torch.int64)}


def checkpoint_tensors(
    cfg: dict, dtype: str, seed: int, include_mtp: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, on-disk tensor) of a checkpoint, in order."""
    for spec, master in master_weights(cfg, seed, include_mtp):
        yield from encode_tensor(spec, master, dtype).items()
