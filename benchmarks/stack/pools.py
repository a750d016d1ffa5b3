# SPDX-License-Identifier: Apache-2.0
"""The paged caches of a whole stack, carved from one page pool per page-size bucket.

Layout (``kv_cache.specs`` / ``buckets``; spec section 6): every cache kind's page comes from the pool
of its bucket (large: c4a KV, window KV, both main compressor states; middle: indexer keys and the
indexer compressor state; small: c128a KV). Each layer gets its own contiguous range of pages of
each of its kinds (a view of the pool, as vLLM gives each layer its view of a shared KV tensor), so
the block tables of one layer kind serve all its layers.

Pages per sequence and layer:

* full kinds (compressed KV, indexer keys): one page per 256-position logical block,
  ``ceil(context / positions_per_page)``; the block table maps them through a shuffled order;
* windowed kinds (window KV, compressor states): a ring of ``ceil((W - 1) / P) + 1`` pages, the
  pages a window of W positions can touch (``CacheSpec.window_pages``): logical page j lives in ring
  slot ``j % ring``, so the block table is static (vLLM frees and re-takes these pages as the window
  slides; the ring is that, without the bookkeeping). Chunked prefill holds more pages in flight
  (a chunk of c tokens touches ``ceil((W - 1 + c) / P) + 1``): :meth:`StackCaches.prefill_caches`
  gives the windowed kinds larger rings in scratch pools, and :meth:`migrate_windows` copies the
  live pages into the decode rings afterwards. A ring is only valid for positions that advance:
  decoding again from an earlier position needs :meth:`restore_windows`.

Compressor states are fp32 rows ``[kv | score]``; a state page of ``rows`` rows is viewed as rows of
stride ``page_bytes / rows`` (the bucket padding spread between rows) so that a layer's state is one
``[pages * rows, width]`` float32 tensor with a uniform row stride, as the ops want.

Allocated bytes = the pools' bytes; they must equal ``plan_kv(cfg, context).allocated_bytes`` times
the batch (``kv_check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention.caches import LayerCaches, page_geometry, positions_per_page
from vllm_dsv4_hw.attention.metadata import BlockTables, PageGeometry
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR, kind_of
from vllm_dsv4_hw.kv_cache.blocks import cdiv
from vllm_dsv4_hw.kv_cache.buckets import KIND_BUCKET
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.kv_cache.sizing import plan_kv

STATE_KINDS = ("main_state", "indexer_state")
WINDOWED = ("window", "main_state", "indexer_state")


@dataclass
class KindLayout:
    kind: str  # LayerCaches field
    spec_kind: str  # kv_cache.specs kind
    bucket: str
    page_bytes: int
    per_page: int  # positions per page
    window: int | None  # positions a windowed kind keeps (None: full)
    pages: int  # pages per sequence and layer
    cols: int  # block-table columns (logical pages of the whole context)

    @property
    def ring(self) -> int | None:
        return self.pages if self.window is not None else None


@dataclass
class RatioLayout:
    ratio: int
    geometry: PageGeometry
    kinds: dict[str, KindLayout] = field(default_factory=dict)


def ratio_layout(
    cfg: DSV4Config,
    ratio: int,
    context: int,
    main_format: str,
    indexer_format: str,
    in_flight: int = 1,
) -> RatioLayout:
    """Pages of each cache kind of a ratio-``ratio`` layer for one sequence of ``context``
    positions; windowed kinds sized for ``in_flight`` new positions per step (1: decode)."""
    geom, page_bytes = page_geometry(cfg, ratio, main_format, indexer_format)
    ppp = positions_per_page(geom, ratio)
    layer_kind = kind_of(ratio)
    windows = {
        "window": cfg.sliding_window,
        "main_state": layer_kind.group_width,
        "indexer_state": INDEXER_COMPRESSOR.group_width,
    }
    out = RatioLayout(ratio, geom)
    for kind, spec_kind in layer_kind.cache_spec_kinds.items():
        p = ppp[kind]
        cols = cdiv(context, p)
        w = windows.get(kind)
        pages = cols if w is None else min(cols, cdiv(w - 1 + in_flight - 1, p) + 1)
        out.kinds[kind] = KindLayout(
            kind, spec_kind, KIND_BUCKET[spec_kind], page_bytes[kind], p, w, pages, cols
        )
    return out


def _state_view(pages: torch.Tensor, rows_per_page: int, width: int) -> torch.Tensor:
    """uint8 pages [n, page_bytes] -> float32 rows [n * rows, width] with row stride
    page_bytes / 4 / rows (no copy)."""
    n, pb = pages.shape
    if pb % (4 * rows_per_page):
        raise ValueError(f"state page of {pb} B does not split into {rows_per_page} fp32 rows")
    stride = pb // 4 // rows_per_page
    if stride < width or stride % 2:
        raise ValueError(f"state row stride {stride} floats cannot hold {width} (even) floats")
    v = pages.view(torch.float32).view(n, rows_per_page, stride)[:, :, :width]
    out = v.view(n * rows_per_page, width) if n else v.reshape(0, width)
    return out


class StackCaches:
    """Bucket pools, per-layer LayerCaches and per-kind block tables for ``batch`` sequences of
    up to ``context`` positions (every full-kind page allocated up front)."""

    def __init__(
        self,
        cfg: DSV4Config,
        batch: int,
        context: int,
        device: torch.device,
        main_format: str = "fp8",
        indexer_format: str = "mxfp4",
        seed: int = 0,
        in_flight: int = 1,
        zero: bool = False,
        share_full_from: "StackCaches" = None,
        model_len: int | None = None,
    ):
        self.cfg = cfg
        self.batch = batch
        self.context = context
        # positions the block tables span (vLLM's max_model_len); the columns past the context
        # are unallocated (-1), as a vLLM table's past a sequence
        self.model_len = max(context, model_len or context)
        self.device = device
        self.main_format = main_format
        self.indexer_format = indexer_format
        self.in_flight = in_flight
        self.ratios = tuple(cfg.compress_ratios)
        self.layouts = {
            r: ratio_layout(cfg, r, context, main_format, indexer_format, in_flight)
            for r in sorted(set(self.ratios))
        }
        shared = share_full_from is not None
        # -- pools: page counts per bucket (this object's kinds only: all, or the windowed kinds
        #    when the full kinds are borrowed from another StackCaches) --
        own = (lambda k: k in WINDOWED) if shared else (lambda k: True)
        need: dict[str, int] = {}
        page_bytes: dict[str, int] = {}
        for r in self.ratios:
            for kl in self.layouts[r].kinds.values():
                if not own(kl.kind):
                    continue
                need[kl.bucket] = need.get(kl.bucket, 0) + batch * kl.pages
                if page_bytes.setdefault(kl.bucket, kl.page_bytes) != kl.page_bytes:
                    raise ValueError(
                        f"bucket {kl.bucket}: page sizes {page_bytes[kl.bucket]} and "
                        f"{kl.page_bytes} differ"
                    )
        alloc = torch.zeros if zero else torch.empty
        self.pools = {
            b: alloc(n, page_bytes[b], dtype=torch.uint8, device=device) for b, n in need.items()
        }
        self.page_bytes = page_bytes
        # -- block tables (one set per ratio kind; the window table is the same for all) --
        gen = torch.Generator().manual_seed(seed)
        self.tables: dict[int, BlockTables] = {}
        window_table = None
        for r, lay in self.layouts.items():
            t = {}
            for kind, kl in lay.kinds.items():
                if kind == "window" and window_table is not None:
                    t[kind] = window_table
                    continue
                if shared and kind not in WINDOWED:
                    t[kind] = share_full_from.tables[r].__dict__[kind]
                    continue
                t[kind] = self._table(kl, gen, torch.int32 if kind == "indexer" else torch.int64)
                if kind == "window":
                    window_table = t[kind]
            self.tables[r] = BlockTables(**t)
        # -- per-layer views --
        offset = {b: 0 for b in self.pools}
        self.layers: list[LayerCaches] = []
        for i, r in enumerate(self.ratios):
            lay = self.layouts[r]
            g = lay.geometry
            views = {}
            for kind, kl in lay.kinds.items():
                if shared and kind not in WINDOWED:
                    src = share_full_from.layers[i]
                    views[kind] = getattr(src, kind)
                    continue
                n = batch * kl.pages
                o = offset[kl.bucket]
                pages = self.pools[kl.bucket][o : o + n]
                offset[kl.bucket] = o + n
                if kind == "main_state":
                    views[kind] = _state_view(
                        pages, g.main_state_rows_per_page, kind_of(r).state_width(cfg.head_dim)
                    )
                elif kind == "indexer_state":
                    views[kind] = _state_view(
                        pages,
                        g.indexer_state_rows_per_page,
                        INDEXER_COMPRESSOR.state_width(cfg.index_head_dim),
                    )
                else:
                    views[kind] = pages
            lc = LayerCaches(
                ratio=r,
                main_format=make_format(main_format, "main", g.window_positions_per_page),
                window=views["window"],
                geometry=g,
                block_tables=self.tables[r],
            )
            if r:
                lc.comp_format = make_format(main_format, "main", g.comp_entries_per_page)
                lc.comp = views["comp"]
                lc.main_state = views["main_state"]
            if r == 4:
                lc.indexer_format = make_format(
                    indexer_format, "indexer", g.indexer_entries_per_page
                )
                lc.indexer = views["indexer"]
                lc.indexer_state = views["indexer_state"]
            self.layers.append(lc)
        assert all(offset[b] == self.pools[b].shape[0] for b in self.pools)

    def _table(self, kl: KindLayout, gen: torch.Generator, dtype) -> torch.Tensor:
        b = self.batch
        cols = cdiv(self.model_len, kl.per_page)  # >= kl.cols: model_len >= context
        if kl.window is not None:
            j = torch.arange(cols, dtype=torch.int64)
            t = torch.arange(b, dtype=torch.int64)[:, None] * kl.pages + (j % kl.pages)[None, :]
        else:
            order = torch.randperm(b * kl.pages, generator=gen)
            t = order.view(b, kl.pages)
            if cols > kl.pages:  # columns past the context (model_len): unallocated
                t = torch.cat([t, torch.full((b, cols - kl.pages), -1)], 1)
        return t.to(dtype).to(self.device)

    # -- bytes ------------------------------------------------------------------------------------
    def allocated_bytes(self) -> int:
        return sum(p.numel() for p in self.pools.values())

    def pages_by_bucket(self) -> dict[str, int]:
        return {b: p.shape[0] for b, p in self.pools.items()}

    def kv_check(self) -> dict:
        """Measured pool bytes per sequence against ``plan_kv`` (the kv-plan CLI's numbers)."""
        plan = plan_kv(
            self.cfg, self.context, self.main_format, self.indexer_format, memory_bytes=120 << 30
        )
        measured = self.allocated_bytes() / self.batch
        planned = plan.allocated_bytes
        pages = {b: n / self.batch for b, n in self.pages_by_bucket().items()}
        plan_pages = {}
        for bp in plan.page_buckets:
            for name in bp.name.split("+"):
                plan_pages[name] = bp.pages_per_sequence
        return {
            "context": self.context,
            "batch": self.batch,
            "measured_bytes_total": self.allocated_bytes(),
            "measured_bytes_per_seq": measured,
            "plan_bytes_per_seq": planned,
            "plan_useful_bytes_per_seq": plan.bytes_per_sequence,
            "rel_diff": (measured - planned) / planned,
            "ok_1pct": abs(measured - planned) <= 0.01 * planned,
            "pools": {
                b: {
                    "page_bytes": self.page_bytes[b],
                    "pages": self.pools[b].shape[0],
                    "pages_per_seq": pages[b],
                    "plan_pages_per_seq": plan_pages.get(b),
                    "bytes": self.pools[b].numel(),
                }
                for b in self.pools
            },
            "fit_in_120gib": plan.max_sequences,
        }

    # -- prefill scratch ---------------------------------------------------------------------------
    def prefill_caches(self, chunk_per_seq: int) -> "StackCaches":
        """Caches for chunked prefill: the same full-kind pages (compressed KV, indexer keys) and
        scratch pools for the windowed kinds with rings that hold a chunk in flight."""
        return StackCaches(
            self.cfg,
            self.batch,
            self.context,
            self.device,
            self.main_format,
            self.indexer_format,
            in_flight=chunk_per_seq,
            zero=True,
            share_full_from=self,
            model_len=self.model_len,
        )

    def migrate_windows(self, src: "StackCaches", next_pos: int) -> None:
        """Copy the windowed pages a decode step at position ``next_pos`` (same for every
        sequence) reads from ``src``'s prefill rings into this object's decode rings."""
        b = torch.arange(self.batch, device=self.device)
        for i, r in enumerate(self.ratios):
            for kind in WINDOWED:
                kl = self.layouts[r].kinds.get(kind)
                if kl is None:
                    continue
                skl = src.layouts[r].kinds[kind]
                lo = max(0, next_pos - kl.window + 1)  # oldest position still read
                hi = next_pos - 1  # newest position already written
                if hi < lo:
                    continue
                j = torch.arange(lo // kl.per_page, hi // kl.per_page + 1, device=self.device)
                dst_pages = (b[:, None] * kl.pages + (j % kl.pages)[None, :]).reshape(-1)
                src_pages = (b[:, None] * skl.pages + (j % skl.pages)[None, :]).reshape(-1)
                dst = getattr(self.layers[i], kind)
                s = getattr(src.layers[i], kind)
                if kind in STATE_KINDS:
                    g = self.layers[i].geometry
                    rpp = (
                        g.main_state_rows_per_page
                        if kind == "main_state"
                        else g.indexer_state_rows_per_page
                    )
                    rows = torch.arange(rpp, device=self.device)
                    dst_rows = (dst_pages[:, None] * rpp + rows).reshape(-1)
                    src_rows = (src_pages[:, None] * rpp + rows).reshape(-1)
                    dst[dst_rows] = s[src_rows]
                else:
                    dst[dst_pages] = s[src_pages]

    # -- windowed pages: snapshot / restore ---------------------------------------------------------
    def _windowed_views(self) -> list[torch.Tensor]:
        out = []
        for lc in self.layers:
            for kind in WINDOWED:
                v = getattr(lc, kind, None)
                if v is not None:
                    out.append(v)
        return out

    def snapshot_windows(self) -> list[torch.Tensor]:
        """Copies of every windowed page (window KV, compressor states). The rings hold the last
        W positions for positions that only advance; a benchmark that decodes p0..p0+n and then
        starts again at p0 restores them first (:meth:`restore_windows`), else the later decode
        positions have overwritten ring slots the earlier ones read."""
        return [v.clone() for v in self._windowed_views()]

    def restore_windows(self, snap: list[torch.Tensor]) -> None:
        for v, s in zip(self._windowed_views(), snap, strict=True):
            v.copy_(s)

    # -- random valid contents ---------------------------------------------------------------------
    @torch.no_grad()
    def fill_random(self, seed: int = 0, template_pages: int = 1024) -> None:
        """Every page of every pool holds valid entries of its kind's format (random rows quantized
        through the format by ``ops.kv_insert``, a template of distinct pages tiled over the pool);
        compressor states hold random fp32 rows. Stands in for a prefill (1M-token decode rows)."""
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        fmts = {}
        for r, lay in self.layouts.items():
            g = lay.geometry
            fmts.setdefault(
                "large", make_format(self.main_format, "main", g.window_positions_per_page)
            )
            if r == 128:
                fmts.setdefault(
                    "small", make_format(self.main_format, "main", g.comp_entries_per_page)
                )
            if r == 4:
                fmts.setdefault(
                    "middle",
                    make_format(self.indexer_format, "indexer", g.indexer_entries_per_page),
                )
        for bucket, pool in self.pools.items():
            fmt = fmts.get(bucket)
            if fmt is None:  # a bucket holding only states (not with the V4 layer patterns)
                continue
            n = pool.shape[0]
            t_pages = min(n, template_pages)
            e = fmt.entries_per_page
            rows = torch.randn(t_pages * e, fmt.dim, device=dev, generator=gen)
            tmpl = torch.zeros(t_pages, pool.shape[1], dtype=torch.uint8, device=dev)
            ops.kv_insert(tmpl, torch.arange(t_pages * e, device=dev), rows, fmt)
            full = n // t_pages
            if full:
                pool[: full * t_pages].view(full, t_pages, -1).copy_(
                    tmpl.unsqueeze(0).expand(full, t_pages, -1)
                )
            rest = n - full * t_pages
            if rest:
                pool[full * t_pages :].copy_(tmpl[:rest])
        for lc in self.layers:
            for st in (lc.main_state, lc.indexer_state):
                if st is not None:
                    st.copy_(torch.randn(st.shape, device=dev, generator=gen))
