# SPDX-License-Identifier: Apache-2.0
"""sparse_attention conformance: paged gather + sink softmax against a dense float64 oracle.

The caches are filled here with the entry-format contract's page layout (data parts of all entries
first, then their scale parts, then padding), written byte by byte independently of the op, at
random physical slots over several pages.
"""

from dataclasses import dataclass, field

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import dense_attention_with_sink
from vllm_dsv4_hw.kv_cache.formats import EntryFormat, make_format
from vllm_dsv4_hw.ops.api import SPARSE_ATTENTION

OP = SPARSE_ATTENTION
BACKENDS = cpu_backends(OP)


# -- exact test formats -------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaledF32Format(EntryFormat):
    """Exact: data = x / 2^e as float32, scale = 2^e as float32 (power of two: lossless).
    Exercises the scale part of the page layout with values that matter."""

    name: str = "test_scaled_f32"
    dim: int = 512
    data_bytes: int = field(default=0)
    scale_bytes: int = 4
    entries_per_page: int = 16

    def __post_init__(self):
        object.__setattr__(self, "data_bytes", 4 * self.dim)

    def quantize(self, x):
        x = x.float()
        e = torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp_min(1e-30)))
        s = torch.exp2(e)
        return (x / s).contiguous().view(torch.uint8), s.contiguous().view(torch.uint8)

    def dequantize(self, data, scales):
        return data.contiguous().view(torch.float32) * scales.contiguous().view(torch.float32)


# Project formats: (name, tolerance of the output vs attention over the unquantized keys,
# relative to max |o|). Every format must give the exact attention over the values it stores.
FORMATS = [("scaled_f32", 1e-5), ("fp32", 1e-5), ("bf16", 2e-2), ("fp8_ds_mla", 0.2)]


def _format(name, entries_per_page=16):
    if name == "scaled_f32":
        return ScaledF32Format(dim=512, entries_per_page=entries_per_page)
    return make_format(name, "main", entries_per_page)


# -- cache construction -------------------------------------------------------------------------
def _fill_cache(fmt, rows, gen, spare_pages=2, pad=96):
    """Write rows [M, dim] at distinct random slots; returns (cache, slot_of_row [M], the exact
    values the cache holds for the rows (the format's round trip) as float64)."""
    e = fmt.entries_per_page
    m = rows.shape[0]
    pages = (m + e - 1) // e + spare_pages
    cache = torch.randint(
        0, 256, (pages, fmt.min_page_bytes + pad), generator=gen, dtype=torch.uint8
    )  # garbage everywhere that is not written
    slots = torch.randperm(pages * e, generator=gen)[:m]
    enc = fmt.encode(rows)
    db, sb = fmt.data_bytes, fmt.scale_bytes
    for i, s in enumerate(slots.tolist()):
        p, o = divmod(s, e)
        cache[p, o * db : (o + 1) * db] = enc[i, :db]
        cache[p, e * db + o * sb : e * db + (o + 1) * sb] = enc[i, db:]
    return cache, slots, fmt.decode(enc).double()


def _make_case(
    gen,
    fmt,
    t,
    h,
    w,
    k,
    mw=40,
    mc=40,
    p_invalid=0.2,
    q_dtype=torch.float32,
    key_scale=1.0,
    empty_tokens=(),
    comp_fmt=None,
):
    d = fmt.dim
    win_rows = torch.randn(mw, d, generator=gen) * key_scale
    comp_rows = torch.randn(mc, d, generator=gen) * key_scale
    win_cache, win_slot, win_stored = _fill_cache(fmt, win_rows, gen)
    comp_cache, comp_slot, comp_stored = _fill_cache(comp_fmt or fmt, comp_rows, gen)
    wi = torch.randint(0, mw, (t, w), generator=gen)
    ci = torch.randint(0, mc, (t, k), generator=gen)
    wv = torch.rand(t, w, generator=gen) >= p_invalid
    cv = torch.rand(t, k, generator=gen) >= p_invalid
    for tok in empty_tokens:
        wv[tok] = False
        cv[tok] = False
    window_slots = torch.where(wv, win_slot[wi], -1).to(torch.int32)
    comp_slots = torch.where(cv, comp_slot[ci], -1).to(torch.int64)
    q = torch.randn(t, h, d, generator=gen).to(q_dtype)
    sink = torch.randn(h, generator=gen)
    valid = torch.cat([wv, cv], dim=1)

    def keys_from(wr, cr):
        return torch.cat([wr[wi], cr[ci]], dim=1)

    return dict(
        args=(q, win_cache, window_slots, comp_cache, comp_slots, fmt, sink, d**-0.5)
        + ((comp_fmt,) if comp_fmt is not None else ()),
        stored_keys=keys_from(win_stored, comp_stored),
        true_keys=keys_from(win_rows.double(), comp_rows.double()),
        valid=valid,
        q=q,
        sink=sink,
        scale=d**-0.5,
    )


def _oracle(case, keys="stored_keys", sink=None):
    return dense_attention_with_sink(
        case["q"], case[keys], case["valid"], case["sink"] if sink is None else sink, case["scale"]
    )


# -- tests ----------------------------------------------------------------------------------------
# (T, H, D, W, K): candidate counts W + K cross 4, 8, 128 and 256.
SHAPES = [
    (3, 2, 16, 3, 0),
    (4, 2, 16, 4, 1),
    (5, 3, 16, 8, 0),
    (5, 3, 16, 5, 4),
    (3, 2, 16, 127, 2),
    (2, 2, 16, 128, 128),
    (2, 2, 16, 128, 129),
    (4, 4, 512, 4, 4),
    (3, 8, 512, 8, 1),
    (3, 4, 512, 128, 0),
    (2, 4, 512, 128, 128),
    (2, 4, 512, 127, 130),
    (1, 6, 512, 128, 512),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,h,d,w,k", SHAPES)
def test_sparse_attention_matches_dense_oracle(backend, t, h, d, w, k, gen):
    fmt = ScaledF32Format(dim=d)
    case = _make_case(gen, fmt, t, h, w, k, mw=min(3 * (w + k) + 1, 300), mc=max(k, 1) * 2)
    out = impl(OP, backend)(*case["args"])
    assert out.shape == (t, h, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _oracle(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,tol", FORMATS)
@pytest.mark.parametrize("entries_per_page", [16, 64])
def test_sparse_attention_cache_formats(backend, name, tol, entries_per_page, gen):
    fmt = _format(name, entries_per_page)
    case = _make_case(gen, fmt, 3, 4, 128, 64, mw=130, mc=70, key_scale=3.0)
    out = impl(OP, backend)(*case["args"]).double()
    # Exact attention over the values the cache holds: checks the layout and the math.
    ref = _oracle(case)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # Against the unquantized keys: the format's error only.
    ideal = _oracle(case, keys="true_keys")
    err = float((out - ideal).abs().max() / ideal.abs().max())
    assert err <= tol, (name, err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_sparse_attention_query_dtypes(backend, q_dtype, gen):
    fmt = ScaledF32Format(dim=512)
    case = _make_case(gen, fmt, 3, 4, 128, 8, q_dtype=q_dtype)
    out = impl(OP, backend)(*case["args"])
    assert out.dtype == q_dtype
    ref = _oracle(case)  # exact math on the same (rounded) q values
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-6}[q_dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_sink_drives_output_to_zero(backend, gen):
    fmt = ScaledF32Format(dim=64)
    case = _make_case(gen, fmt, 4, 3, 16, 8, p_invalid=0.0)
    q, wc, ws, cc, cs, f, _, scale = case["args"]
    base = impl(OP, backend)(*case["args"])
    assert float(base.abs().max()) > 1e-2  # the candidates matter with a normal sink
    out = impl(OP, backend)(q, wc, ws, cc, cs, f, torch.full((3,), 1e4), scale)
    assert torch.isfinite(out).all() and float(out.abs().max()) < 1e-30
    # A large but finite sink shrinks the output by exactly the extra denominator mass.
    sink = torch.tensor([0.0, 8.0, -3.0])
    out = impl(OP, backend)(q, wc, ws, cc, cs, f, sink, scale)
    torch.testing.assert_close(out.double(), _oracle(case, sink=sink), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_sink_is_plain_softmax(backend, gen):
    fmt = ScaledF32Format(dim=32)
    case = _make_case(gen, fmt, 5, 2, 12, 6)
    q, wc, ws, cc, cs, f, _, scale = case["args"]
    out = impl(OP, backend)(q, wc, ws, cc, cs, f, torch.full((2,), float("-inf")), scale)
    keys, valid = case["stored_keys"], case["valid"]
    logits = torch.einsum("thd,tnd->thn", q.double(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    plain = torch.einsum("thn,tnd->thd", torch.softmax(logits, dim=-1), keys)
    plain = torch.nan_to_num(plain, nan=0.0)  # tokens without candidates -> 0
    torch.testing.assert_close(out.double(), plain, rtol=1e-5, atol=1e-6)
    # Every output row is then a convex combination: no mass lost to the sink.
    assert float(out.abs().max()) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_value", [0.0, float("-inf")])
def test_token_without_candidates_gets_zeros(backend, sink_value, gen):
    fmt = ScaledF32Format(dim=16)
    case = _make_case(gen, fmt, 5, 2, 6, 3, empty_tokens=(0, 3))
    q, wc, ws, cc, cs, f, _, scale = case["args"]
    sink = torch.full((2,), sink_value)
    out = impl(OP, backend)(q, wc, ws, cc, cs, f, sink, scale)
    assert torch.equal(out[[0, 3]], torch.zeros(2, 2, 16))
    torch.testing.assert_close(out.double(), _oracle(case, sink=sink), rtol=1e-5, atol=1e-6)
    assert float(out[[1, 2, 4]].abs().max()) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_only(backend, gen):
    fmt = ScaledF32Format(dim=64)
    case = _make_case(gen, fmt, 4, 2, 10, 0)
    q, wc, ws, _, _, f, sink, scale = case["args"]
    ref = _oracle(case)
    for comp_cache, comp_slots in ((None, None), (wc, torch.zeros(4, 0, dtype=torch.int32))):
        out = impl(OP, backend)(q, wc, ws, comp_cache, comp_slots, f, sink, scale)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_candidates_are_not_deduplicated(backend, gen):
    # The same entry listed in the window and the compressed lists counts twice.
    fmt = ScaledF32Format(dim=32)
    rows = torch.randn(3, 32, generator=gen)
    rows[1] = -rows[0] + 0.1 * rows[1]  # k_1 far from k_0: counting k_0 twice moves the output
    cache, slot, stored = _fill_cache(fmt, rows, gen)
    q = torch.randn(1, 1, 32, generator=gen) * 0.1  # near-uniform weights
    ws = slot[[0, 1]].reshape(1, 2)
    cs = slot[[0]].reshape(1, 1)
    sink = torch.tensor([0.5])
    out = impl(OP, backend)(q, cache, ws, cache, cs, fmt, sink, 32**-0.5).double()
    keys = stored[[0, 1, 0]][None]
    twice = dense_attention_with_sink(q, keys, torch.ones(1, 3, dtype=torch.bool), sink, 32**-0.5)
    once = dense_attention_with_sink(
        q, keys[:, :2], torch.ones(1, 2, dtype=torch.bool), sink, 32**-0.5
    )
    torch.testing.assert_close(out, twice, rtol=1e-6, atol=1e-7)
    assert float((out - once).abs().max()) > 0.05 * float(rows[0].abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunking_over_tokens_gives_the_same_result(backend, gen, monkeypatch):
    fmt = ScaledF32Format(dim=64)
    case = _make_case(gen, fmt, 9, 3, 20, 12, empty_tokens=(4,))
    if backend == "reference":
        import vllm_dsv4_hw.ops.reference.sparse_attention as mod

        monkeypatch.setattr(mod, "_CHUNK_ELEMS", 1)  # one token per chunk
    out = impl(OP, backend)(*case["args"])
    torch.testing.assert_close(out.double(), _oracle(case), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    fmt = ScaledF32Format(dim=16)
    cache = fmt.new_cache(1)
    out = impl(OP, backend)(
        torch.zeros(0, 2, 16),
        cache,
        torch.zeros(0, 4, dtype=torch.int32),
        cache,
        torch.zeros(0, 2, dtype=torch.int32),
        fmt,
        torch.zeros(2),
        0.25,
    )
    assert out.shape == (0, 2, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,tol", [("fp32", 1e-5), ("fp8_ds_mla", 0.2)])
def test_compressed_cache_with_its_own_page_geometry(backend, name, tol, gen):
    """c128a pages hold 2 entries against the window's 64: the compressed cache has its own format."""
    fmt, comp_fmt = _format(name, 64), _format(name, 2)
    case = _make_case(gen, fmt, 3, 4, 128, 9, mw=130, mc=9, comp_fmt=comp_fmt)
    out = impl(OP, backend)(*case["args"]).double()
    torch.testing.assert_close(out, _oracle(case), rtol=1e-4, atol=1e-4)
    err = (out - _oracle(case, keys="true_keys")).abs().max() / _oracle(case).abs().max()
    assert err <= tol
