# SPDX-License-Identifier: Apache-2.0
"""The logical KV block: the one unit of scheduling, slot mapping and prefix-cache hits.

One logical block covers ``BLOCK_POSITIONS`` = 256 native token positions for every compressed
layer kind. Its page in each cache holds the entries those 256 positions produce:

* c4a main KV (ratio 4): 256 / 4 = 64 entries,
* c128a main KV (ratio 128): 256 / 128 = 2 entries,
* indexer keys (ratio 4, c4a layers only): 64 entries.

Entry ``i`` of a ratio-``r`` cache lives in logical block ``(r * i) // 256`` at offset
``i % (256 // r)``. Sliding-window caches (the 128-token window KV and the compressor states) are
not tied to the 256-position block: they are rolling windows with their own, smaller pages
(``WINDOW_POSITIONS_PER_PAGE`` positions for the window KV; the compressor states' rows per page
follow from the page-size bucket, see :mod:`vllm_dsv4_hw.kv_cache.specs`).
"""

from __future__ import annotations

from vllm_dsv4_hw.kinds import C4A, C128A, INDEXER_COMPRESSOR

BLOCK_POSITIONS = 256

C4A_ENTRIES_PER_BLOCK = BLOCK_POSITIONS // C4A.ratio  # 64
C128A_ENTRIES_PER_BLOCK = BLOCK_POSITIONS // C128A.ratio  # 2
INDEXER_ENTRIES_PER_BLOCK = BLOCK_POSITIONS // INDEXER_COMPRESSOR.ratio  # 64

# The window KV (sliding window 128 on every layer) uses 64-position pages, like vLLM's
# DeepseekV4SWACache: one window page has the byte size of one c4a page (64 main entries).
WINDOW_POSITIONS_PER_PAGE = 64

# Entries per logical block, by compressed cache kind.
ENTRIES_PER_BLOCK = {
    "c4a_kv": C4A_ENTRIES_PER_BLOCK,
    "c128a_kv": C128A_ENTRIES_PER_BLOCK,
    "indexer_kv": INDEXER_ENTRIES_PER_BLOCK,
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks(context: int) -> int:
    """Logical blocks a sequence of ``context`` positions occupies (its block-table length)."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return cdiv(context, BLOCK_POSITIONS)


def complete_entries(context: int, ratio: int) -> int:
    """Entries of a ratio-``ratio`` cache that are complete after ``context`` positions.

    Entry ``i`` is complete (and visible) once position ``ratio * i + ratio - 1`` exists.
    """
    if ratio <= 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    return context // ratio


def entry_block(entry: int, ratio: int) -> tuple[int, int]:
    """(logical block, offset in its page) of entry ``entry`` of a ratio-``ratio`` cache."""
    per_block = BLOCK_POSITIONS // ratio
    return entry // per_block, entry % per_block
