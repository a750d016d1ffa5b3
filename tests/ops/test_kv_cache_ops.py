# SPDX-License-Identifier: Apache-2.0
"""kv_insert / kv_gather conformance (every CPU-runnable backend) and paged slot mapping."""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats import FORMAT_NAMES, make_format
from vllm_dsv4_hw.ops.api import ENTRY_SLOTS, KV_GATHER, KV_INSERT

# every distinct format ("fp8_ds_mla" is an alias of main "fp8")
ALL_FORMATS = [
    (kind, name) for kind in FORMAT_NAMES for name in FORMAT_NAMES[kind] if name != "fp8_ds_mla"
]
POISON = 0xAB


def _poisoned_cache(fmt, num_pages, pad=13):
    cache = fmt.new_cache(num_pages, page_bytes=fmt.min_page_bytes + pad)
    cache.fill_(POISON)
    return cache


def _expected_cache(cache, fmt, slots, x):
    """Write the encoded rows at hand-computed byte offsets (data region, then scale region)."""
    want = cache.clone()
    data, scales = fmt.quantize(x)
    e = fmt.entries_per_page
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, off = divmod(s, e)
        d0 = off * fmt.data_bytes
        want[page, d0 : d0 + fmt.data_bytes] = data[i]
        s0 = e * fmt.data_bytes + off * fmt.scale_bytes
        want[page, s0 : s0 + fmt.scale_bytes] = scales[i]
    return want


def _rows(gen, n, dim):
    x = torch.randn(n, dim, generator=gen)
    return x * torch.exp2(torch.empty(n, 1).uniform_(-6, 6, generator=gen))


@pytest.mark.parametrize("backend", cpu_backends("kv_insert"))
@pytest.mark.parametrize("kind,name", ALL_FORMATS)
def test_insert_layout_and_gather(backend, kind, name, gen):
    kv_insert, kv_gather = impl(KV_INSERT, backend), impl(KV_GATHER, backend)
    e, pages = 8, 3
    fmt = make_format(name, kind, e)
    cache = _poisoned_cache(fmt, pages)
    n = 8
    slots = torch.randperm(pages * e, generator=gen)[:n]
    slots[torch.randperm(n, generator=gen)[:2]] = -1
    x = _rows(gen, n, fmt.dim).to(torch.bfloat16)
    want = _expected_cache(cache, fmt, slots, x)
    kv_insert(cache, slots, x, fmt)
    # every byte: written entries where the layout says, poison (neighbours, padding) elsewhere
    assert torch.equal(cache, want)
    assert int((cache != POISON).sum()) > 0

    # gather: any slot shape; -1 gives zeros; values are the format's round trip
    ref = fmt.dequantize(*fmt.quantize(x))
    live = (slots >= 0).nonzero().flatten()
    q = torch.stack([slots[live[:4]], torch.tensor([-1, int(slots[live[4]]), -1, -1])])
    out = kv_gather(cache, q, fmt)
    assert out.shape == (2, 4, fmt.dim) and out.dtype == torch.float32
    assert torch.equal(out[0], ref[live[:4]])
    assert torch.equal(out[1, 1], ref[live[4]])
    assert torch.equal(out[1, [0, 2, 3]], torch.zeros(3, fmt.dim))
    # the round trip is close to the input (loose: the tight bounds live in test_formats)
    tol = {"mxfp4": 0.3, "fp8": 0.07}.get(name, 0.0)
    xr = x.float()[live[:4]]
    assert torch.all((out[0] - xr).abs() <= tol * xr.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("backend", cpu_backends("kv_insert"))
@pytest.mark.parametrize("kind,name", [("main", "fp8"), ("indexer", "mxfp4"), ("indexer", "bf16")])
def test_insert_one_entry_at_known_offsets(backend, kind, name):
    """Slot 11 with E=4 is page 2, entry 3: its data at [3*D, 4*D), its scales at 4*D + 3*S."""
    kv_insert = impl(KV_INSERT, backend)
    fmt = make_format(name, kind, 4)
    cache = _poisoned_cache(fmt, 4)
    x = torch.linspace(-3, 5, fmt.dim)[None]
    kv_insert(cache, torch.tensor([11]), x, fmt)
    d, s = fmt.data_bytes, fmt.scale_bytes
    entry = fmt.encode(x)[0]
    assert torch.equal(cache[2, 3 * d : 4 * d], entry[:d])
    assert torch.equal(cache[2, 4 * d + 3 * s : 4 * d + 4 * s], entry[d:])
    changed = (cache != POISON).nonzero()
    assert changed[:, 0].unique().tolist() == [2]
    cols = set(changed[:, 1].tolist())
    assert cols <= set(range(3 * d, 4 * d)) | set(range(4 * d + 3 * s, 4 * d + 4 * s))
    assert len(cols) > fmt.data_bytes // 2


@pytest.mark.parametrize("backend", cpu_backends("kv_insert"))
def test_overwrite_and_skip(backend, gen):
    kv_insert, kv_gather = impl(KV_INSERT, backend), impl(KV_GATHER, backend)
    fmt = make_format("fp8", "main", 4)
    cache = _poisoned_cache(fmt, 2)
    before = cache.clone()
    kv_insert(cache, torch.tensor([-1, -1]), torch.randn(2, 512, generator=gen), fmt)
    assert torch.equal(cache, before)  # all -1: nothing written
    a, b = torch.randn(2, 512, generator=gen)
    kv_insert(cache, torch.tensor([5]), a[None], fmt)
    kv_insert(cache, torch.tensor([5]), b[None], fmt)
    got = kv_gather(cache, torch.tensor([5]), fmt)
    assert torch.equal(got, fmt.decode(fmt.encode(b[None])))


@pytest.mark.parametrize("backend", cpu_backends("kv_insert"))
def test_gather_all_missing_gives_zeros(backend):
    kv_gather = impl(KV_GATHER, backend)
    for kind, name in ALL_FORMATS:
        fmt = make_format(name, kind, 4)
        cache = _poisoned_cache(fmt, 1)
        out = kv_gather(cache, torch.full((3, 2), -1), fmt)
        assert out.shape == (3, 2, fmt.dim) and torch.equal(out, torch.zeros(3, 2, fmt.dim))
        out = kv_gather(fmt.new_cache(0), torch.full((2,), -1), fmt)
        assert torch.equal(out, torch.zeros(2, fmt.dim))


@pytest.mark.parametrize("backend", cpu_backends("kv_insert"))
def test_bad_inputs_raise(backend):
    kv_insert, kv_gather = impl(KV_INSERT, backend), impl(KV_GATHER, backend)
    fmt = make_format("fp8", "main", 4)
    cache = fmt.new_cache(2)
    with pytest.raises(ValueError, match=r"\[N, 512\]"):
        kv_insert(cache, torch.tensor([0]), torch.zeros(1, 128), fmt)
    with pytest.raises(ValueError, match="floating"):
        kv_insert(cache, torch.tensor([0]), torch.zeros(1, 512, dtype=torch.int64), fmt)
    with pytest.raises(ValueError, match="slots"):
        kv_insert(cache, torch.tensor([0, 1]), torch.zeros(1, 512), fmt)
    with pytest.raises(ValueError, match="slots must be -1 or in"):
        kv_insert(cache, torch.tensor([8]), torch.zeros(1, 512), fmt)
    with pytest.raises(ValueError, match="integer"):
        kv_insert(cache, torch.tensor([0.0]), torch.zeros(1, 512), fmt)
    with pytest.raises(ValueError, match="uint8"):
        kv_insert(cache.view(torch.int8), torch.tensor([0]), torch.zeros(1, 512), fmt)
    with pytest.raises(ValueError, match="page of"):
        kv_gather(cache[:, :100], torch.tensor([0]), fmt)
    with pytest.raises(ValueError, match="slots must be -1 or in"):
        kv_gather(cache, torch.tensor([[0, -2]]), fmt)
    assert torch.equal(cache, fmt.new_cache(2))  # nothing was written by the failed calls


@pytest.mark.parametrize("backend", cpu_backends(KV_INSERT))
def test_every_backend_matches_the_paged_rows(backend, gen):
    # Each backend's kv_insert / kv_gather against kv_cache.paged (the byte layout's definition);
    # on CPU ops.kv_insert itself would dispatch to the reference, which *is* paged.
    fmt = make_format("mxfp4", "indexer", 4)
    c1, c2 = fmt.new_cache(3), fmt.new_cache(3)
    x = torch.randn(5, 128, generator=gen)
    slots = torch.tensor([0, 3, 4, 11, -1])
    impl(KV_INSERT, backend)(c1, slots, x, fmt)
    paged.insert_rows(c2, slots, x, fmt)
    assert torch.equal(c1, c2) and bool(c1.any())
    if backend in cpu_backends(KV_GATHER):
        assert torch.equal(
            impl(KV_GATHER, backend)(c1, slots, fmt), paged.gather_rows(c2, slots, fmt)
        )


# -- logical index -> slot ------------------------------------------------------------------------
def test_logical_to_slot_by_hand():
    bt = torch.tensor([[7, 2, -1], [0, 5, 9]], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0])
    index = torch.tensor([0, 3, 4, 9, 5, 11, -1, 8])
    got = paged.logical_to_slot(bt, req, index, 4)
    # req 0: entry 0 -> page 7 off 0 = 28; 3 -> 31; 4 -> page 2 off 0 = 8; 9 -> page -1 -> -1
    # req 1: 5 -> page 5 off 1 = 21; 11 -> page 9 off 3 = 39; -1 -> -1; req 0 entry 8 -> -1
    assert got.dtype == torch.int64
    assert got.tolist() == [28, 31, 8, -1, 21, 39, -1, -1]


def test_logical_to_slot_broadcasts_and_matches_loop(gen):
    r, b, e = 3, 6, 16
    bt = torch.randperm(40, generator=gen)[: r * b].reshape(r, b)
    bt[1, 4:] = -1
    req = torch.randint(0, r, (10,), generator=gen)
    index = torch.randint(-3, b * e, (10, 7), generator=gen)
    got = paged.logical_to_slot(bt, req, index, e)
    assert got.shape == (10, 7)
    for i in range(10):
        for j in range(7):
            k = int(index[i, j])
            page = int(bt[req[i], k // e]) if k >= 0 else -1
            want = page * e + k % e if page >= 0 else -1
            assert int(got[i, j]) == want


def test_logical_to_slot_errors():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 columns"):
        paged.logical_to_slot(bt, torch.tensor([0]), torch.tensor([12]), 4)
    with pytest.raises(ValueError, match="req rows"):
        paged.logical_to_slot(bt, torch.tensor([2]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="same N"):
        paged.logical_to_slot(bt, torch.tensor([0, 1]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="integer"):
        paged.logical_to_slot(bt, torch.tensor([0]), torch.tensor([0.5]), 4)
    assert paged.logical_to_slot(
        bt, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4
    ).shape == (0,)


@pytest.mark.parametrize("backend", cpu_backends(ENTRY_SLOTS))
@pytest.mark.parametrize("per_page,k", [(4, 7), (64, 513), (2, 1)])
def test_entry_slots_matches_the_validating_mapping(backend, per_page, k, gen):
    """``entry_slots`` (no validation, indices past the table -> -1) equals ``logical_to_slot`` on
    valid indices, -1 elsewhere, for int32 and int64 indices."""
    r, b = 3, 5
    bt = torch.randperm(40, generator=gen)[: r * b].reshape(r, b).to(torch.int32)
    bt[1, 2:] = -1
    req = torch.randint(0, r, (6,), generator=gen)
    index = torch.randint(-1, b * per_page + 2 * per_page, (6, k), generator=gen)
    inside = (index >= 0) & (index < b * per_page)
    want = torch.where(
        inside, paged.logical_to_slot(bt, req, torch.where(inside, index, -1), per_page), -1
    )
    for dtype in (torch.int32, torch.int64):
        got = impl(ENTRY_SLOTS, backend)(bt, req, index.to(dtype), per_page)
        assert got.dtype == torch.int64 and torch.equal(got, want)
