# SPDX-License-Identifier: Apache-2.0
"""Page-size buckets and cache specs: at most three page sizes for every format combination."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_dsv4_hw.config import PRESETS, V4_FLASH, V4_PRO
from vllm_dsv4_hw.kv_cache import blocks
from vllm_dsv4_hw.kv_cache.buckets import (
    BucketError,
    bucket_page_bytes,
    fold_buckets,
    page_padding,
    rows_per_page,
)
from vllm_dsv4_hw.kv_cache.specs import CacheSpec, layer_cache_specs, specs_for_layer

MAIN_B = {"fp8": 584, "bf16": 1024}
IDX_B = {"mxfp4": 68, "fp8": 132, "bf16": 256}
COMBOS = [(m, i) for m in ("bf16", "fp8") for i in ("bf16", "fp8", "mxfp4")]
BUCKET_OF = {
    "c4a_kv": "large",
    "window_kv": "large",
    "c4a_state": "large",
    "c128a_state": "large",
    "indexer_kv": "middle",
    "indexer_state": "middle",
    "c128a_kv": "small",
}


def test_logical_block_constants():
    assert blocks.BLOCK_POSITIONS == 256
    assert blocks.ENTRIES_PER_BLOCK == {"c4a_kv": 64, "c128a_kv": 2, "indexer_kv": 64}
    assert [blocks.num_blocks(n) for n in (0, 1, 255, 256, 257)] == [0, 1, 1, 1, 2]
    assert blocks.entry_block(63, 4) == (0, 63) and blocks.entry_block(64, 4) == (1, 0)
    assert blocks.entry_block(1, 128) == (0, 1) and blocks.entry_block(2, 128) == (1, 0)
    assert blocks.complete_entries(7, 4) == 1 and blocks.complete_entries(8, 4) == 2


@pytest.mark.parametrize("main,idx", COMBOS)
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_three_page_sizes(model, main, idx):
    specs = layer_cache_specs(PRESETS[model], main, idx)
    buckets = fold_buckets(specs)
    sizes = {b.page_bytes for b in buckets}
    assert len(sizes) <= 3
    assert sizes == {64 * MAIN_B[main], 64 * IDX_B[idx], 2 * MAIN_B[main]}
    expected = {"large": 64 * MAIN_B[main], "middle": 64 * IDX_B[idx], "small": 2 * MAIN_B[main]}
    assert bucket_page_bytes(MAIN_B[main], IDX_B[idx]) == expected
    assert [b.page_bytes for b in buckets] == sorted(sizes, reverse=True)
    for s in specs:
        assert s.bucket == BUCKET_OF[s.kind]
        assert s.page_bytes == expected[s.bucket]
        assert s.natural_page_bytes <= s.page_bytes
    # every kind is in exactly one bucket
    kinds = [k for b in buckets for k in b.kinds]
    assert sorted(kinds) == sorted(s.kind for s in specs) == sorted(BUCKET_OF)


@pytest.mark.parametrize("main,idx", COMBOS)
def test_spec_geometry(main, idx):
    s = {x.kind: x for x in layer_cache_specs(V4_PRO, main, idx)}
    # KV kinds: one page = one logical block of 256 positions, no bucket padding.
    for kind, epp, ratio in (("c4a_kv", 64, 4), ("c128a_kv", 2, 128), ("indexer_kv", 64, 4)):
        assert s[kind].entries_per_page == epp
        assert s[kind].positions_per_page == 256
        assert s[kind].layer_ratio == ratio and s[kind].sliding_window is None
        assert s[kind].page_padding_bytes == 0
    assert s["window_kv"].positions_per_page == 64
    assert s["window_kv"].sliding_window == 128 and s["window_kv"].window_pages == 3
    assert s["window_kv"].num_layers == 61 and s["window_kv"].layer_ratio is None
    # compressor states: fp32 rows of 2 * coff * d * 4 bytes, window coff * ratio
    assert (s["c4a_state"].entry_bytes, s["c4a_state"].sliding_window) == (8192, 8)
    assert (s["c128a_state"].entry_bytes, s["c128a_state"].sliding_window) == (4096, 128)
    assert (s["indexer_state"].entry_bytes, s["indexer_state"].sliding_window) == (2048, 8)
    for kind in ("c4a_state", "c128a_state", "indexer_state"):
        rows, row, page = s[kind].entries_per_page, s[kind].entry_bytes, s[kind].page_bytes
        assert rows & (rows - 1) == 0  # power of two
        assert rows * row <= page < 2 * rows * row
        w = s[kind].sliding_window
        assert s[kind].window_pages == -(-(w - 1) // rows) + 1
    assert (s["c4a_kv"].num_layers, s["c128a_kv"].num_layers) == (30, 31)


def test_state_rows_match_vllm_for_fp8():
    # vLLM's CompressorStateCache: block_size 4 (c4a) and 8 (c128a) with the fp8_ds_mla cache.
    s = {x.kind: x for x in layer_cache_specs(V4_FLASH, "fp8", "fp8")}
    assert s["c4a_state"].entries_per_page == 4
    assert s["c128a_state"].entries_per_page == 8


def test_page_padding_per_kind():
    pad = page_padding(layer_cache_specs(V4_FLASH, "fp8", "mxfp4"))
    assert pad == {
        "c4a_kv": 0,
        "c128a_kv": 0,
        "indexer_kv": 0,
        "window_kv": 0,
        "c4a_state": 37376 - 4 * 8192,
        "c128a_state": 37376 - 8 * 4096,
        "indexer_state": 4352 - 2 * 2048,
    }
    pad = page_padding(layer_cache_specs(V4_FLASH, "bf16", "bf16"))
    assert set(pad.values()) == {0}


def test_specs_for_layer():
    kinds = lambda layer: {s.kind for s in specs_for_layer(V4_FLASH, layer, "fp8", "fp8")}
    assert kinds(0) == {"window_kv"}
    assert kinds(2) == {"window_kv", "c4a_kv", "indexer_kv", "c4a_state", "indexer_state"}
    assert kinds(3) == {"window_kv", "c128a_kv", "c128a_state"}
    assert {s.kind for s in specs_for_layer(V4_PRO, 0, "fp8", "fp8")} == kinds(3)


def test_rows_per_page():
    assert rows_per_page(8192, 37376) == 4
    assert rows_per_page(4096, 37376) == 8
    assert rows_per_page(2048, 4352) == 2
    assert rows_per_page(100, 100) == 1
    assert rows_per_page(100, 799) == 4
    with pytest.raises(BucketError, match="does not fit"):
        rows_per_page(8192, 4096)


@dataclass
class _Spec:
    kind: str
    bucket: str
    page_bytes: int
    natural_page_bytes: int


def test_fold_rejects_a_fourth_page_size():
    specs = [_Spec(f"k{i}", "large", 1000 * (i + 1), 10) for i in range(4)]
    with pytest.raises(BucketError, match="4 page sizes, more than 3"):
        fold_buckets(specs)
    assert len(fold_buckets(specs[:3])) == 3


def test_fold_rejects_a_page_that_does_not_fit():
    with pytest.raises(BucketError, match="exceeds"):
        fold_buckets([_Spec("x", "small", 100, 101)])


def test_fold_merges_buckets_of_equal_size():
    out = fold_buckets(
        [_Spec("a", "middle", 64, 64), _Spec("b", "small", 64, 32), _Spec("c", "large", 128, 128)]
    )
    assert [(b.name, b.page_bytes, b.kinds) for b in out] == [
        ("large", 128, ("c",)),
        ("middle+small", 64, ("a", "b")),
    ]


@pytest.mark.parametrize(
    "window,per_page",
    [(1, 4), (8, 4), (8, 2), (9, 4), (128, 64), (129, 64), (65, 64), (128, 8), (7, 8), (128, 16)],
)
def test_window_pages_is_the_worst_case_over_alignments(window, per_page):
    spec = CacheSpec("w", "window", None, 1, "x", 10, 1, per_page, window, 10 * per_page, "large")
    brute = max(
        (start + window - 1) // per_page - start // per_page + 1 for start in range(per_page)
    )
    assert spec.window_pages == brute
    # a long context holds exactly that many pages; a short one only the pages it covers
    assert spec.pages(10**6) == brute
    for n in range(1, window + 1):
        assert spec.pages(n) == min(-(-n // per_page), brute)
        assert spec.entries(n) == n
