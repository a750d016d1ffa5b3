# SPDX-License-Identifier: Apache-2.0
"""Triton sparse_attention: the paths that the shared conformance test
(tests/ops/test_sparse_attention.py) does not reach on CPU. The interpreter never splits for
occupancy, so the split-K + combine path, launch chunking, head blocks that do not divide H, the
loop without prefetch, the poisoned-workspace check and the hardware e4m3 decode are forced here,
at small shapes, against the reference op.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.backends import impl  # noqa: E402
from vllm_dsv4_hw.kv_cache.formats import FP32Format, make_format  # noqa: E402
from vllm_dsv4_hw.kv_cache.paged import insert_rows  # noqa: E402
from vllm_dsv4_hw.numerics import e4m3_decode  # noqa: E402
from vllm_dsv4_hw.ops.api import SPARSE_ATTENTION  # noqa: E402
from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa  # noqa: E402
from vllm_dsv4_hw.ops.triton.sparse_attention import tiles as tiles  # noqa: E402

REF = impl(SPARSE_ATTENTION, "reference")


def _case(
    gen, fmt, t, h, w, k, *, p_invalid=0.25, q_dtype=torch.float32, empty=(), sink=None, pad=64
):
    """Random rows inserted at random slots of two paged caches (with page padding), random
    candidate lists with -1 holes."""
    d, e = fmt.dim, fmt.entries_per_page
    caches, slot_lists = [], []
    for n_cand in (w, k):
        rows = max(2 * n_cand, 4)
        pages = (rows + e - 1) // e + 2
        cache = torch.randint(
            0, 256, (pages, fmt.min_page_bytes + pad), generator=gen, dtype=torch.uint8
        )
        slots = torch.randperm(pages * e, generator=gen)[:rows]
        insert_rows(cache, slots, torch.randn(rows, d, generator=gen) * 2, fmt)
        pick = slots[torch.randint(0, rows, (t, n_cand), generator=gen)]
        keep = torch.rand(t, n_cand, generator=gen) >= p_invalid
        for tok in empty:
            keep[tok] = False
        caches.append(cache)
        slot_lists.append(torch.where(keep, pick, -1))
    q = (torch.randn(t, h, d, generator=gen) * 2).to(q_dtype)
    sink = torch.randn(h, generator=gen) if sink is None else sink
    return (
        q,
        caches[0],
        slot_lists[0].to(torch.int32),
        caches[1],
        slot_lists[1],
        fmt,
        sink,
        d**-0.5,
    )


def _check(args, out, tol=2e-5):
    ref = REF(*args)
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "bf16"])
def test_split_k_real_dims(name, gen):
    """D = 512 entries read in the kernel, forced split-K (several splits per token, one empty),
    poisoned workspace and output: every element read was written."""
    fmt = make_format(name, "main", 16)
    args = _case(gen, fmt, 3, 4, 24, 40, empty=(1,))
    out = torch.full((3, 4, 512), float("nan"))
    tsa.sparse_attention_triton(*args, out=out, num_splits=5, block_n=16, poison_workspace=True)
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros(4, 512))
    _check(args, out)
    # one pass, and the loop without the register prefetch of the next tile
    single = tsa.sparse_attention_triton(*args, num_splits=1, block_n=16, prefetch=False)
    torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5)


def test_long_decode_tiles(gen):
    """The tiles of decode batches over long candidate lists (``FP8_WIDE_TILES``: all 64 heads
    per program, 64- or 32-entry tiles, no register prefetch) in splits of 256 over lists crossing
    256 and 512 (the last split partial), one token without candidates; poisoned workspace and
    output."""
    from vllm_dsv4_hw.ops.triton.sparse_attention import launch as launch

    fmt = make_format("fp8_ds_mla", "main", 64)
    args = list(_case(gen, fmt, 3, 64, 128, 700, empty=(2,)))
    args[4] = args[4].to(torch.int32)  # as the model passes them: the single loop
    for tiles in (choice.tiles for choice in launch.FP8_WIDE_TILES):  # noqa: F402
        out = torch.full((3, 64, 512), float("nan"))
        tsa.sparse_attention_triton(
            *args, out=out, num_splits=-(-828 // 256), poison_workspace=True, **tiles
        )
        assert not out.isnan().any()
        assert torch.equal(out[2], torch.zeros(64, 512))
        _check(args, out)


@pytest.mark.parametrize("one_loop", [True, False])
def test_tail_of_unused_slots_not_walked(one_loop, gen):
    """Compressed lists as vLLM's graph-safe decode metadata sizes them (``--max-model-len``
    wide, the candidates first, -1 after; here also -1 holes before the last candidate) against
    the reference, and the walk that stops after each split's last candidate (``_visited_end``)
    against the one that visits every -1 tile: the same values, splits starting inside the
    window, in the candidates and past them, a token without candidates, lengths crossing 4, 8,
    128 and 256, poisoned workspace (splits that took nothing store no acc and none is read)
    and poisoned output."""
    fmt = make_format("fp8_ds_mla", "main", 16)
    t, w, width = 4, 32, 300
    args = list(_case(gen, fmt, t, 4, w, width, p_invalid=0.1, empty=(2,)))
    used = [int(n) for n in torch.randint(1, width, (t,), generator=gen)]
    used[0], used[1] = 5, 129  # short lists crossing 4 / 8 and 128
    col = torch.arange(width)
    args[4] = torch.where(col[None, :] < torch.tensor(used)[:, None], args[4], -1).to(torch.int32)
    outs = []
    for splits in (1, 3, 7):
        for trim in (True, False):
            out = torch.full((t, 4, 512), float("nan"))
            tsa.sparse_attention_triton(
                *args,
                out=out,
                num_splits=splits,
                block_n=16,
                one_loop=one_loop,
                trim=trim,
                poison_workspace=True,
            )
            assert not out.isnan().any()
            assert torch.equal(out[2], torch.zeros(4, 512))
            outs.append(out)
        assert torch.equal(outs[-2], outs[-1]), "trimmed walk differs from the full walk"
    _check(args, outs[0])
    # where a walk over [lo, hi) stops: just after the range's last candidate, the window
    # walked whole (an end at or before lo: nothing to walk)
    row = args[4][1]
    ranges = [(0, 16), (0, 48), (32, 64), (32, 160), (144, 176), (160, 332), (0, 332)]
    for (lo, hi), end in zip(ranges, _walk_ends(row, w, ranges)):
        cand = [w + j for j in range(max(lo, w) - w, hi - w) if row[j] >= 0]
        assert end == min(hi, max([min(hi, w)] + [c + 1 for c in cand])), (lo, hi, end)


@triton.jit
def _walk_end_kernel(row_ptr, lo_ptr, hi_ptr, out_ptr, W, TRIM: tl.constexpr):
    i = tl.program_id(0)
    tl.store(
        out_ptr + i, tsa._visited_end(row_ptr, tl.load(lo_ptr + i), tl.load(hi_ptr + i), W, TRIM)
    )


def _walk_ends(row, w, ranges):
    lo = torch.tensor([r[0] for r in ranges], dtype=torch.int32)
    hi = torch.tensor([r[1] for r in ranges], dtype=torch.int32)
    out = torch.empty(len(ranges), dtype=torch.int32)
    _walk_end_kernel[(len(ranges),)](row.contiguous(), lo, hi, out, w, TRIM=64)
    return out.tolist()


@pytest.mark.parametrize("prefetch", [True, False])
def test_one_loop_over_both_caches(prefetch, gen):
    """The single loop over window then compressed tiles (a window that is a multiple of the
    tile) against the reference and against one loop per cache: the same tiles in the same order,
    so the same bits, with splits that start inside the window, at its end and in the compressed
    list, and a token without candidates; poisoned workspace and output."""
    fmt = make_format("fp8_ds_mla", "main", 16)
    args = list(_case(gen, fmt, 3, 4, 32, 56, empty=(1,)))
    args[4] = args[4].to(torch.int32)
    assert tsa._one_loop(None, 32, 16, args[2], args[4])
    assert not tsa._one_loop(None, 24, 16, args[2], args[4])  # a partial window tile
    assert not tsa._one_loop(None, 32, 16, args[2], args[4].long())
    assert not tsa._one_loop(False, 32, 16, args[2], args[4])
    for splits in (1, 3, 6):
        outs = []
        for one_loop in (True, False):
            out = torch.full((3, 4, 512), float("nan"))
            tsa.sparse_attention_triton(
                *args,
                out=out,
                num_splits=splits,
                block_n=16,
                prefetch=prefetch,
                one_loop=one_loop,
                poison_workspace=True,
            )
            outs.append(out)
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0][1], torch.zeros(4, 512))
        _check(args, outs[0])
        assert torch.equal(outs[0], outs[1]), splits


@pytest.mark.parametrize("sink_value", [0.0, float("-inf"), 1e4])
def test_split_k_sinks_and_empty_tokens(sink_value, gen):
    fmt = FP32Format(dim=32, entries_per_page=8)
    args = _case(gen, fmt, 5, 3, 20, 30, empty=(0, 3), sink=torch.full((3,), sink_value))
    out = tsa.sparse_attention_triton(*args, num_splits=4, block_n=16, poison_workspace=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[[0, 3]], torch.zeros(2, 3, 32))
    _check(args, out, tol=1e-5)


def test_head_blocks_not_dividing_h_and_many_launches(gen):
    """H = 20 in blocks of 16, splits and token chunks of at most 7 programs per launch."""
    fmt = FP32Format(dim=64, entries_per_page=8)
    args = _case(gen, fmt, 4, 20, 10, 21)
    out = torch.full((4, 20, 64), float("nan"))
    tsa.sparse_attention_triton(
        *args, out=out, num_splits=2, block_h=16, block_n=16, max_grid=7, poison_workspace=True
    )
    _check(args, out)
    out1 = tsa.sparse_attention_triton(*args, block_h=16, max_grid=3)
    _check(args, out1)


def test_window_only_split_and_noncontiguous_q(gen):
    fmt = make_format("fp32", "main", 16)
    q, wc, ws, _, _, f, sink, scale = _case(gen, fmt, 3, 2, 40, 0)
    qs = torch.randn(3, 4, 512, generator=gen)[:, ::2]  # head stride 1024
    assert not qs.is_contiguous()
    for cc, cs in ((None, None), (wc, torch.zeros(3, 0, dtype=torch.int64))):
        out = tsa.sparse_attention_triton(
            qs, wc, ws, cc, cs, f, sink, scale, num_splits=3, block_n=16, poison_workspace=True
        )
        _check((qs, wc, ws, cc, cs, f, sink, scale), out)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_rounding(q_dtype, gen):
    """Outputs are the fp32 result rounded to nearest (the interpreter truncates bf16 on its own):
    at most one ulp (plus fp32 noise near zero) from the reference's fp32 -> q dtype cast."""
    fmt = make_format("fp8_ds_mla", "main", 16)
    args = _case(gen, fmt, 2, 3, 16, 16, q_dtype=q_dtype)
    mant = {torch.bfloat16: 7, torch.float16: 10}[q_dtype]
    ref = REF(*args).double()
    for splits in (1, 2):
        out = tsa.sparse_attention_triton(*args, num_splits=splits, block_n=16)
        assert out.dtype == q_dtype
        mag = torch.minimum(out.double().abs(), ref.abs()).clamp_min(2.0**-14)
        ulp = torch.exp2(torch.floor(torch.log2(mag)) - mant)
        # one ulp, plus fp32 accumulation noise where outputs cancel to near zero
        slack = 1e-5 * float(ref.abs().max())
        assert bool(((out.double() - ref).abs() <= ulp + slack).all())
        # most elements are bit-identical (only fp32 accumulation order differs)
        assert float((out.double() == ref).double().mean()) > 0.95


def _check_plan(t, hb, n, block_n, min_chunk, cores, max_chunk):
    s, c = tsa._plan_splits(t, hb, n, block_n, min_chunk, cores, None, max_chunk)
    assert s >= 1 and c % block_n == 0, (s, c)
    if n <= 0:
        return s, c
    assert s * c >= n and (s - 1) * c < n, (s, c)  # covers n, no empty split
    if max_chunk:
        assert c <= -(-max_chunk // block_n) * block_n, (s, c)
    base = t * hb
    if 2 * base <= cores and n > min_chunk:  # under half the device busy
        assert base * s >= cores or c <= 2 * -(-min_chunk // block_n) * block_n, (s, c)
    elif not max_chunk:
        assert s == 1, (s, c)  # a full device needs no split
    return s, c


def test_plan_splits():
    # The rules of _plan_splits (not its outputs): every candidate covered by non-empty splits of
    # whole tiles; at most max_chunk per program; an under-filled device split until it is full
    # or the splits are down to min_chunk; a full one not split beyond max_chunk.
    for cores in (132, 20):
        for block_n, min_chunk, max_chunk in ((32, 32, 256), (16, 64, None), (32, 32, None)):
            for t in (1, 2, 4, 32, 64):
                for hb in (1, 2, 4):
                    for n in (0, 1, 40, 128, 640, 8320):
                        _check_plan(t, hb, n, block_n, min_chunk, cores, max_chunk)
    # decode at V4-Flash shapes on a 132-SM GPU: one token splits, a big batch does not
    assert tsa._plan_splits(1, 2, 640, 32, 64, 132, None)[0] > 1
    assert tsa._plan_splits(64, 2, 640, 32, 64, 132, None) == (1, 640)
    # a forced split count is capped at one tile per split
    assert tsa._plan_splits(1, 1, 40, 16, 64, 132, 100) == (3, 16)


def test_launch_config_by_regime(monkeypatch):
    # Which tunables a CUDA call gets (sparse_attention_launch): decode-sized calls the decode
    # tiles with split-K; a full device no 256-candidate splits; prefill chunks and bf16 batches
    # their larger tiles, but only where the declared shared memory holds them.
    from vllm_dsv4_hw.ops.triton.sparse_attention import launch as launch

    monkeypatch.setattr(launch, "_interpreting", lambda: False)
    cuda = torch.device("cuda")
    base = launch.CONFIGS["cuda"]
    wide, narrow = (choice.tiles for choice in launch.FP8_WIDE_TILES)
    for smem in (227 * 1024, 163 * 1024):  # sm_90 / sm_100, sm_80
        monkeypatch.setattr(launch, "_shared_mem", lambda dev: smem)
        fp8_pre = launch._config(cuda, 4096, 64, "fp8_ds_mla", cores=132)
        assert fp8_pre == dict(base, max_chunk=2048, **(wide if smem > 163 * 1024 else narrow))
        assert launch._config(cuda, 1, 64, "fp8_ds_mla", cores=132) == base
        assert launch._config(cuda, 32, 64, "bf16", cores=132) == base  # 128 programs < 132
        b64 = launch._config(cuda, 64, 64, "fp8_ds_mla", cores=132)
        assert b64 == dict(base, max_chunk=2048)
        assert launch._config(cuda, 64, 64, "bf16", cores=132)["block_n"] == 64
        pre = launch._config(cuda, 4096, 64, "bf16", cores=132)
        assert (pre["block_h"], pre["num_warps"], pre["prefetch"]) == (64, 8, False)
    monkeypatch.setattr(launch, "_shared_mem", lambda dev: 99 * 1024)  # sm_86 / 89 / 120
    for t, fmt in ((4096, "bf16"), (4096, "fp8_ds_mla"), (64, "bf16")):
        assert launch._config(cuda, t, 64, fmt, cores=132) == dict(base, max_chunk=2048)
    # decode batches over long candidate lists: all heads per program in splits of 512 where
    # those fill 3/4 of the device, else of 256 where those fill half, where the shared memory
    # holds the tile
    monkeypatch.setattr(launch, "_shared_mem", lambda dev: 227 * 1024)

    def long(chunk, tiles=wide):
        return dict(base, **tiles, min_chunk=chunk, max_chunk=chunk)

    assert launch._config(cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=8320) == long(512)
    assert launch._config(cuda, 4, 64, "fp8_ds_mla", cores=132, n_cand=8320) == long(256)
    assert launch._config(cuda, 64, 64, "fp8_ds_mla", cores=132, n_cand=640) == long(512)
    assert launch._config(cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=640) == long(256)
    assert launch._config(cuda, 1, 64, "fp8_ds_mla", cores=132, n_cand=8320) == base  # 33
    assert launch._config(cuda, 4, 64, "fp8_ds_mla", cores=132, n_cand=640) == base  # 12
    assert launch._config(cuda, 32, 64, "bf16", cores=132, n_cand=8320) == base  # not swept
    assert launch._config(cuda, 32, 16, "fp8_ds_mla", cores=132, n_cand=8320) == base
    assert launch._config(cuda, 4096, 64, "fp8_ds_mla", cores=132, n_cand=640)["prefetch"] is False
    # fp32 queries (fp32 dots) take the 32-entry tile: the 64-entry one is sized for bf16 dots
    assert launch._config(
        cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=8320, bf16_dots=False
    ) == long(512, narrow)
    monkeypatch.setattr(launch, "_shared_mem", lambda dev: 163 * 1024)  # sm_80: the 32-entry tile
    assert launch._config(cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=8320) == long(512, narrow)
    # ... but not with fp32 dots (~200 KiB on every target): the device kind's tiles, for long
    # decode lists, prefill chunks and bf16 batches alike (H100 with sm_80 declared recorded
    # them, 2026-12-05; the AOT compile for sm_80 needs 205,056 B of its 163 KiB)
    assert (
        launch._config(cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=8320, bf16_dots=False) == base
    )
    for t, fmt in ((4096, "bf16"), (4096, "fp8_ds_mla"), (64, "bf16")):
        assert launch._config(cuda, t, 64, fmt, cores=132, bf16_dots=False) == dict(
            base, max_chunk=2048
        )
    monkeypatch.setattr(launch, "_shared_mem", lambda dev: 227 * 1024)
    assert launch._config(cuda, 64, 64, "bf16", cores=132, bf16_dots=False)["block_n"] == 64
    assert launch._config(cuda, 4096, 64, "fp8_ds_mla", cores=132, bf16_dots=False)["block_n"] == 32
    monkeypatch.setattr(launch, "_shared_mem", lambda dev: 99 * 1024)
    assert launch._config(cuda, 32, 64, "fp8_ds_mla", cores=132, n_cand=8320) == base
    assert tsa._plan_splits(32, 1, 8320, 32, 512, 132, None, 512) == (17, 512)
    assert tsa._plan_splits(4, 1, 8320, 32, 256, 132, None, 256) == (33, 256)
    # a 640-candidate list is one split on a full device, an 8K one (c128a at 1M) still splits
    assert tsa._plan_splits(64, 4, 640, 32, 32, 132, None, 2048) == (1, 640)
    assert tsa._plan_splits(64, 4, 8320, 32, 32, 132, None, 2048)[0] == 5


def test_shared_memory_capability():
    from vllm_dsv4_hw.platform.capabilities import cuda_capabilities

    kib = 1024
    assert cuda_capabilities(8, 0).shared_mem == 163 * kib
    assert cuda_capabilities(8, 6).shared_mem == cuda_capabilities(8, 9).shared_mem == 99 * kib
    assert cuda_capabilities(9, 0).shared_mem == cuda_capabilities(10, 0).shared_mem == 227 * kib
    assert cuda_capabilities(12, 0).shared_mem == 99 * kib
    assert cuda_capabilities(9, 4, hip=True).shared_mem == 64 * kib  # MI300 answers 9.4


@triton.jit
def _decode_kernel(code_ptr, out_ptr, CVT: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, tiles._e4m3_to_f32(tl.load(code_ptr + i), CVT))


# integer decode and hardware cvt (the packed PTX decode needs a GPU: tests/ops/test_ptx_e4m3_decode)
@pytest.mark.parametrize("cvt", [0, 1])
def test_e4m3_decode_paths(cvt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](codes, out, CVT=cvt)
    ref = e4m3_decode(codes)
    finite = ~ref.isnan()  # 0x7F / 0xFF: never written by the encoder
    assert torch.equal(out[finite], ref[finite])
