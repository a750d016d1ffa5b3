# SPDX-License-Identifier: Apache-2.0
"""Cache entry formats: fp8_ds_mla and bf16 main entries; mxfp4, fp8 and bf16 indexer keys.

``make_format(name, kind, entries_per_page)`` builds one from its user-facing name:

* main KV (dim 512): ``"bf16"`` (1024 B), ``"fp8"`` (= ``fp8_ds_mla``, 584 B);
* indexer keys (dim 128): ``"bf16"`` (256 B), ``"fp8"`` (132 B), ``"mxfp4"`` (68 B);
* either kind: ``"fp32"``, exact float32 entries for oracle tests and debugging only.
"""

from __future__ import annotations

from vllm_dsv4_hw.kv_cache.formats.base import EntryFormat
from vllm_dsv4_hw.kv_cache.formats.bf16 import BF16Format
from vllm_dsv4_hw.kv_cache.formats.fp8_ds_mla import FP8DSMLAFormat
from vllm_dsv4_hw.kv_cache.formats.fp8_indexer import FP8IndexerFormat
from vllm_dsv4_hw.kv_cache.formats.fp32 import FP32Format
from vllm_dsv4_hw.kv_cache.formats.mxfp4 import MXFP4Format

MAIN_DIM = 512
INDEXER_DIM = 128

# kind -> name -> constructor(entries_per_page)
_FACTORIES = {
    "main": {
        "bf16": lambda e: BF16Format(dim=MAIN_DIM, entries_per_page=e),
        "fp8": lambda e: FP8DSMLAFormat(entries_per_page=e),
        "fp8_ds_mla": lambda e: FP8DSMLAFormat(entries_per_page=e),
        "fp32": lambda e: FP32Format(dim=MAIN_DIM, entries_per_page=e),
    },
    "indexer": {
        "bf16": lambda e: BF16Format(dim=INDEXER_DIM, entries_per_page=e),
        "fp8": lambda e: FP8IndexerFormat(dim=INDEXER_DIM, entries_per_page=e),
        "mxfp4": lambda e: MXFP4Format(dim=INDEXER_DIM, entries_per_page=e),
        "fp32": lambda e: FP32Format(dim=INDEXER_DIM, entries_per_page=e),
    },
}

FORMAT_NAMES = {kind: tuple(names) for kind, names in _FACTORIES.items()}


def make_format(name: str, kind: str, entries_per_page: int) -> EntryFormat:
    """The entry format called ``name`` for cache ``kind`` ("main" or "indexer")."""
    names = _FACTORIES.get(kind)
    if names is None:
        raise ValueError(f"unknown cache kind {kind!r}; accepted kinds: {', '.join(_FACTORIES)}")
    factory = names.get(name)
    if factory is None:
        raise ValueError(
            f"unknown {kind} cache format {name!r}; accepted {kind} formats: {', '.join(names)}"
        )
    if not isinstance(entries_per_page, int) or entries_per_page <= 0:
        raise ValueError(f"entries_per_page must be a positive int, got {entries_per_page!r}")
    return factory(entries_per_page)


__all__ = [
    "BF16Format",
    "EntryFormat",
    "FORMAT_NAMES",
    "FP32Format",
    "FP8DSMLAFormat",
    "FP8IndexerFormat",
    "INDEXER_DIM",
    "MAIN_DIM",
    "MXFP4Format",
    "make_format",
]
