# SPDX-License-Identifier: Apache-2.0
"""plan_kv: the spec section 7 figures, entry/page counts against independent arithmetic, padding,
capacity, and input validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from vllm_dsv4_hw.config import PRESETS, V4_FLASH, V4_PRO
from vllm_dsv4_hw.kv_cache import blocks
from vllm_dsv4_hw.kv_cache.sizing import KVPlanError, plan_kv
from vllm_dsv4_hw.kv_cache.specs import layer_cache_specs

GIB = 2**30
M = 1_048_576
MAIN_B = {"fp8": 584, "bf16": 1024}
IDX_B = {"mxfp4": 68, "fp8": 132, "bf16": 256}
COMBOS = [(m, i) for m in ("bf16", "fp8") for i in ("bf16", "fp8", "mxfp4")]

# Spec section 7: compressed main entries + indexer keys per sequence at 1M, GiB.
SPEC_GROWING_GIB = [
    ("v4-pro", "bf16", "bf16", 9.617),
    ("v4-pro", "fp8", "fp8", 5.382),
    ("v4-pro", "fp8", "mxfp4", 4.914),
    ("v4-flash", "bf16", "bf16", 6.719),
    ("v4-flash", "fp8", "fp8", 3.760),
    ("v4-flash", "fp8", "mxfp4", 3.432),
]

# Rows per compressor-state page, worked out by hand from the bucket sizes
# (large = 64 main entries, middle = 64 indexer entries; largest power of two that fits).
STATE_ROWS = {
    ("c4a_state", "fp8"): 4,  # 37376 // 8192 = 4.56
    ("c4a_state", "bf16"): 8,  # 65536 // 8192 = 8
    ("c128a_state", "fp8"): 8,  # 37376 // 4096 = 9.1
    ("c128a_state", "bf16"): 16,
    ("indexer_state", "mxfp4"): 2,  # 4352 // 2048 = 2.1
    ("indexer_state", "fp8"): 4,  # 8448 // 2048 = 4.1
    ("indexer_state", "bf16"): 8,
}


@pytest.mark.parametrize("model,main,idx,gib", SPEC_GROWING_GIB)
def test_spec_growing_part(model, main, idx, gib):
    plan = plan_kv(PRESETS[model], M, main, idx)
    growing = plan.breakdown["compressed_kv"] + plan.breakdown["indexer_keys"]
    assert round(growing / GIB, 3) == pytest.approx(gib, abs=1e-9)
    assert plan.growing_bytes == growing


def test_spec_constants_pro():
    plan = plan_kv(V4_PRO, M, "bf16", "bf16")
    assert round(plan.baseline_v32_bytes / GIB, 3) == 83.875
    assert round(plan.breakdown["window"] / GIB, 4) == 0.0074
    assert round(plan.breakdown["compressor_state"] / GIB, 4) == 0.0174
    # c4a 64 KiB main + 16 KiB indexer, c128a 512 KiB, per layer.
    assert plan.breakdown["compressor_state"] == 30 * (64 + 16) * 1024 + 31 * 512 * 1024
    assert round(plan.ratio, 1) == 8.7


def test_baseline_uses_layer_count():
    assert plan_kv(V4_FLASH, M, "fp8", "fp8").baseline_v32_bytes == 1408 * M * 43
    assert plan_kv(V4_PRO, 1000, "fp8", "fp8").baseline_v32_bytes == 1408 * 1000 * 61


def _expected(cfg, n, main, idx):
    """Useful and allocated bytes, summed layer by layer from first principles."""
    large, middle, small = 64 * MAIN_B[main], 64 * IDX_B[idx], 2 * MAIN_B[main]

    def window_pages(w, p):
        return min(math.ceil(n / p), math.ceil((w - 1) / p) + 1)

    useful = alloc = 0
    blocks_ = math.ceil(n / 256)
    for r in cfg.compress_ratios:
        # window KV: 128 rows of main entries, 64-position pages
        useful += min(n, 128) * MAIN_B[main]
        alloc += window_pages(128, 64) * large
        if r == 4:
            useful += (n // 4) * (MAIN_B[main] + IDX_B[idx])
            alloc += blocks_ * (large + middle)
            useful += min(n, 8) * (8192 + 2048)
            alloc += window_pages(8, STATE_ROWS["c4a_state", main]) * large
            alloc += window_pages(8, STATE_ROWS["indexer_state", idx]) * middle
        elif r == 128:
            useful += (n // 128) * MAIN_B[main]
            alloc += blocks_ * small
            useful += min(n, 128) * 4096
            alloc += window_pages(128, STATE_ROWS["c128a_state", main]) * large
    return useful, alloc


BOUNDARY_CONTEXTS = [
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    63,
    64,
    65,
    127,
    128,
    129,
    255,
    256,
    257,
    259,
    260,
    511,
    512,
    513,
    100_000,
    M - 1,
    M,
]


@pytest.mark.parametrize("model", sorted(PRESETS))
@pytest.mark.parametrize("n", BOUNDARY_CONTEXTS)
def test_counts_across_boundaries(model, n):
    cfg = PRESETS[model]
    plan = plan_kv(cfg, n, "fp8", "mxfp4")
    k = {kp.kind: kp for kp in plan.kinds}
    assert k["c4a_kv"].entries_per_layer == n // 4
    assert k["indexer_kv"].entries_per_layer == n // 4
    assert k["c128a_kv"].entries_per_layer == n // 128
    assert k["window_kv"].entries_per_layer == min(n, 128)
    assert k["c4a_state"].entries_per_layer == min(n, 8)
    assert k["indexer_state"].entries_per_layer == min(n, 8)
    assert k["c128a_state"].entries_per_layer == min(n, 128)
    nblocks = (n + 255) // 256
    for kind in ("c4a_kv", "indexer_kv", "c128a_kv"):
        assert k[kind].pages_per_layer == nblocks == blocks.num_blocks(n)
        # every complete entry fits the allocated pages
        assert k[kind].entries_per_layer <= nblocks * k[kind].entries_per_page
    assert k["window_kv"].pages_per_layer == min((n + 63) // 64, 3)
    assert k["c4a_state"].pages_per_layer == min((n + 3) // 4, 3)
    assert k["indexer_state"].pages_per_layer == min((n + 1) // 2, 5)
    assert k["c128a_state"].pages_per_layer == min((n + 7) // 8, 17)
    useful, alloc = _expected(cfg, n, "fp8", "mxfp4")
    assert plan.bytes_per_sequence == useful
    assert plan.allocated_bytes == alloc
    assert plan.padding_bytes == alloc - useful > 0


@pytest.mark.parametrize("main,idx", COMBOS)
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_totals_all_combos(model, main, idx):
    cfg = PRESETS[model]
    for n in (1, 257, 4096 + 3, M):
        plan = plan_kv(cfg, n, main, idx)
        assert (plan.bytes_per_sequence, plan.allocated_bytes) == _expected(cfg, n, main, idx)
        assert sum(plan.breakdown.values()) == plan.bytes_per_sequence
        assert sum(k.padding_bytes for k in plan.kinds) == plan.padding_bytes
        for k in plan.kinds:
            assert k.page_padding_bytes + k.slot_padding_bytes == k.padding_bytes >= 0
        assert sum(b.bytes_per_sequence for b in plan.page_buckets) == plan.allocated_bytes


@pytest.mark.parametrize("main,idx", COMBOS)
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_padding_under_one_percent_at_1m(model, main, idx):
    plan = plan_kv(PRESETS[model], M, main, idx)
    assert 0 < plan.padding_bytes < 0.01 * plan.bytes_per_sequence
    assert plan.padding_fraction == plan.padding_bytes / plan.bytes_per_sequence
    assert len({b.page_bytes for b in plan.page_buckets}) <= 3
    k = {kp.kind: kp for kp in plan.kinds}
    # 1M is a whole number of logical blocks: no slack in the full caches...
    for kind in ("c4a_kv", "c128a_kv", "indexer_kv"):
        assert k[kind].padding_bytes == 0
    # ...but the window touches 3 pages of 64 for 128 positions.
    assert k["window_kv"].slot_padding_bytes == k["window_kv"].num_layers * 64 * MAIN_B[main]


def test_padding_reported_where_it_exists():
    # fp8: a 4-row c4a state page (32768 B) is padded to the 37376 B large page.
    plan = plan_kv(V4_FLASH, M, "fp8", "mxfp4")
    st = plan.kind("c4a_state")
    assert st.page_padding_bytes == 21 * 3 * (37376 - 4 * 8192)
    # bf16: 8 rows fill the 65536 B page exactly; only the window's extra page is slack.
    st = plan_kv(V4_FLASH, M, "bf16", "bf16").kind("c4a_state")
    assert st.page_padding_bytes == 0
    assert st.slot_padding_bytes == 21 * (2 * 65536 - 8 * 8192)
    # A partly used last block: 257 positions hold 64 c4a entries in 2 pages of 64.
    kp = plan_kv(V4_FLASH, 257, "fp8", "mxfp4").kind("c4a_kv")
    assert kp.pages_per_layer == 2
    assert kp.padding_bytes == 21 * 64 * 584
    # A context with no complete c128a entry still holds its block's page.
    kp = plan_kv(V4_PRO, 127, "bf16", "bf16").kind("c128a_kv")
    assert kp.entries_per_layer == 0 and kp.pages_per_layer == 1
    assert kp.useful_bytes == 0 and kp.padding_bytes == 31 * 2048


def test_flash_has_window_only_layers():
    plan = plan_kv(V4_FLASH, 1000, "fp8", "fp8")
    assert plan.kind("window_kv").num_layers == 43
    assert plan.kind("c4a_kv").num_layers == 21
    assert plan.kind("c128a_kv").num_layers == 20
    assert plan.kind("c128a_state").num_layers == 20


@pytest.mark.parametrize("main,idx", COMBOS)
def test_max_sequences(main, idx):
    plan = plan_kv(V4_PRO, M, main, idx)
    per_seq = plan.allocated_bytes
    for k in (1, 7, 16):
        assert plan_kv(V4_PRO, M, main, idx, memory_bytes=k * per_seq).max_sequences == k
        assert plan_kv(V4_PRO, M, main, idx, memory_bytes=k * per_seq - 1).max_sequences == k - 1
    p = plan_kv(V4_PRO, M, main, idx, memory_bytes=80 * GIB)
    assert p.max_sequences == (80 * GIB) // per_seq
    assert plan.max_sequences is None and "max_sequences" not in plan.to_dict()
    assert p.to_dict()["max_sequences"] == p.max_sequences


def test_max_sequences_pro_fp8_mxfp4_80gib():
    # 4.942 GiB allocated per 1M sequence -> 16 in 80 GiB.
    assert plan_kv(V4_PRO, M, "fp8", "mxfp4", memory_bytes=80 * GIB).max_sequences == 16


def test_format_aliases_and_case():
    a = plan_kv(V4_PRO, 4096, "fp8_ds_mla", "MXFP4")
    b = plan_kv(V4_PRO, 4096, "fp8", "mxfp4")
    assert a.to_dict() == b.to_dict()


@pytest.mark.parametrize("context", [0, -1, -1024])
def test_rejects_non_positive_context(context):
    with pytest.raises(KVPlanError, match="positive"):
        plan_kv(V4_PRO, context, "fp8", "fp8")


@pytest.mark.parametrize("context", [True, 1.5, "1024", None])
def test_rejects_non_integer_context(context):
    with pytest.raises(KVPlanError, match="integer"):
        plan_kv(V4_PRO, context, "fp8", "fp8")


def test_rejects_context_over_limit():
    plan_kv(V4_PRO, V4_PRO.max_position_embeddings, "fp8", "fp8")  # the limit itself is fine
    with pytest.raises(KVPlanError, match=r"max_position_embeddings \(1048576\)"):
        plan_kv(V4_PRO, M + 1, "fp8", "fp8")
    small = replace(V4_FLASH, max_position_embeddings=4096)
    with pytest.raises(KVPlanError, match=r"max_position_embeddings \(4096\)"):
        plan_kv(small, 4097, "fp8", "fp8")


@pytest.mark.parametrize(
    "main,idx,word",
    [
        ("fp4", "fp8", "main KV format 'fp4'"),
        ("mxfp4", "fp8", "main KV format 'mxfp4'"),
        ("fp8", "int8", "indexer format 'int8'"),
        ("bf16", "fp8_ds_mla", "indexer format"),
    ],
)
def test_rejects_unknown_formats(main, idx, word):
    with pytest.raises(KVPlanError, match=word):
        plan_kv(V4_PRO, 1024, main, idx)


@pytest.mark.parametrize("memory", [0, -5, 1.5, True])
def test_rejects_bad_memory(memory):
    with pytest.raises(KVPlanError, match="memory"):
        plan_kv(V4_PRO, 1024, "fp8", "fp8", memory_bytes=memory)


def test_rejects_geometry_the_formats_do_not_cover():
    odd = replace(V4_FLASH, head_dim=256)
    with pytest.raises(KVPlanError, match="head_dim=256"):
        plan_kv(odd, 1024, "fp8", "fp8")
    with pytest.raises(KVPlanError, match="sliding_window"):
        plan_kv(replace(V4_FLASH, sliding_window=0), 1024, "fp8", "fp8")


@pytest.mark.parametrize("main,idx", COMBOS)
def test_entry_bytes_match_the_entry_formats(main, idx):
    from vllm_dsv4_hw.kv_cache import formats

    specs = {s.kind: s for s in layer_cache_specs(V4_FLASH, main, idx)}
    for kind, fkind, name in (
        ("c4a_kv", "main", main),
        ("c128a_kv", "main", main),
        ("window_kv", "main", main),
        ("indexer_kv", "indexer", idx),
    ):
        spec = specs[kind]
        fmt = formats.make_format(name, fkind, spec.entries_per_page)
        assert fmt.entry_bytes == spec.entry_bytes
        assert fmt.min_page_bytes == spec.natural_page_bytes <= spec.page_bytes
