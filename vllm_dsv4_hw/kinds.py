# SPDX-License-Identifier: Apache-2.0
"""The three DeepSeek V4 attention layer kinds, each fact about them said once.

A layer's kind follows from its ``compress_ratios`` entry: 0 = window only, 4 = c4a (compressed
entries of 8 overlapping tokens at stride 4, picked by the indexer), 128 = c128a (one entry per
128 tokens, all visible ones attended). Everything else about a kind is derived here: the overlap
factor ``coff`` (a c4a group also pools the 4 rows of the previous group, channels [0, d)), the
state rows a group reads, which caches the layer owns and their planner (``kv_cache.specs``) kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AttentionKind",
    "WINDOW",
    "C4A",
    "C128A",
    "KINDS",
    "SUPPORTED_RATIOS",
    "CACHE_FIELDS",
    "INDEXER_COMPRESSOR",
    "kind_of",
]

# Every cache field a layer may own, in the order a layer's caches register with vLLM.
CACHE_FIELDS = ("window", "comp", "indexer", "main_state", "indexer_state")


@dataclass(frozen=True)
class AttentionKind:
    name: str  # "window", "c4a", "c128a"
    ratio: int  # tokens per compressed entry (0: none)

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def has_indexer(self) -> bool:
        """c4a layers pick their compressed candidates with the lightning indexer's top-k."""
        return self.ratio == 4

    @property
    def coff(self) -> int:
        """Overlap factor: c4a entries pool 2 x 4 tokens (their group and the previous one)."""
        return 2 if self.ratio == 4 else 1

    @property
    def group_width(self) -> int:
        """State rows one compressed entry pools (8 for c4a, 128 for c128a)."""
        return self.coff * self.ratio

    @property
    def attends_all_entries(self) -> bool:
        """c128a layers attend every visible compressed entry (no indexer selection)."""
        return self.compressed and not self.has_indexer

    def state_width(self, d: int) -> int:
        """fp32 values of one compressor state row at output dim ``d``: kv and score halves of
        ``coff * d`` each."""
        return 2 * self.coff * d

    @property
    def caches(self) -> tuple[str, ...]:
        """The caches a layer of this kind owns (``LayerCaches`` / ``BlockTables`` fields), by
        owner: the window, the main compressor's, the indexer's."""
        out = ("window",)
        if self.compressed:
            out += ("comp", "main_state")
        if self.has_indexer:
            out += ("indexer", "indexer_state")
        return out

    @property
    def comp_spec_kind(self) -> str | None:
        """The planner kind of this layer's compressed main KV (None for window layers)."""
        return f"{self.name}_kv" if self.compressed else None

    @property
    def state_spec_kind(self) -> str | None:
        return f"{self.name}_state" if self.compressed else None

    @property
    def cache_spec_kinds(self) -> dict[str, str]:
        """Each cache this layer owns -> its planner (``kv_cache.specs``) kind, in the order the
        caches register with vLLM (:data:`CACHE_FIELDS` order: entry caches, then states)."""
        spec = {
            "window": "window_kv",
            "comp": self.comp_spec_kind,
            "indexer": "indexer_kv",
            "main_state": self.state_spec_kind,
            "indexer_state": "indexer_state",
        }
        return {c: spec[c] for c in CACHE_FIELDS if c in self.caches}

    @property
    def spec_kinds(self) -> tuple[str, ...]:
        """The planner (``kv_cache.specs``) kinds of this layer's caches, window first."""
        return tuple(self.cache_spec_kinds.values())


WINDOW = AttentionKind("window", 0)
C4A = AttentionKind("c4a", 4)
C128A = AttentionKind("c128a", 128)
KINDS = {k.ratio: k for k in (WINDOW, C4A, C128A)}
SUPPORTED_RATIOS = tuple(KINDS)

# The indexer's own compressor: c4a geometry (ratio 4, overlapping) at the indexer's head dim.
INDEXER_COMPRESSOR = C4A


def kind_of(ratio: int) -> AttentionKind:
    try:
        return KINDS[ratio]
    except (KeyError, TypeError):
        raise ValueError(
            f"compress ratio {ratio!r} is not one of {SUPPORTED_RATIOS} (0 = window "
            f"only, 4 = c4a with indexer, 128 = c128a)"
        ) from None
