"""How vLLM's hybrid KV cache manager pools our cache kinds: capacity, without vLLM.

Inside vLLM (block-outermost layout, ``attention/vllm_backend.py``) the caches form KV cache groups
that share one block pool. This module predicts vLLM 0.32's arithmetic for our kinds, so that
``vllm-dsv4-hw kv-plan --memory ...`` states the capacity ``vllm serve`` will report:

* one **full** group holds every compressed and indexer cache (c4a, c128a, indexer keys: one
  256-position logical block per page, so one shared block table); its block packs one page of
  each of those layers: the *anchor* size;
* each **windowed** kind (window KV, each compressor state) is split into groups of
  ``anchor // page`` layers (at least one), so that its packed block does not exceed the anchor;
* a pool block is the largest group's packed bytes, rounded up to the least common multiple of the
  block-stride alignments (the state rows' sizes, ``vllm_specs.vllm_spec``);
* admission reserves per request, per group: full ``ceil(L / 256)`` blocks; windowed
  ``ceil(min(W - 1 + C, L) / P) + 1`` blocks (W window, P positions per page, C the in-flight
  tokens = ``max_num_batched_tokens``: chunked prefill keeps a whole chunk's rows in flight);
* max concurrency = pool blocks / per-request blocks; vLLM logs ``tokens = concurrency * L``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kv_cache.blocks import cdiv
from vllm_dsv4_hw.kv_cache.specs import layer_cache_specs

__all__ = ["PoolGroup", "VllmPoolPlan", "plan_vllm_pool"]

FULL_KINDS = ("c4a_kv", "indexer_kv", "c128a_kv")
STATE_KINDS = ("c4a_state", "c128a_state", "indexer_state")


@dataclass(frozen=True)
class PoolGroup:
    kinds: tuple[str, ...]
    layers: int              # layer caches in the group
    positions_per_page: int
    packed_bytes: int        # one block of this group: one page of each of its layer caches
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
            "bytes_per_block": self.bytes_per_block, "num_blocks": self.num_blocks,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": round(self.max_concurrency, 4), "tokens": self.tokens,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "groups": [{"kinds": list(g.kinds), "layers": g.layers,
                        "positions_per_page": g.positions_per_page,
                        "packed_bytes": g.packed_bytes,
                        "blocks_per_request": g.blocks_per_request} for g in self.groups],
        }


def plan_vllm_pool(cfg: DSV4Config, main_format: str, indexer_format: str, memory_bytes: int,
                   max_model_len: int, max_num_batched_tokens: int) -> VllmPoolPlan:
    if memory_bytes <= 0 or max_model_len <= 0 or max_num_batched_tokens <= 0:
        raise ValueError("memory, max_model_len and max_num_batched_tokens must be positive")
    specs = {s.kind: s for s in layer_cache_specs(cfg, main_format, indexer_format)}
    groups: list[PoolGroup] = []
    full = [specs[k] for k in FULL_KINDS if k in specs]
    anchor = sum(s.num_layers * s.page_bytes for s in full)
    if full:
        groups.append(PoolGroup(
            kinds=tuple(s.kind for s in full), layers=sum(s.num_layers for s in full),
            positions_per_page=full[0].positions_per_page, packed_bytes=anchor,
            blocks_per_request=cdiv(max_model_len, full[0].positions_per_page)))
    alignments = [1]
    for kind in ("window_kv",) + STATE_KINDS:
        s = specs.get(kind)
        if s is None:
            continue
        if kind in STATE_KINDS:
            alignments.append(s.entry_bytes)
        per_group = max(anchor // s.page_bytes, 1) if anchor else s.num_layers
        p = s.positions_per_page
        held = min(s.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        blocks = cdiv(held, p) + 1
        left = s.num_layers
        while left > 0:
            n = min(per_group, left)
            groups.append(PoolGroup(kinds=(kind,), layers=n, positions_per_page=p,
                                    packed_bytes=n * s.page_bytes, blocks_per_request=blocks))
            left -= n
    widest = max(g.packed_bytes for g in groups)
    align = math.lcm(*alignments)
    bytes_per_block = cdiv(widest, align) * align
    return VllmPoolPlan(groups=tuple(groups), bytes_per_block=bytes_per_block,
                        num_blocks=memory_bytes // bytes_per_block, max_model_len=max_model_len,
                        max_num_batched_tokens=max_num_batched_tokens)
