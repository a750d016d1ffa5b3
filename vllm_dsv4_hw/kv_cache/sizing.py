# SPDX-License-Identifier: Apache-2.0
"""Per-sequence KV cache sizing: useful bytes, allocated bytes (pages), padding, capacity.

``plan_kv(cfg, context, main_format, indexer_format, memory_bytes=None)`` sizes one sequence of
``context`` positions:

* useful bytes = entries actually held x entry bytes, per kind and layer:
  c4a / indexer entries ``floor(N / 4)``, c128a entries ``floor(N / 128)``, window rows
  ``min(N, 128)``, compressor-state rows ``min(N, coff * ratio)``;
* allocated bytes = pages x bucketed page bytes. Full kinds hold one page per logical block
  touched (``ceil(N / 256)``: a block's page exists from its first position on, so N > 0 always
  means at least one page per kind, even with no complete entry yet); windowed kinds hold the
  pages their window can touch (``ceil((W - 1) / P) + 1``, capped by ``ceil(N / P)``);
* padding = allocated - useful: bucket padding inside each page, free slots of partly used pages
  and the extra page of a window that does not start on a page boundary.

``bytes_per_sequence`` is the useful total (spec section 7 figures); capacity (``max_sequences``)
uses the allocated total, which is what the page pools really hand out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kv_cache.buckets import PageBucket, fold_buckets
from vllm_dsv4_hw.kv_cache.specs import (
    CATEGORIES,
    CacheSpec,
    FormatError,
    layer_cache_specs,
    normalize_indexer_format,
    normalize_main_format,
)

GIB = 1 << 30
# V3.2-style MLA cache: 576 bf16 (512 latent + 64 rope) + 128 bf16 indexer key per token per layer.
BASELINE_V32_BYTES_PER_TOKEN_LAYER = (576 + 128) * 2


class KVPlanError(ValueError):
    """Bad input to :func:`plan_kv` (context, formats, memory)."""


@dataclass(frozen=True)
class KindPlan:
    kind: str
    category: str
    num_layers: int
    format: str
    entry_bytes: int
    entries_per_page: int
    positions_per_page: int
    sliding_window: int | None
    window_pages: int | None  # pages a full window can touch (windowed kinds)
    bucket: str
    page_bytes: int
    natural_page_bytes: int
    entries_per_layer: int  # useful entries / rows per layer
    pages_per_layer: int
    useful_bytes: int  # all layers
    allocated_bytes: int  # all layers
    page_padding_bytes: int  # all layers: bucket padding inside the allocated pages
    slot_padding_bytes: int  # all layers: unused entry slots (partly used / extra window pages)

    @property
    def padding_bytes(self) -> int:
        return self.allocated_bytes - self.useful_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["padding_bytes"] = self.padding_bytes
        return d


@dataclass(frozen=True)
class BucketPlan:
    name: str
    page_bytes: int
    kinds: tuple[str, ...]
    pages_per_sequence: int

    @property
    def bytes_per_sequence(self) -> int:
        return self.page_bytes * self.pages_per_sequence

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "page_bytes": self.page_bytes,
            "kinds": list(self.kinds),
            "pages_per_sequence": self.pages_per_sequence,
            "bytes_per_sequence": self.bytes_per_sequence,
        }


@dataclass(frozen=True)
class KVPlan:
    model: str
    num_layers: int
    context: int
    main_format: str
    indexer_format: str
    kinds: tuple[KindPlan, ...]
    page_buckets: tuple[BucketPlan, ...]
    baseline_v32_bytes: int
    memory_bytes: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)  # useful bytes per category

    @property
    def bytes_per_sequence(self) -> int:
        return sum(k.useful_bytes for k in self.kinds)

    @property
    def allocated_bytes(self) -> int:
        return sum(k.allocated_bytes for k in self.kinds)

    @property
    def padding_bytes(self) -> int:
        return self.allocated_bytes - self.bytes_per_sequence

    @property
    def padding_fraction(self) -> float:
        return self.padding_bytes / self.bytes_per_sequence if self.bytes_per_sequence else 0.0

    @property
    def growing_bytes(self) -> int:
        """Compressed KV plus indexer keys: the part that grows with the context."""
        return self.breakdown["compressed_kv"] + self.breakdown["indexer_keys"]

    @property
    def ratio(self) -> float | None:
        """V3.2 baseline / (compressed KV + indexer keys), the spec's "8.7x"; None if 0 bytes."""
        return self.baseline_v32_bytes / self.growing_bytes if self.growing_bytes else None

    @property
    def ratio_total(self) -> float | None:
        """V3.2 baseline / bytes_per_sequence (window and compressor states included)."""
        total = self.bytes_per_sequence
        return self.baseline_v32_bytes / total if total else None

    @property
    def max_sequences(self) -> int | None:
        """Sequences of this context that ``memory_bytes`` holds (allocated bytes, pages incl.)."""
        if self.memory_bytes is None:
            return None
        return self.memory_bytes // self.allocated_bytes

    def kind(self, name: str) -> KindPlan:
        for k in self.kinds:
            if k.kind == name:
                return k
        raise KeyError(
            f"no cache kind {name!r} in this plan; kinds: {', '.join(k.kind for k in self.kinds)}"
        )

    def to_dict(self) -> dict:
        breakdown: dict = {c: self.breakdown[c] for c in CATEGORIES}
        breakdown["kinds"] = {k.kind: k.to_dict() for k in self.kinds}
        out = {
            "model": self.model,
            "num_layers": self.num_layers,
            "context": self.context,
            "main_format": self.main_format,
            "indexer_format": self.indexer_format,
            "bytes_per_sequence": self.bytes_per_sequence,
            "gib_per_sequence": self.bytes_per_sequence / GIB,
            "breakdown": breakdown,
            "breakdown_gib": {c: self.breakdown[c] / GIB for c in CATEGORIES},
            "compressed_plus_indexer_bytes": self.growing_bytes,
            "compressed_plus_indexer_gib": self.growing_bytes / GIB,
            "allocated_bytes": self.allocated_bytes,
            "allocated_gib": self.allocated_bytes / GIB,
            "padding_bytes": self.padding_bytes,
            "padding_fraction": self.padding_fraction,
            "page_buckets": [b.to_dict() for b in self.page_buckets],
            "baseline_v32_bytes": self.baseline_v32_bytes,
            "baseline_v32_gib": self.baseline_v32_bytes / GIB,
            "ratio": self.ratio,
            "ratio_total": self.ratio_total,
        }
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
            out["max_sequences"] = self.max_sequences
        return out


def _plan_kind(spec: CacheSpec, context: int) -> KindPlan:
    entries = spec.entries(context)
    pages = spec.pages(context)
    n = spec.num_layers
    useful = n * entries * spec.entry_bytes
    allocated = n * pages * spec.page_bytes
    page_pad = n * pages * spec.page_padding_bytes
    return KindPlan(
        kind=spec.kind,
        category=spec.category,
        num_layers=n,
        format=spec.format,
        entry_bytes=spec.entry_bytes,
        entries_per_page=spec.entries_per_page,
        positions_per_page=spec.positions_per_page,
        sliding_window=spec.sliding_window,
        window_pages=spec.window_pages,
        bucket=spec.bucket,
        page_bytes=spec.page_bytes,
        natural_page_bytes=spec.natural_page_bytes,
        entries_per_layer=entries,
        pages_per_layer=pages,
        useful_bytes=useful,
        allocated_bytes=allocated,
        page_padding_bytes=page_pad,
        slot_padding_bytes=allocated - useful - page_pad,
    )


def plan_kv(
    cfg: DSV4Config,
    context: int,
    main_format: str,
    indexer_format: str,
    memory_bytes: int | None = None,
) -> KVPlan:
    """Size one sequence of ``context`` positions; see the module docstring for the rules."""
    if isinstance(context, bool) or not isinstance(context, int):
        raise KVPlanError(f"context must be an integer number of tokens, got {context!r}")
    if context <= 0:
        raise KVPlanError(f"context must be a positive number of tokens, got {context}")
    if context > cfg.max_position_embeddings:
        raise KVPlanError(
            f"context {context} exceeds {cfg.name}'s max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    if memory_bytes is not None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
            raise KVPlanError(f"memory must be an integer number of bytes, got {memory_bytes!r}")
        if memory_bytes <= 0:
            raise KVPlanError(f"memory must be positive, got {memory_bytes} bytes")
    try:
        main = normalize_main_format(main_format)
        idx = normalize_indexer_format(indexer_format)
        specs = layer_cache_specs(cfg, main, idx)
    except FormatError as exc:
        raise KVPlanError(str(exc)) from None
    buckets: list[PageBucket] = fold_buckets(specs)
    kinds = tuple(_plan_kind(s, context) for s in specs)
    pages_by_kind = {k.kind: k.pages_per_layer * k.num_layers for k in kinds}
    page_buckets = tuple(
        BucketPlan(b.name, b.page_bytes, b.kinds, sum(pages_by_kind[k] for k in b.kinds))
        for b in buckets
    )
    breakdown = {c: sum(k.useful_bytes for k in kinds if k.category == c) for c in CATEGORIES}
    return KVPlan(
        model=cfg.name,
        num_layers=cfg.num_layers,
        context=context,
        main_format=main,
        indexer_format=idx,
        kinds=kinds,
        page_buckets=page_buckets,
        baseline_v32_bytes=BASELINE_V32_BYTES_PER_TOKEN_LAYER * context * cfg.num_layers,
        memory_bytes=memory_bytes,
        breakdown=breakdown,
    )
