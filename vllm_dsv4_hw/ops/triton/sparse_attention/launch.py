# SPDX-License-Identifier: Apache-2.0
"""Launch plan of the Triton ``sparse_attention`` kernels: what the device offers (cores, grid
limit), the tunables per device kind (:data:`CONFIGS`, from decode
sweeps) and the split-K plan (how many candidate splits, how long each).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from vllm_dsv4_hw.ops.triton.common.launch import capabilities, sm_count


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _num_cores(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device)
    if device.type == "npu":  # pragma: no cover - Ascend only
        try:
            props = torch.npu.get_device_properties(device)  # type: ignore[attr-defined]
            return int(
                getattr(props, "vector_core_num", 0) or getattr(props, "cube_core_num", 0) or 40
            )
        except Exception:
            return 40
    return 1  # the interpreter runs programs one at a time: never split for occupancy


# Tunables per device kind: BLOCK_H cap, BLOCK_N, num_warps, num_stages, candidates per split
# (min_chunk: the smallest split when splitting for occupancy; max_chunk: the longest one, None =
# no cap), register prefetch of the next tile, maxnreg (NVIDIA register cap; None = compiler's).
# BLOCK_H is max(16, next_pow2(H)) capped at ``block_h`` (tl.dot needs M >= 16).
# CUDA: 16 heads per program, 32-entry tiles, 4 warps, splits of 32..256 candidates: smaller
# programs than before, faster at decode (evidence: docs/tuning.md, Sparse attention
# decode tiles). Each entry tile is read once per head block (from L2 after the first).
CONFIGS = {
    "cuda": dict(
        block_h=16,
        block_n=32,
        num_warps=4,
        num_stages=1,
        min_chunk=32,
        max_chunk=256,
        prefetch=True,
        maxnreg=None,
    ),
    "npu": dict(
        block_h=16,
        block_n=32,
        num_warps=4,
        num_stages=1,
        min_chunk=64,
        max_chunk=None,
        prefetch=False,
        maxnreg=None,
    ),
    "interp": dict(
        block_h=64,
        block_n=64,
        num_warps=4,
        num_stages=1,
        min_chunk=64,
        max_chunk=None,
        prefetch=True,
        maxnreg=None,
    ),
}

# CUDA with many tokens at once: once the (token, head block) programs fill the device, split-K
# only adds workspace traffic; prefill chunks read each candidate tile once for all 64 heads
# (block_h 64); a batch of bf16 tokens is best with 32 heads and 64-entry tiles, fp8 with the
# decode tiles (evidence: docs/tuning.md, Sparse attention full-device tiles).
PREFILL_TOKENS = 1024  # tokens in one call from which the prefill tiles apply
FULL_DEVICE = dict(max_chunk=2048)  # keeps long c128a candidate lists (up to 8K at 1M) split


class TileChoice(NamedTuple):
    """Full-device tiles and the shared memory they need (the largest any target needs, from
    ahead-of-time compiles for sm_80 / 90 / 100) with bf16 dots (bf16 queries: q and the entry
    tile as 16-bit dot operands) and with fp32 dots (fp32 queries; None: no target holds it)."""

    tiles: dict
    shared: int
    shared_fp32_dots: int | None

    def needs(self, bf16_dots: bool) -> int | None:
        return self.shared if bf16_dots else self.shared_fp32_dots


# The 64-head fp8 tiles (prefill chunks and long decode lists), best first: 64-entry tiles beat
# the 32-entry one with the single loop over both caches, unpipelined; sm_80 lacks the shared
# memory for them and takes the 32-entry tile, and no target holds the 64 x 64 one with fp32 dots
# (evidence and shared-memory figures: docs/tuning.md, Sparse attention 64-head fp8 tiles).
_FP32_DOTS_32x64 = 205_056
FP8_WIDE_TILES = (
    TileChoice(dict(block_h=64, block_n=64, num_warps=8, prefetch=False), 192 * 1024, None),
    TileChoice(
        dict(block_h=64, block_n=32, num_warps=8, prefetch=False), 128 * 1024, _FP32_DOTS_32x64
    ),
)
# (prefill, format) -> choices, best first: formats not listed keep the device kind's tiles, and
# so does a device whose declared ``shared_mem`` holds none of them (96-128 KiB for 64 heads x 32
# entries, 100 KiB for 32 x 64 over sm_80 / 86 / 90 / 100 / 120 and gfx942; sm_86 / 89 / 120
# allow 99 KiB, MI300 64).
FULL_DEVICE_TILES = {
    (True, "bf16"): (
        TileChoice(
            dict(block_h=64, block_n=32, num_warps=8, prefetch=False), 128 * 1024, _FP32_DOTS_32x64
        ),
    ),
    (True, "fp8_ds_mla"): FP8_WIDE_TILES,
    (False, "bf16"): (
        TileChoice(dict(block_h=32, block_n=64, num_warps=8), 100 * 1024, _FP32_DOTS_32x64),
    ),
}


def _tiles_for(
    prefill: bool, fmt_name: str | None, device: torch.device, bf16_dots: bool
) -> dict | None:
    """The first full-device tiles of (prefill, format) that the device's shared memory holds."""
    for choice in FULL_DEVICE_TILES.get((prefill, fmt_name), ()):
        need = choice.needs(bf16_dots)
        if need is not None and need <= _shared_mem(device):
            return choice.tiles
    return None


# Decode batches over long candidate lists on CUDA: the 64-head fp8 tiles (``FP8_WIDE_TILES``:
# each entry tile loaded and decoded once per token, not once per 16 heads), in splits of 512
# candidates where those (token, split) programs fill 3/4 of the device, else of 256 where those
# fill half of it. One such program holds an SM: fewer, longer splits once the programs cover
# most of the device; below that the 16-head tiles stay ahead (evidence: docs/tuning.md, Sparse
# attention long decode splits).
LONG_DECODE_SPLITS = ((512, 0.75), (256, 0.5))  # (candidates per split, share of the cores)
LONG_DECODE_FORMATS = ("fp8_ds_mla",)


def _long_decode(
    t: int,
    h: int,
    n_cand: int | None,
    fmt_name: str | None,
    cores: int,
    device: torch.device,
    bf16_dots: bool,
) -> dict | None:
    """The long-decode tiles and split (``min_chunk`` = ``max_chunk``) of this call, or None."""
    if n_cand is None or fmt_name not in LONG_DECODE_FORMATS or h < 64 or t >= PREFILL_TOKENS:
        return None
    tiles = _tiles_for(True, fmt_name, device, bf16_dots)
    if tiles is None:
        return None
    for chunk, share in LONG_DECODE_SPLITS:
        if t * math.ceil(n_cand / chunk) >= share * cores:
            return dict(tiles, min_chunk=chunk, max_chunk=chunk)
    return None


def _config(
    device: torch.device,
    t: int = 1,
    h: int = 16,
    fmt_name: str | None = None,
    cores: int | None = None,
    n_cand: int | None = None,
    bf16_dots: bool = True,
) -> dict:
    """The tunables for a call of ``t`` tokens and ``h`` heads in format ``fmt_name`` over
    ``n_cand`` candidates per token (window + compressed; None: not known), with bf16 dots (bf16
    queries) or fp32 ones."""
    if _interpreting() or device.type == "cpu":
        return CONFIGS["interp"]
    cfg = CONFIGS.get(device.type, CONFIGS["cuda"])
    if device.type != "cuda":
        return cfg
    cores = _num_cores(device) if cores is None else cores
    long = _long_decode(t, h, n_cand, fmt_name, cores, device, bf16_dots)
    if long is not None:
        return dict(cfg, **long)
    if t * math.ceil(h / cfg["block_h"]) < cores:
        return cfg
    tiles = _tiles_for(t >= PREFILL_TOKENS, fmt_name, device, bf16_dots)
    return dict(cfg, **FULL_DEVICE, **(tiles or {}))


def _shared_mem(device: torch.device) -> int:
    """Shared memory per block: the device's declared capability."""
    return capabilities(device).shared_mem


def _plan_splits(
    t: int,
    num_hb: int,
    n_cand: int,
    block_n: int,
    min_chunk: int,
    cores: int,
    num_splits: int | None,
    max_chunk: int | None = None,
) -> tuple[int, int]:
    """(splits, chunk): chunk is a multiple of block_n and splits * chunk >= n_cand. Splits: at
    most ``max_chunk`` candidates per program; when the (token, head block) programs fill less
    than half the device, enough splits of >= ``min_chunk`` for two programs per core."""
    if n_cand <= 0:
        return 1, block_n
    if num_splits is None:
        base = t * num_hb
        num_splits = math.ceil(n_cand / max_chunk) if max_chunk else 1
        if 2 * base <= cores and n_cand > min_chunk:  # less than half the device busy
            num_splits = max(
                num_splits, min(math.ceil(2 * cores / base), math.ceil(n_cand / min_chunk))
            )
    num_splits = max(1, min(int(num_splits), math.ceil(n_cand / block_n)))
    chunk = math.ceil(math.ceil(n_cand / num_splits) / block_n) * block_n
    return math.ceil(n_cand / chunk), chunk
