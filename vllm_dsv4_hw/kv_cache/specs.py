# SPDX-License-Identifier: Apache-2.0
"""Cache specs: one :class:`CacheSpec` per cache kind of a DeepSeek V4 model.

Kinds (per layer; ``cfg.compress_ratios`` says which layers have which):

============== ============== =============================== ==========================
kind           layers         one entry / row                 pages
============== ============== =============================== ==========================
c4a_kv         ratio 4        main entry (4 positions)        64 entries (logical block)
c128a_kv       ratio 128      main entry (128 positions)      2 entries (logical block)
indexer_kv     ratio 4        indexer key (4 positions)       64 entries (logical block)
window_kv      every layer    main entry (1 position)         64 positions, window 128
c4a_state      ratio 4        fp32 kv+score row, coff 2, d    rows per page: see below,
c128a_state    ratio 128      fp32 kv+score row, coff 1, d    window coff * ratio
indexer_state  ratio 4        fp32 kv+score row, coff 2, d_I
============== ============== =============================== ==========================

A compressor state row holds ``2 * coff * d * 4`` bytes (kv and score halves, fp32). Its page has
the largest power-of-two number of rows that fits the kind's bucket page (``buckets.py``), and is
padded up to that page. Entry sizes come from a small table (spec section 5), so planning needs
neither torch nor the entry-format codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import C4A, C128A, INDEXER_COMPRESSOR, AttentionKind
from vllm_dsv4_hw.kv_cache.blocks import ENTRIES_PER_BLOCK, WINDOW_POSITIONS_PER_PAGE, cdiv
from vllm_dsv4_hw.kv_cache.buckets import KIND_BUCKET, bucket_page_bytes, rows_per_page

# Bytes per entry (spec section 5). The entry formats are defined for the V4 geometry only.
MAIN_ENTRY_BYTES = {"fp8": 584, "bf16": 1024}
INDEXER_ENTRY_BYTES = {"mxfp4": 68, "fp8": 132, "bf16": 256}
MAIN_FORMAT_NAMES = {"fp8": "fp8_ds_mla", "bf16": "bf16"}  # short name -> entry format name
MAIN_FORMAT_ALIASES = {v: k for k, v in MAIN_FORMAT_NAMES.items() if v != k}
STATE_FORMAT_NAME = "fp32_state"
STATE_BYTES_PER_VALUE = 4  # fp32
FORMAT_GEOMETRY = {"head_dim": 512, "rope_dim": 64, "index_head_dim": 128}

CATEGORY = {
    "c4a_kv": "compressed_kv",
    "c128a_kv": "compressed_kv",
    "indexer_kv": "indexer_keys",
    "window_kv": "window",
    "c4a_state": "compressor_state",
    "c128a_state": "compressor_state",
    "indexer_state": "compressor_state",
}
KINDS = tuple(CATEGORY)
CATEGORIES = ("compressed_kv", "indexer_keys", "window", "compressor_state")


class FormatError(ValueError):
    """An unknown entry format name, or a model geometry the entry formats do not cover."""


def normalize_main_format(name: str) -> str:
    key = MAIN_FORMAT_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in MAIN_ENTRY_BYTES:
        raise FormatError(
            f"unknown main KV format {name!r}; use one of: {', '.join(MAIN_ENTRY_BYTES)}"
        )
    return key


def normalize_indexer_format(name: str) -> str:
    key = str(name).lower()
    if key not in INDEXER_ENTRY_BYTES:
        raise FormatError(
            f"unknown indexer format {name!r}; use one of: {', '.join(INDEXER_ENTRY_BYTES)}"
        )
    return key


@dataclass(frozen=True)
class CacheSpec:
    kind: str
    category: str
    # Compress ratio of the layers holding this cache (4 or 128); None: every layer (window KV).
    layer_ratio: int | None
    num_layers: int
    format: str  # entry format name ("fp8_ds_mla", "bf16", "mxfp4", "fp8", "fp32_state")
    entry_bytes: int  # bytes per entry (KV kinds) or per position row (window, states)
    positions_per_entry: int  # 4 / 128 for compressed entries, 1 for window and state rows
    entries_per_page: int
    sliding_window: int | None  # positions kept; None: the whole context is kept
    page_bytes: int  # bucketed page size (what the pool allocates)
    bucket: str

    @property
    def positions_per_page(self) -> int:
        return self.entries_per_page * self.positions_per_entry

    @property
    def natural_page_bytes(self) -> int:
        return self.entries_per_page * self.entry_bytes

    @property
    def page_padding_bytes(self) -> int:
        return self.page_bytes - self.natural_page_bytes

    @property
    def window_pages(self) -> int | None:
        """Pages a window of W positions can touch: ceil((W - 1) / P) + 1 (None if not windowed).

        The window need not start on a page boundary, hence the extra page. This is vLLM's
        decode-time bound (one in-flight token); chunked prefill holds more while in flight.
        """
        if self.sliding_window is None:
            return None
        return cdiv(self.sliding_window - 1, self.positions_per_page) + 1

    # -- per-sequence sizing (one layer) ------------------------------------------------------
    def entries(self, context: int) -> int:
        """Useful entries (rows) one layer holds for a sequence of ``context`` positions."""
        if self.sliding_window is not None:
            return min(context, self.sliding_window)
        return context // self.positions_per_entry

    def pages(self, context: int) -> int:
        """Pages one layer allocates for a sequence of ``context`` positions.

        Full kinds: one page per logical block touched, ``ceil(context / positions_per_page)``,
        so a block's page exists as soon as its first position does (even before any entry in
        it is complete: the incomplete group lives in the compressor state meanwhile).
        Windowed kinds: the pages the window can touch, never more than the whole context's.
        """
        if context <= 0:
            return 0
        pages = cdiv(context, self.positions_per_page)
        if self.sliding_window is not None:
            pages = min(pages, self.window_pages)
        return pages


def check_geometry(cfg: DSV4Config) -> None:
    got = {"head_dim": cfg.head_dim, "rope_dim": cfg.rope_dim, "index_head_dim": cfg.index_head_dim}
    if cfg.sliding_window < 1:
        raise FormatError(f"{cfg.name}: sliding_window must be >= 1, got {cfg.sliding_window}")
    bad = {k: v for k, v in got.items() if v != FORMAT_GEOMETRY[k]}
    if bad:
        raise FormatError(
            f"{cfg.name}: the cache entry formats are defined for head_dim 512 (448 + 64 rope) and "
            f"index_head_dim 128; this model has "
            + ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        )


def state_row_bytes(compressor: AttentionKind, dim: int) -> int:
    """One compressor-state row: fp32 kv and score halves of coff*dim each."""
    return compressor.state_width(dim) * STATE_BYTES_PER_VALUE


def layer_cache_specs(cfg: DSV4Config, main_format: str, indexer_format: str) -> list[CacheSpec]:
    """The cache kinds of ``cfg`` (only those some layer has), in :data:`KINDS` order."""
    main = normalize_main_format(main_format)
    idx = normalize_indexer_format(indexer_format)
    check_geometry(cfg)
    main_b = MAIN_ENTRY_BYTES[main]
    idx_b = INDEXER_ENTRY_BYTES[idx]
    sizes = bucket_page_bytes(main_b, idx_b)
    n4 = cfg.layers_with_ratio(C4A.ratio)
    n128 = cfg.layers_with_ratio(C128A.ratio)
    n_all = cfg.num_layers
    main_name = MAIN_FORMAT_NAMES[main]

    def page(kind: str) -> tuple[int, str]:
        bucket = KIND_BUCKET[kind]
        return sizes[bucket], bucket

    def entries(kind: str, compressor: AttentionKind, n: int, fmt: str, entry: int) -> CacheSpec:
        # one 256-position logical block per page
        return CacheSpec(
            kind,
            CATEGORY[kind],
            compressor.ratio,
            n,
            fmt,
            entry,
            compressor.ratio,
            ENTRIES_PER_BLOCK[kind],
            None,
            *page(kind),
        )

    def state(kind: str, compressor: AttentionKind, n: int, dim: int) -> CacheSpec:
        row = state_row_bytes(compressor, dim)
        page_bytes, bucket = page(kind)
        return CacheSpec(
            kind,
            CATEGORY[kind],
            compressor.ratio,
            n,
            STATE_FORMAT_NAME,
            row,
            1,
            rows_per_page(row, page_bytes),
            compressor.group_width,
            page_bytes,
            bucket,
        )

    specs = [
        entries(C4A.comp_spec_kind, C4A, n4, main_name, main_b),
        entries(C128A.comp_spec_kind, C128A, n128, main_name, main_b),
        entries("indexer_kv", INDEXER_COMPRESSOR, n4, idx, idx_b),
        CacheSpec(
            "window_kv",
            "window",
            None,
            n_all,
            main_name,
            main_b,
            1,
            WINDOW_POSITIONS_PER_PAGE,
            cfg.sliding_window,
            *page("window_kv"),
        ),
        state(C4A.state_spec_kind, C4A, n4, cfg.head_dim),
        state(C128A.state_spec_kind, C128A, n128, cfg.head_dim),
        state("indexer_state", INDEXER_COMPRESSOR, n4, cfg.index_head_dim),
    ]
    return [s for s in specs if s.num_layers > 0]


def specs_for_layer(
    cfg: DSV4Config, layer: int, main_format: str, indexer_format: str
) -> list[CacheSpec]:
    """The cache kinds layer ``layer`` holds (window KV always; more by its compress ratio)."""
    ratio = cfg.compress_ratios[layer]
    return [
        s
        for s in layer_cache_specs(cfg, main_format, indexer_format)
        if s.layer_ratio is None or s.layer_ratio == ratio
    ]
