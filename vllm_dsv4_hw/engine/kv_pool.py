# SPDX-License-Identifier: Apache-2.0
"""How vLLM's hybrid KV cache manager pools our cache kinds: capacity, without vLLM.

Inside vLLM (block-outermost layout, ``engine/attention_backend.py``) the caches form KV cache groups
that share one block pool. This module predicts vLLM 0.32's arithmetic for our kinds, so that
``vllm-dsv4-hw kv-plan --memory ...`` states the capacity ``vllm serve`` will report:

* layer caches of one uniform type form a bucket: every compressed and indexer cache (c4a, c128a,
  indexer keys: one 256-position logical block per page, one shared block table), and windowed
  caches by (window, positions per page), e.g. window KV; c4a and indexer states share a bucket
  when their pages hold the same number of rows;
* a bucket whose page sizes repeat in a 1:1 pattern may be split by pattern repeats; otherwise the
  widest unsplit bucket is the *anchor* and each windowed bucket is split into groups of
  ``anchor // first page`` layers (at least one), so that no group's block exceeds the anchor
  (``_get_packed_kv_cache_groups`` in vLLM 0.32);
* a pool block is the largest group's packed bytes, rounded up to the least common multiple of the
  block-stride alignments (the state rows' sizes, ``kv_specs.vllm_spec``);
* admission reserves per request, per group: full ``ceil(L / 256)`` blocks; windowed
  ``ceil(min(W - 1 + C, L) / P) + 1`` blocks (W window, P positions per page, C the in-flight
  tokens = ``max_num_batched_tokens``: chunked prefill keeps a whole chunk's rows in flight);
* max concurrency = pool blocks / per-request blocks; vLLM logs ``tokens = concurrency * L``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.engine.kv_specs import STATE_KINDS
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.kv_cache.blocks import cdiv
from vllm_dsv4_hw.kv_cache.specs import layer_cache_specs

__all__ = ["PoolGroup", "VllmPoolPlan", "plan_vllm_pool"]


@dataclass(frozen=True)
class PoolGroup:
    kinds: tuple[str, ...]
    layers: int  # layer caches in the group
    positions_per_page: int
    packed_bytes: int  # one block of this group: one page of each of its layer caches
    blocks_per_request: int  # what admission reserves for one request of max_model_len


@dataclass(frozen=True)
class VllmPoolPlan:
    groups: tuple[PoolGroup, ...]
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def blocks_per_request(self) -> int:
        return sum(g.blocks_per_request for g in self.groups)

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    @property
    def tokens(self) -> int:
        """What vLLM logs as the KV cache size in tokens."""
        return int(self.max_concurrency * self.max_model_len)

    def to_dict(self) -> dict:
        return {
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": round(self.max_concurrency, 4),
            "tokens": self.tokens,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "groups": [
                {
                    "kinds": list(g.kinds),
                    "layers": g.layers,
                    "positions_per_page": g.positions_per_page,
                    "packed_bytes": g.packed_bytes,
                    "blocks_per_request": g.blocks_per_request,
                }
                for g in self.groups
            ],
        }


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's choice of layer repeats per group: the d >= lower_bound minimizing the total
    rounding-up padding of ``values`` (ties: the larger d)."""
    best_d, best_pad = lower_bound, None
    for d in range(lower_bound, max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best_d):
            best_d, best_pad = d, pad
    return best_d


@dataclass
class _Bucket:
    """Layer caches vLLM treats as one uniform type (same block size; windowed: same window)."""

    kinds: list[str]
    layers: dict[int, list[str]]  # page bytes -> layer caches, in registration order
    first_page: int
    positions_per_page: int
    window: int | None

    @property
    def balanced(self) -> bool:
        return len({len(v) for v in self.layers.values()}) == 1

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.layers.values())

    def max_layers_per_page(self) -> int:
        return max(len(v) for v in self.layers.values())


def _buckets(cfg: DSV4Config, specs: dict) -> list[_Bucket]:
    """Layer caches in vLLM's registration order (layer by layer, ``kv_specs.layer_kinds``
    order), bucketed as ``_get_packed_kv_cache_groups`` does."""
    buckets: list[_Bucket] = []
    for layer, ratio in enumerate(cfg.compress_ratios):
        for kind in kind_of(ratio).spec_kinds:
            s = specs[kind]
            key = (s.positions_per_page, s.sliding_window)
            b = next((b for b in buckets if (b.positions_per_page, b.window) == key), None)
            if b is None:
                b = _Bucket([], {}, s.page_bytes, s.positions_per_page, s.sliding_window)
                buckets.append(b)
            if kind not in b.kinds:
                b.kinds.append(kind)
            b.layers.setdefault(s.page_bytes, []).append(f"layers.{layer}.{kind}")
    return buckets


def plan_vllm_pool(
    cfg: DSV4Config,
    main_format: str,
    indexer_format: str,
    memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> VllmPoolPlan:
    if memory_bytes <= 0 or max_model_len <= 0 or max_num_batched_tokens <= 0:
        raise ValueError("memory, max_model_len and max_num_batched_tokens must be positive")
    specs = {s.kind: s for s in layer_cache_specs(cfg, main_format, indexer_format)}
    buckets = _buckets(cfg, specs)

    balanced = [b for b in buckets if b.balanced]
    min_repeats = max((b.max_layers_per_page() for b in balanced if len(b.layers) > 1), default=0)
    repeats = (
        _approximate_gcd([b.max_layers_per_page() for b in balanced], min_repeats)
        if min_repeats
        else None
    )

    def num_groups_for(b: _Bucket) -> int:
        return cdiv(b.max_layers_per_page(), repeats) if b.balanced and repeats else 1

    def is_state(b: _Bucket) -> bool:  # windowed buckets, when no repeat pattern is packed
        return repeats is None and b.window is not None

    def widest(b: _Bucket, n: int) -> int:
        return sum(cdiv(len(names), n) * page for page, names in b.layers.items())

    anchor = max(widest(b, b.size if is_state(b) else num_groups_for(b)) for b in buckets)
    groups: list[PoolGroup] = []
    alignments = [1] + [specs[k].entry_bytes for k in STATE_KINDS if k in specs]
    for b in buckets:
        n = num_groups_for(b)
        if anchor and is_state(b):
            n = max(n, cdiv(b.size, max(anchor // b.first_page, 1)))
        if b.window is None:
            blocks = cdiv(max_model_len, b.positions_per_page)
        else:
            held = min(b.window - 1 + max_num_batched_tokens, max_model_len)
            blocks = cdiv(held, b.positions_per_page) + 1
        page_of = {name: page for page, names in b.layers.items() for name in names}
        if n == 1:
            members = [list(page_of)]
        else:
            pattern = list(zip(*b.layers.values()))
            members = [[name for rep in pattern[i::n] for name in rep] for i in range(n)]
        for names in members:
            groups.append(
                PoolGroup(
                    kinds=tuple(k for k in b.kinds if any(nm.endswith("." + k) for nm in names)),
                    layers=len(names),
                    positions_per_page=b.positions_per_page,
                    packed_bytes=sum(page_of[nm] for nm in names),
                    blocks_per_request=blocks,
                )
            )
    widest_group = max(g.packed_bytes for g in groups)
    align = math.lcm(*alignments)
    bytes_per_block = cdiv(widest_group, align) * align
    return VllmPoolPlan(
        groups=tuple(groups),
        bytes_per_block=bytes_per_block,
        num_blocks=memory_bytes // bytes_per_block,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def one_request_bytes(plan: VllmPoolPlan) -> int:
    """KV cache bytes one request of ``plan.max_model_len`` claims, plus the null block the pool
    holds back: vLLM's engine refuses to start below this (``get_kv_cache_configs``)."""
    return plan.bytes_per_block * (plan.blocks_per_request + 1)


def longest_fitting_len(
    cfg: DSV4Config,
    main_format: str,
    indexer_format: str,
    memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> int:
    """The largest max_model_len <= ``max_model_len`` whose one request fits ``memory_bytes``
    (0 if none): what vLLM's engine estimates when it refuses."""

    def fits(n: int) -> bool:
        return (
            one_request_bytes(
                plan_vllm_pool(
                    cfg, main_format, indexer_format, memory_bytes, n, max_num_batched_tokens
                )
            )
            <= memory_bytes
        )

    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
