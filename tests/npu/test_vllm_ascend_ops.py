# SPDX-License-Identifier: Apache-2.0
"""The npu backend with vllm-ascend's DeepSeek V4 operators loaded (the stubs in tests/stubs).

The stubs are registered as ``torch.ops._C_ascend`` with vllm-ascend's schemas, so the backend's
real detection path finds them; each test asserts which operator ran and checks the result
against the float64 oracles. This checks our composition against the operators' documented /
read semantics, not Ascend hardware.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.backends import impl
from tests.npu.insert_case import assert_npu_insert_matches_paged
from tests.oracles import dense_attention_with_sink, rope_oracle
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.npu import disabled_ops, sas
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin, rope_inv_freq
from vllm_dsv4_hw.platform import npu as npu_platform

SAS, META = "npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata"
FIA = "npu_fused_infer_attention_score"


def _fill(gen, fmt, rows, pages, pad=0):
    cache = fmt.new_cache(pages, page_bytes=fmt.min_page_bytes + pad).fill_(0xFF)
    slots = torch.randperm(pages * fmt.entries_per_page, generator=gen)[: rows.shape[0]]
    paged.insert_rows(cache, slots, rows, fmt)
    return cache, slots, paged.gather_rows(cache, slots, fmt).double()


def _scattered(gen, counts, width, pool):
    """[T, width] indices into ``pool`` rows, ``counts[t]`` valid (distinct) at random columns."""
    idx = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in counts])
    valid = torch.stack([torch.randperm(width, generator=gen) < c for c in counts])
    return idx, valid


def _positional_case(gen, positions, h, k, ratio, fmt_name="bf16", comp=True):
    """Candidates as a real layer has them at ``positions`` (min(t+1, 128) window rows, at most
    min(k, (t+1)//ratio) compressed ones), valid slots scattered among -1s."""
    d, w = 512, 128
    pos = torch.tensor(positions)
    wf, cf = make_format(fmt_name, "main", 64), make_format(fmt_name, "main", 2)
    wc, wslot, wst = _fill(gen, wf, torch.randn(w + 8, d, generator=gen) * 2, (w + 8) // 64 + 2)
    wi, wv = _scattered(gen, (pos + 1).clamp(max=w).tolist(), w, w + 8)
    ws = torch.where(wv, wslot[wi], -1)
    q = torch.randn(len(positions), h, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    if not comp:
        return (q, wc, ws, None, None, wf, sink, d**-0.5, None), wst[wi], wv
    cc, cslot, cst = _fill(
        gen, cf, torch.randn(k + 4, d, generator=gen) * 2, (k + 4) // 2 + 2, pad=24
    )
    ci, cv = _scattered(gen, ((pos + 1) // ratio).clamp(max=k).tolist(), k, k + 4)
    cs = torch.where(cv, cslot[ci], -1)
    keys = torch.cat([wst[wi], cst[ci]], dim=1)
    return (q, wc, ws, cc, cs, wf, sink, d**-0.5, cf), keys, torch.cat([wv, cv], dim=1)


def _close(out, args, keys, valid):
    ref = dense_attention_with_sink(args[0], keys, valid, args[6], args[7])
    torch.testing.assert_close(
        out.double(), ref, rtol=2e-2, atol=2e-2 * max(float(ref.abs().max()), 1e-6)
    )


def test_detection_finds_the_stub_ops_only_when_switched_on(stub):
    import vllm_ascend_ops_stub

    with vllm_ascend_ops_stub.active(False):
        assert npu_platform.vllm_ascend_ops() == {}
    with vllm_ascend_ops_stub.active(True):
        found = npu_platform.vllm_ascend_ops()
        assert set(found) == set(npu_platform.VLLM_ASCEND_OPS)
        assert npu_platform.vllm_ascend_installed() is False  # the marker is not an install


@pytest.mark.parametrize(
    "positions,h,k,ratio",
    [
        ((0, 5, 126, 127, 300, 2047, 5000, 9000), 64, 512, 4),  # c4a: partial and full windows
        ((127, 1000, 4095, 8191), 128, 64, 128),  # c128a: every visible entry, two head groups
    ],
)
def test_sparse_attention_through_sparse_attn_sharedkv(
    ascend_ops, stub, gen, positions, h, k, ratio
):
    args, keys, valid = _positional_case(gen, positions, h, k, ratio)
    out = impl(api.SPARSE_ATTENTION, "npu")(*args)
    calls = stub._control.calls
    assert calls[SAS] == h // 64 and calls[META] == 1 and calls[FIA] == 0
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16
    _close(out, args, keys, valid)


def test_window_only_and_fp8_cache_through_sparse_attn_sharedkv(ascend_ops, stub, gen):
    args, keys, valid = _positional_case(gen, (0, 3, 200), 64, 0, 4, comp=False)
    _close(impl(api.SPARSE_ATTENTION, "npu")(*args), args, keys, valid)
    args, keys, valid = _positional_case(gen, (40, 700), 64, 512, 4, fmt_name="fp8")
    _close(impl(api.SPARSE_ATTENTION, "npu")(*args), args, keys, valid)
    assert stub._control.calls[SAS] == 2 and stub._control.calls[FIA] == 0


def test_tokens_without_candidates_are_zero_and_left_out(ascend_ops, stub, gen):
    args, keys, valid = _positional_case(gen, (10, 600, 3), 64, 512, 4)
    a = list(args)
    a[2], a[4] = args[2].clone(), args[4].clone()
    a[2][1], a[4][1] = -1, -1
    valid = valid.clone()
    valid[1] = False
    out = impl(api.SPARSE_ATTENTION, "npu")(*a)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _close(out, a, keys, valid)
    assert stub._control.calls[SAS] == 1


@pytest.mark.parametrize("why", ["heads", "too_many_compressed"])
def test_calls_the_operator_cannot_express_take_the_torch_npu_path(ascend_ops, stub, gen, why):
    if why == "heads":  # the operator takes exactly 64 query heads
        args, keys, valid = _positional_case(gen, (300, 900), 16, 64, 4)
    else:  # 300 compressed rows but only 100 window rows: more than (t + 1) // 4 below a window
        args, keys, valid = _positional_case(gen, (99, 2000), 64, 300, 4)
        a = list(args)
        a[4] = args[4].clone()
        a[4][0] = a[4][1]  # token 0 gets token 1's 300 compressed entries
        args = tuple(a)
        keys, valid = keys.clone(), valid.clone()
        keys[0, 128:], valid[0, 128:] = keys[1, 128:], valid[1, 128:]
    out = impl(api.SPARSE_ATTENTION, "npu")(*args)
    assert stub._control.calls[SAS] == 0 and stub._control.calls[FIA] > 0
    _close(out, args, keys, valid)


def test_a_failing_sparse_attn_sharedkv_falls_back_once_with_a_warning(
    ascend_ops, stub, gen, caplog
):
    stub._control.fail(SAS, RuntimeError("aclnn error 561103"))
    args, keys, valid = _positional_case(gen, (130, 2000), 64, 512, 4)
    with caplog.at_level(logging.WARNING, logger="vllm_dsv4_hw"):
        out = impl(api.SPARSE_ATTENTION, "npu")(*args)
    _close(out, args, keys, valid)  # the failed call is served by the reference
    assert "sparse_attention" in disabled_ops()
    assert sum(SAS in r.getMessage() for r in caplog.records) == 1


def test_the_stub_enforces_the_documented_constraints(ascend_ops):
    ops = torch.ops._C_ascend
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(2, 128, 1, 512, dtype=torch.bfloat16)
    common = dict(
        ori_kv=kv,
        ori_block_table=torch.zeros(2, 1, dtype=torch.int32),
        cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        seqused_kv=torch.tensor([5, 9], dtype=torch.int32),
        sinks=torch.zeros(64),
        softmax_scale=0.04,
        ori_win_left=127,
        layout_q="TND",
    )
    meta = ops.npu_sparse_attn_sharedkv_metadata(
        64,
        1,
        512,
        batch_size=2,
        max_seqlen_kv=9,
        cmp_ratio=1,
        ori_win_left=127,
        has_cmp_kv=False,
        layout_q="TND",
    )
    out, _ = ops.npu_sparse_attn_sharedkv(q, metadata=meta, **common)
    assert out.shape == q.shape
    with pytest.raises(RuntimeError, match="64"):  # N1 only 64
        ops.npu_sparse_attn_sharedkv(q[:, :32].contiguous(), metadata=meta, **common)
    with pytest.raises(RuntimeError, match="ori_win_left"):  # the schema default (128) is refused
        ops.npu_sparse_attn_sharedkv(q, metadata=meta, **{**common, "ori_win_left": 128})
    other = ops.npu_sparse_attn_sharedkv_metadata(
        64, 1, 512, batch_size=3, max_seqlen_kv=9, ori_win_left=127, has_cmp_kv=False
    )
    with pytest.raises(RuntimeError, match="another call"):
        ops.npu_sparse_attn_sharedkv(q, metadata=other, **common)
    var = torch.zeros(2, 4, 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.npu_scatter_nd_update_v2(
            var, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 8, dtype=torch.uint8)
        )


def test_kv_insert_through_scatter_nd_update_v2(ascend_ops, stub, gen):
    assert_npu_insert_matches_paged(gen)
    calls = stub._control.calls
    assert calls["npu_scatter_nd_update_v2"] == 2 and calls["npu_scatter_nd_update_"] == 0


def test_rope_through_the_registered_partial_rotary_op(ascend_ops, stub, gen):
    tab = rope_cos_sin(160000.0, 64, 4096)
    x = torch.randn(5, 3, 512, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (5,), generator=gen)
    for inverse in (False, True):
        out = impl(api.ROPE, "npu")(x, pos, tab, inverse)
        ref = rope_oracle(x, pos, rope_inv_freq(160000.0, 64), inverse)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-2)
        assert torch.equal(out[..., :448], x[..., :448])
    calls = stub._control.calls
    assert calls["inplace_partial_rotary_mul"] == 2 and calls["npu_rotary_mul"] == 0


def test_seq_lengths_express_exactly_the_gathered_rows():
    n_w = torch.tensor([1, 100, 128, 128, 128])
    n_c = torch.tensor([0, 25, 0, 100, 512])
    s = sas.seq_lengths(n_w, n_c)
    assert s.tolist() == [1, 100, 128, 512, 2048]
    assert bool(((s // 4) >= n_c).all()) and bool((s.clamp(max=128) == n_w).all())
    assert sas.seq_lengths(torch.tensor([100]), torch.tensor([26])) is None  # 26 > 100 // 4
    assert sas.seq_lengths(torch.tensor([129]), None) is None
    assert sas.seq_lengths(torch.tensor([0]), torch.tensor([3])) is None


# -- mHC through npu_hc_pre_v2 / npu_hc_post ------------------------------------------------------
HC_PRE_OP, HC_POST_OP = "npu_hc_pre_v2", "npu_hc_post"


def _mhc_case(gen, t, d):
    from tests.ops.test_mhc import _inputs

    h, fn, scale, base, w = _inputs(gen, t, 4, d, torch.bfloat16)
    y = (torch.randn(t, d, generator=gen) * 3).to(torch.float32)  # the MoE's fp32 sum
    post = torch.rand(t, 4, generator=gen) * 2
    comb = torch.rand(t, 4, 4, generator=gen)
    return h, fn, scale, base, w, y, post, comb


@pytest.mark.parametrize("d", [4096, 7168])
def test_mhc_seam_through_hc_pre_v2_and_hc_post(ascend_ops, stub, gen, d):
    """The seam on the vendor operators (+ npu_rms_norm for the sub-block's norm) against the
    float64 oracles of tests/ops/test_mhc.py, under that file's bf16 budget."""
    from tests.ops.test_mhc import EPS, HC_EPS, _close, _oracle_post, _oracle_pre

    h, fn, scale, base, w, y, post, comb = _mhc_case(gen, 3, d)
    h2, x, post2, comb2 = impl(api.HC_SEAM, "npu")(
        y, h, post, comb, fn, scale, base, w, 20, HC_EPS, EPS
    )
    calls = stub._control.calls
    assert calls[HC_POST_OP] == 1 and calls[HC_PRE_OP] == 1 and calls["npu_rms_norm"] == 1
    _close(h2, _oracle_post(y, h, post, comb), torch.bfloat16, "h2")
    for got, ref, what in zip(
        (x, post2, comb2), _oracle_pre(h2, fn, scale, base, w, 20), ("x", "post", "comb")
    ):
        _close(got, ref, torch.bfloat16 if what == "x" else torch.float32, what)
    assert x.dtype == h2.dtype == torch.bfloat16 and post2.dtype == comb2.dtype == torch.float32


def test_mhc_pre_and_post_alone_and_the_shapes_the_operators_refuse(ascend_ops, stub, gen):
    """hc_pre / hc_post each one vendor call at a model's D; other D (and fp32 streams) run the
    reference without touching the operators."""
    from tests.ops.test_mhc import EPS, HC_EPS, _close, _oracle_post, _oracle_pre

    h, fn, scale, base, w, y, post, comb = _mhc_case(gen, 2, 4096)
    x, p2, c2 = impl(api.HC_PRE, "npu")(h, fn, scale, base, w, 20, HC_EPS, EPS)
    for got, ref, what in zip(
        (x, p2, c2), _oracle_pre(h, fn, scale, base, w, 20), ("x", "post", "comb")
    ):
        _close(got, ref, torch.bfloat16 if what == "x" else torch.float32, what)
    out = impl(api.HC_POST, "npu")(y, h, post, comb)
    _close(out, _oracle_post(y, h, post, comb), torch.bfloat16, "streams")
    calls = stub._control.calls
    assert calls[HC_PRE_OP] == 1 and calls[HC_POST_OP] == 1
    for d, dtype in ((256, torch.bfloat16), (4096, torch.float32)):
        h, fn, scale, base, w, y, post, comb = _mhc_case(gen, 2, d)
        h = h.to(dtype)
        impl(api.HC_PRE, "npu")(h, fn, scale, base, w.to(dtype), 20, HC_EPS, EPS)
        impl(api.HC_POST, "npu")(y, h, post, comb)
    assert calls[HC_PRE_OP] == 1 and calls[HC_POST_OP] == 1


def test_mhc_operator_failure_falls_back_once_with_a_warning(ascend_ops, stub, gen, caplog):
    from tests.ops.test_mhc import _close, _oracle_post

    h, fn, scale, base, w, y, post, comb = _mhc_case(gen, 2, 4096)
    stub._control.fail(HC_POST_OP, RuntimeError("aclnn error 561103"))
    with caplog.at_level(logging.WARNING):
        out = impl(api.HC_POST, "npu")(y, h, post, comb)
        again = impl(api.HC_POST, "npu")(y, h, post, comb)
    _close(out, _oracle_post(y, h, post, comb), torch.bfloat16, "streams")
    assert torch.equal(out, again) and stub._control.calls[HC_POST_OP] == 1
    assert sum("npu_hc_post" in r.getMessage() for r in caplog.records) == 1
    assert api.HC_POST in disabled_ops()
