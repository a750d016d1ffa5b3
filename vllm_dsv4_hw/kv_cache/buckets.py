# SPDX-License-Identifier: Apache-2.0
"""Page-size buckets: every cache kind's page is padded up to one of (at most) three sizes.

Each bucket is backed by one shared page pool, so pages of different cache kinds never fragment
each other. The sizes follow from the entry formats (spec section 6):

* ``large``  = 64 main entries: the c4a KV page (one logical block), the window KV page
  (64 positions), and the two main compressor states (as many fp32 rows as fit, a power of two);
* ``middle`` = 64 indexer entries: the indexer key page and the indexer compressor state;
* ``small``  = 2 main entries: the c128a KV page.

This module only needs bytes per entry; it knows nothing about how entries are encoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from vllm_dsv4_hw.kv_cache.blocks import (
    C4A_ENTRIES_PER_BLOCK,
    C128A_ENTRIES_PER_BLOCK,
    INDEXER_ENTRIES_PER_BLOCK,
)

MAX_PAGE_SIZES = 3
BUCKET_NAMES = ("large", "middle", "small")

# Which bucket each cache kind's pages come from.
KIND_BUCKET = {
    "c4a_kv": "large",
    "window_kv": "large",
    "c4a_state": "large",
    "c128a_state": "large",
    "indexer_kv": "middle",
    "indexer_state": "middle",
    "c128a_kv": "small",
}


class BucketError(ValueError):
    """The cache kinds do not fold into at most three page sizes (or a page does not fit)."""


class _SpecLike(Protocol):
    kind: str
    bucket: str
    page_bytes: int
    natural_page_bytes: int


def bucket_page_bytes(main_entry_bytes: int, indexer_entry_bytes: int) -> dict[str, int]:
    """Page bytes of the three buckets for the given main and indexer entry sizes."""
    if main_entry_bytes <= 0 or indexer_entry_bytes <= 0:
        raise BucketError(
            f"entry sizes must be positive (main {main_entry_bytes}, indexer {indexer_entry_bytes})"
        )
    return {
        "large": C4A_ENTRIES_PER_BLOCK * main_entry_bytes,
        "middle": INDEXER_ENTRIES_PER_BLOCK * indexer_entry_bytes,
        "small": C128A_ENTRIES_PER_BLOCK * main_entry_bytes,
    }


def rows_per_page(row_bytes: int, page_bytes: int) -> int:
    """Largest power of two ``r`` with ``r * row_bytes <= page_bytes``."""
    if row_bytes <= 0:
        raise BucketError(f"row size must be positive, got {row_bytes}")
    if row_bytes > page_bytes:
        raise BucketError(
            f"one compressor-state row of {row_bytes} B does not fit a {page_bytes} B page"
        )
    rows = 1
    while rows * 2 * row_bytes <= page_bytes:
        rows *= 2
    return rows


@dataclass(frozen=True)
class PageBucket:
    name: str  # "large", "middle", "small" (joined with "+" if two buckets share a size)
    page_bytes: int
    kinds: tuple[str, ...]


def fold_buckets(specs: Iterable[_SpecLike]) -> list[PageBucket]:
    """Group cache specs by page size, largest first; raise unless there are <= 3 sizes.

    Also checks that every kind's natural page (entries x entry bytes) fits its bucketed page.
    """
    by_size: dict[int, list[_SpecLike]] = {}
    for spec in specs:
        if spec.natural_page_bytes > spec.page_bytes:
            raise BucketError(
                f"{spec.kind}: natural page of {spec.natural_page_bytes} B exceeds its "
                f"{spec.bucket} bucket page of {spec.page_bytes} B"
            )
        by_size.setdefault(spec.page_bytes, []).append(spec)
    if len(by_size) > MAX_PAGE_SIZES:
        detail = "; ".join(
            f"{size} B: {', '.join(s.kind for s in group)}"
            for size, group in sorted(by_size.items())
        )
        raise BucketError(
            f"cache kinds need {len(by_size)} page sizes, more than {MAX_PAGE_SIZES} ({detail})"
        )
    out = []
    for size in sorted(by_size, reverse=True):
        group = by_size[size]
        names = sorted(
            {s.bucket for s in group},
            key=lambda b: BUCKET_NAMES.index(b) if b in BUCKET_NAMES else len(BUCKET_NAMES),
        )
        out.append(PageBucket("+".join(names), size, tuple(s.kind for s in group)))
    return out


def page_padding(specs: Iterable[_SpecLike]) -> dict[str, int]:
    """Bytes of padding in every page of each kind (bucket page minus its natural page)."""
    return {s.kind: s.page_bytes - s.natural_page_bytes for s in specs}
