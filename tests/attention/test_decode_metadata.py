# SPDX-License-Identifier: Apache-2.0
"""The graph-safe decode metadata against the general builder, on every backend of the op.

For each layer kind: random block tables (pages drawn from a shuffled pool, some released as -1 or
vLLM's null block 0), decode positions that do and do not complete c4a / c128a groups, padding rows
(seq_len 0), and state matrices whose pages are ``stride`` rows apart. Every field must equal
``build_step_metadata`` of the same step (the plans padded to one group per row: exactly the
builder's groups, -1 elsewhere). The decode path must not synchronize with the host (counted).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.attention.decode_metadata import decode_layout, decode_step_metadata
from vllm_dsv4_hw.attention.metadata import BlockTables, PageGeometry, build_step_metadata
from vllm_dsv4_hw.kinds import kind_of
from vllm_dsv4_hw.ops import api

GEOM = PageGeometry(
    window_positions_per_page=64,
    comp_entries_per_page=2,
    indexer_entries_per_page=64,
    main_state_rows_per_page=4,
    indexer_state_rows_per_page=2,
)
GEOM4 = PageGeometry(
    window_positions_per_page=64,
    comp_entries_per_page=64,
    indexer_entries_per_page=64,
    main_state_rows_per_page=8,
    indexer_state_rows_per_page=2,
)
MAX_POS = 2048
WINDOW = 128


def _tables(gen, ratio, geom, rows, null_page):
    """Full tables over MAX_POS positions per row; window / state pages outside the last W
    positions of ``keep_from`` are released (null)."""
    per = {
        "window": geom.window_positions_per_page,
        "main_state": geom.main_state_rows_per_page,
        "indexer_state": geom.indexer_state_rows_per_page,
        "comp": geom.comp_entries_per_page * max(ratio, 1),
        "indexer": geom.indexer_entries_per_page * 4,
    }
    out = {}
    for cache in kind_of(ratio).caches:
        cols = -(-MAX_POS // per[cache])
        perm = torch.randperm(rows * cols + 5, generator=gen)[: rows * cols] + 1  # page 0 = null
        out[cache] = perm.view(rows, cols).to(torch.int32)
    return out, per


def _release(tables, per, positions, null_page):
    """Release window / state pages that the step cannot read any more (as vLLM does)."""
    out = {k: v.clone() for k, v in tables.items()}
    for cache in ("window", "main_state", "indexer_state"):
        if cache not in out:
            continue
        keep = {"window": WINDOW, "main_state": 256, "indexer_state": 8}[cache]
        for r, p in enumerate(positions):
            lo = max(0, p - keep) // per[cache]
            out[cache][r, : max(0, lo - 1)] = null_page
    return out


def _as_minus_one(t, null_page):
    t = t.to(torch.int64)
    return torch.where(t > null_page, t, torch.full_like(t, -1))


def _cases(ratio):
    # positions completing a c4a group (x % 4 == 3) and a c128a one (x % 128 == 127), plus others
    return [[0, 3, 127, 255], [1, 130, 1023, 2047], [7, 259, 600, 1151]]


@pytest.mark.parametrize("backend", cpu_backends(api.DECODE_METADATA))
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("null_page", [-1, 0])
def test_decode_metadata_equals_general_builder(backend, ratio, null_page, gen, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", f"{api.DECODE_METADATA}={backend}")
    geom = GEOM4 if ratio == 4 else GEOM
    stride = {
        "main": geom.main_state_rows_per_page + 3,
        "indexer": geom.indexer_state_rows_per_page + 1,
    }
    layout = decode_layout(
        ratio,
        geom,
        WINDOW,
        MAX_POS,
        null_page=null_page,
        main_state_stride=stride["main"],
        indexer_state_stride=stride["indexer"],
    )
    for positions in _cases(ratio):
        raw, per = _tables(gen, ratio, geom, len(positions) + 2, null_page)
        pos_all = positions + [0, 0]
        raw = _release(raw, per, pos_all, null_page)
        seq_lens = torch.tensor([p + 1 for p in positions] + [0, 0])  # two padding rows
        got = decode_step_metadata(seq_lens, BlockTables(**raw), geom, layout)
        n = len(positions)
        tables = BlockTables(**{k: _as_minus_one(v[:n], null_page) for k, v in raw.items()})
        want = build_step_metadata(
            positions,
            [1] * n,
            ratio,
            tables,
            geom,
            WINDOW,
            max_comp_entries=layout.max_comp_entries or None,
        )
        assert torch.equal(got.positions[:n], want.positions)
        # a bound fixed by the tables (graphs), never below what the step sees
        assert got.max_visible_entries >= want.max_visible_entries
        if ratio == 4:
            assert (
                got.max_visible_entries == raw["indexer"].shape[1] * geom.indexer_entries_per_page
            )
        assert bool((got.positions[n:] == -1).all())
        for name in ("window_insert_slots", "window_slots"):
            g, w = getattr(got, name), getattr(want, name)
            assert torch.equal(g[:n], w), name
            assert bool((g[n:] == -1).all()), name
        if ratio == 128:
            assert torch.equal(got.comp_slots[:n], want.comp_slots)
            assert bool((got.comp_slots[n:] == -1).all())
        for pname, key in (("main_plan", "main"), ("indexer_plan", "indexer")):
            pg, pw = getattr(got, pname), getattr(want, pname)
            if pw is None:
                assert pg is None
                continue
            k, r = (
                stride[key],
                (
                    geom.main_state_rows_per_page
                    if key == "main"
                    else geom.indexer_state_rows_per_page
                ),
            )

            def remap(x, k=k, r=r):  # the general builder's logical rows -> strided rows
                return torch.where(x >= 0, (x // r) * k + x % r, x)

            assert torch.equal(pg.state_slots[:n], remap(pw.state_slots)), pname
            assert bool((pg.state_slots[n:] == -1).all())
            real = pg.cache_slots >= 0
            tok = torch.nonzero(real).squeeze(1)
            assert torch.equal(tok, pw.group_token), pname
            assert torch.equal(pg.group_rows[tok], remap(pw.group_rows)), pname
            assert torch.equal(pg.group_entry_index[tok], pw.group_entry_index), pname
            assert torch.equal(pg.cache_slots[tok], pw.cache_slots), pname
            assert bool((pg.group_rows[~real] == -1).all()), pname
        if ratio == 4:
            assert torch.equal(got.block_tables.comp[:n], tables.comp)
            assert torch.equal(got.block_tables.indexer[:n], tables.indexer)


class _HostSyncCounter:
    """Counts the tensor methods that move data to the host (or branch on it)."""

    NAMES = (
        "item",
        "tolist",
        "cpu",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "nonzero",
    )

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, _name=name, **kw):
                self.calls.append(_name)
                return _orig(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, wrapped)
        orig_nz = torch.nonzero

        def nz(*a, **kw):
            self.calls.append("torch.nonzero")
            return orig_nz(*a, **kw)

        monkeypatch.setattr(torch, "nonzero", nz)


@pytest.mark.parametrize("backend", cpu_backends(api.DECODE_METADATA))
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_decode_metadata_does_not_sync_with_the_host(backend, ratio, gen, monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_OP_BACKENDS", f"{api.DECODE_METADATA}={backend}")
    geom = GEOM4 if ratio == 4 else GEOM
    layout = decode_layout(ratio, geom, WINDOW, MAX_POS, null_page=0)
    raw, _ = _tables(gen, ratio, geom, 4, 0)
    seq_lens = torch.tensor([4, 128, 1024, 0])
    tables = BlockTables(**raw)
    decode_step_metadata(seq_lens, tables, geom, layout)  # resolve the backend first
    counter = _HostSyncCounter(monkeypatch)
    meta = decode_step_metadata(seq_lens, tables, geom, layout)
    assert counter.calls == [], counter.calls
    monkeypatch.undo()
    assert meta.num_tokens == 4
    # the counter does see a host sync: the general builder has several
    counter = _HostSyncCounter(monkeypatch)
    build_step_metadata(
        [3, 127, 1023],
        [1, 1, 1],
        ratio,
        BlockTables(**{k: v[:3].to(torch.int64) for k, v in raw.items()}),
        geom,
        WINDOW,
    )
    assert counter.calls, "the counter must notice the general builder's host syncs"


def test_impl_is_registered_for_reference():
    assert "reference" in cpu_backends(api.DECODE_METADATA)
    assert impl(api.DECODE_METADATA, "reference") is not None
