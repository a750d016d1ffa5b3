# SPDX-License-Identifier: Apache-2.0
"""The op cases of the conformance kit: fresh random inputs on the device under test, a float64
oracle, poisoned caches, and a check per case.

Each builder returns :class:`Case` objects. A case holds its pristine inputs (on the device); for
every backend it clones the mutable ones (caches, states: poisoned with 0xFF bytes / NaN where
nothing is written), calls the implementation, and checks the result against an oracle computed
once in float64 -- the reference implementation run on float64 copies of the inputs (on the
device when it has fp64, else on the CPU), or, for the compressor and the indexer's scores, float64
formulas written by the builder. Nothing here imports vLLM.

This module holds what every builder shares (:class:`Dims` / :data:`SHAPES`, :class:`Ctx`,
:class:`Case`, the verdict and poisoned-cache helpers) and the :data:`BUILDERS` table; the builders
live by op family in ``cases_dense`` (norms, RoPE, fused prologue / epilogue), ``cases_layouts``
(kv_insert / kv_gather), ``cases_sparse_attention``, ``cases_indexer``, ``cases_compressor``,
``cases_weights`` (fp8_block_linear, dense_linear), ``cases_moe`` and ``cases_metadata`` (decode_metadata).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_dsv4_hw.config import YarnParams
from vllm_dsv4_hw.conformance.tolerances import entry_bound, ratio
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import rope as ref_rope
from vllm_dsv4_hw.platform.capabilities import DeviceCapabilities

POISON = 0xFF  # NaN in bf16 / fp32 / e4m3 data bytes, inf as a ue8m0 scale byte
EPS = 1e-6


@dataclass(frozen=True)
class Dims:
    name: str
    tokens: int
    heads: int
    index_heads: int
    topk: int
    window: int
    q_lora: int
    o_groups: int
    o_lora: int
    hidden: int
    positions: tuple[int, ...]  # one decode token per request, len == tokens
    head_dim: int = 512
    rope_dim: int = 64
    index_dim: int = 128


SHAPES = {
    # fast everywhere (CPU included); the real head / rope / index dims, few heads and tokens
    "small": Dims(
        "small",
        tokens=4,
        heads=4,
        index_heads=16,
        topk=16,
        window=16,
        q_lora=64,
        o_groups=2,
        o_lora=32,
        hidden=128,
        positions=(5, 130, 259, 600),
    ),
    # V4-Flash at decode batch 8: 64 heads of 512 (448 + 64 rope), indexer 64 x 128, top-512,
    # window 128, q_lora 1024, 8 groups x 1024, hidden 4096
    "real": Dims(
        "real",
        tokens=8,
        heads=64,
        index_heads=64,
        topk=512,
        window=128,
        q_lora=1024,
        o_groups=8,
        o_lora=1024,
        hidden=4096,
        positions=(1500, 2051, 2559, 3333, 4095, 5000, 6143, 8191),
    ),
}


@dataclass
class Ctx:
    device: torch.device
    caps: DeviceCapabilities
    dims: Dims
    gen: torch.Generator
    main_fmt: str
    indexer_fmt: str
    main_formats: tuple[str, ...]
    indexer_formats: tuple[str, ...]
    _table: torch.Tensor | None = None

    @property
    def oracle_device(self) -> torch.device:
        return self.device if self.caps.fp64 else torch.device("cpu")

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype).to(self.device)

    def rows(self, n: int, dim: int, dtype=torch.bfloat16, lo=-6.0, hi=6.0) -> torch.Tensor:
        """Rows with per-row magnitudes 2^lo .. 2^hi (exercise the block scales)."""
        x = torch.randn(n, dim, generator=self.gen)
        x = x * torch.exp2(torch.empty(n, 1).uniform_(lo, hi, generator=self.gen))
        return x.to(dtype).to(self.device)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    @property
    def table(self) -> torch.Tensor:
        """The c4a / c128a RoPE table (theta 160000, YaRN) up to the largest position used."""
        if self._table is None:
            n = max(self.dims.positions) + 256
            self._table = ref_rope.rope_cos_sin(
                160000.0, self.dims.rope_dim, n, YarnParams(), device=self.device
            )
        return self._table

    def to_oracle(self, t):
        if isinstance(t, torch.Tensor):
            if t.is_floating_point():
                return t.to(device=self.oracle_device, dtype=torch.float64)
            return t.to(self.oracle_device)
        return t


Check = Callable[[Any, tuple], tuple[bool, str, float]]


@dataclass
class Case:
    op: str
    name: str
    args: tuple
    check: Check
    mutable: tuple[int, ...] = ()
    kwargs: dict = field(default_factory=dict)

    def run(self, fn: Callable) -> tuple[bool, str, float]:
        args = tuple(a.clone() if i in self.mutable else a for i, a in enumerate(self.args))
        out = fn(*args, **self.kwargs)
        return self.check(out, args)


def _verdict(r: float, what: str = "") -> tuple[bool, str, float]:
    ok = r <= 1.0
    return ok, (f"{what}err/tol {r:.3g}" if math.isfinite(r) else f"{what}non-finite result"), r


def _same(out: torch.Tensor, shape, dtype) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a tensor"
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        return f"returned {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(shape)}"
    return None


# -- cache helpers ---------------------------------------------------------------------------------
def poisoned_cache(fmt, pages: int, device, pad: int = 64) -> torch.Tensor:
    return fmt.new_cache(pages, page_bytes=fmt.min_page_bytes + pad).fill_(POISON).to(device)


def entry_spans(fmt, slot: int) -> tuple[int, slice, slice]:
    e = fmt.entries_per_page
    page, off = divmod(slot, e)
    d0 = off * fmt.data_bytes
    s0 = e * fmt.data_bytes + off * fmt.scale_bytes
    return page, slice(d0, d0 + fmt.data_bytes), slice(s0, s0 + fmt.scale_bytes)


def check_entries(
    cache: torch.Tensor, before: torch.Tensor, fmt, slots, want: torch.Tensor, fmt_name: str
) -> tuple[bool, str, float]:
    """Written entries decode to ``want`` within one code step; every other byte is unchanged."""
    cache, before = cache.cpu(), before.cpu()
    slots = [int(s) for s in slots.tolist()]
    written = torch.zeros_like(cache, dtype=torch.bool)
    got_rows, want_rows = [], []
    for i, s in enumerate(slots):
        if s < 0:
            continue
        page, ds, ss = entry_spans(fmt, s)
        written[page, ds] = True
        written[page, ss] = True
        got_rows.append(
            fmt.dequantize(cache[page, ds][None].clone(), cache[page, ss][None].clone())[0]
        )
        want_rows.append(want[i].cpu())
    if not torch.equal(cache[~written], before[~written]):
        n = int((cache[~written] != before[~written]).sum())
        return (
            False,
            f"{n} bytes outside the written entries changed (poison overwritten)",
            float("inf"),
        )
    if not got_rows:
        return True, "nothing to write", 0.0
    got, w = torch.stack(got_rows).double(), torch.stack(want_rows).double()
    return _verdict(ratio(got, w, entry_bound(fmt_name, w)), "entries ")


# Case builders by op (or op pair), in report order. Their modules import this one (Case, Ctx,
# the helpers above): registered once it is complete.
BUILDERS: dict[str, Callable[[Ctx], list[Case]]] = {}


def _register_builders() -> None:
    from vllm_dsv4_hw.conformance.cases_compressor import compressor_cases
    from vllm_dsv4_hw.conformance.cases_dense import (
        inv_rope_fp8_quant_cases,
        qkv_rms_norm_cases,
        qnorm_rope_kv_insert_cases,
        rms_norm_cases,
        rope_cases,
    )
    from vllm_dsv4_hw.conformance.cases_indexer import indexer_topk_cases
    from vllm_dsv4_hw.conformance.cases_layouts import entry_slots_cases, layout_cases
    from vllm_dsv4_hw.conformance.cases_metadata import decode_metadata_cases
    from vllm_dsv4_hw.conformance.cases_mhc import hc_cases
    from vllm_dsv4_hw.conformance.cases_moe import moe_experts_cases, moe_route_cases, swiglu_cases
    from vllm_dsv4_hw.conformance.cases_sparse_attention import sparse_attention_cases
    from vllm_dsv4_hw.conformance.cases_weights import dense_linear_cases, fp8_block_linear_cases

    BUILDERS.update(
        {
            api.RMS_NORM: rms_norm_cases,
            api.QKV_RMS_NORM: qkv_rms_norm_cases,
            api.ROPE: rope_cases,
            "layouts": layout_cases,  # kv_insert + kv_gather
            api.ENTRY_SLOTS: entry_slots_cases,
            api.QNORM_ROPE_KV_INSERT: qnorm_rope_kv_insert_cases,
            api.INV_ROPE_FP8_QUANT: inv_rope_fp8_quant_cases,
            api.SPARSE_ATTENTION: sparse_attention_cases,
            api.INDEXER_TOPK: indexer_topk_cases,
            "compressor": compressor_cases,  # compressor_pool + compressor_store
            api.FP8_BLOCK_LINEAR: fp8_block_linear_cases,
            api.DENSE_LINEAR: dense_linear_cases,
            api.MOE_EXPERTS: moe_experts_cases,
            api.MOE_ROUTE: moe_route_cases,
            api.SWIGLU: swiglu_cases,
            api.DECODE_METADATA: decode_metadata_cases,
            "mhc": hc_cases,  # hc_pre + hc_seam + hc_post
        }
    )


_register_builders()

# Ops the model only uses where the device has a capability (skipped, with the reason, elsewhere).
OP_NEEDS = {api.INV_ROPE_FP8_QUANT: ("fp8",)}
