# SPDX-License-Identifier: Apache-2.0
"""fp8_block_linear conformance (every CPU-runnable backend) against an explicit block-by-block
float64 oracle written here, on fresh random inputs: plain and grouped weights, M = 0 .. 300, N and
K that are not multiples of the block, blocks 128x128 (V4) and 32x32 (V4.1), bf16 / fp16 / fp32 /
float64 x, both ends of the ue8m0 range, float8 and uint8 views of weight and scale. Also: argument
errors, the reference's bounded extra memory (a subprocess measuring its peak RSS), the Triton
backend's forced split-K and launch heuristics (moved here from the old W8A16 benchmark test), and
an ahead-of-time compile of the Triton kernels for sm_90 (hardware e4m3 conversion) and sm_80
(integer decode).

Tolerance (a rigorous bound, so no seed can fail it): every product x * e4m3 * 2^e is exact in the
accumulation dtype, so the only errors are the accumulation and the one rounding to the output:
``|got - want| <= 2^-p |want| + (K + K/bk + 4) u A``, where ``2^-p`` is half an ulp of the output
dtype (bf16 2^-8, fp16 2^-11, fp32 2^-24, float64 2^-53), ``u`` the unit roundoff of the
accumulation (fp32 2^-24; float64 2^-53) and ``A = sum_k |x| |e4m3| s``: the oracle run on
absolute values (the scale of any summation's error, whatever its order or split).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.subprocess_scripts import HAS_PTXAS, compile_results, memory_mib
from vllm_dsv4_hw.ops.api import FP8_BLOCK_LINEAR
from vllm_dsv4_hw.quant.formats import quantize_fp8_block

BACKENDS = cpu_backends(FP8_BLOCK_LINEAR)
_HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
             torch.float64: 2.0 ** -53}


# -- oracle and inputs -----------------------------------------------------------------------------
def _e4m3(wb: torch.Tensor) -> torch.Tensor:
    return wb.view(torch.uint8).view(torch.float8_e4m3fn).double()


def _ue8m0(sb: torch.Tensor) -> torch.Tensor:
    e = sb.view(torch.uint8).to(torch.int64) - 127
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)  # exact 2^(byte - 127)


def oracle(x: torch.Tensor, wb: torch.Tensor, sb: torch.Tensor, block) -> torch.Tensor:
    """y[m, (g,) n] = sum_kb s[(g,) n // bn, kb] * sum_{k in kb} x[m, (g,) k] * e4m3(w[(g,) n, k])
    in float64, one (row block, column block) pair at a time."""
    bn, bk = block
    grouped = x.dim() == 3
    xs = x.double() if grouped else x.double()[:, None]
    w = _e4m3(wb) if grouped else _e4m3(wb)[None]
    s = _ue8m0(sb) if grouped else _ue8m0(sb)[None]
    m, g, k = xs.shape
    n = w.shape[1]
    y = torch.zeros(m, g, n, dtype=torch.float64)
    for gi in range(g):
        for i in range(s.shape[1]):
            ns = slice(i * bn, min(n, (i + 1) * bn))
            for j in range(s.shape[2]):
                ks = slice(j * bk, min(k, (j + 1) * bk))
                y[:, gi, ns] += s[gi, i, j] * (xs[:, gi, ks] @ w[gi, ns, ks].t())
    return y if grouped else y[:, 0]


def error_ratio(got: torch.Tensor, x, wb, sb, block, out_dtype=None) -> tuple[float, torch.Tensor]:
    """(largest error of ``got`` over its rigorous bound, the float64 oracle)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    want = oracle(x, wb, sb, block)
    assert got.shape == want.shape and got.dtype == out_dtype, (got.shape, got.dtype)
    assert torch.isfinite(got).all()
    # A: the same sum on absolute values (e4m3 sign bit cleared)
    a = oracle(x.abs(), wb.view(torch.uint8) & 0x7F, sb, block)
    k = x.shape[-1]
    u = 2.0 ** -53 if x.dtype == torch.float64 else 2.0 ** -24
    # + half the smallest subnormal: outputs below the normal range round absolutely
    bound = (_HALF_ULP[out_dtype] * want.abs() + (k + k // block[1] + 4) * u * a
             + torch.finfo(out_dtype).smallest_normal * _HALF_ULP[out_dtype] + 1e-300)
    err = (got.double() - want).abs()
    return (float((err / bound).max()) if err.numel() else 0.0), want


def assert_close(got: torch.Tensor, x, wb, sb, block, out_dtype=None) -> torch.Tensor:
    worst, want = error_ratio(got, x, wb, sb, block, out_dtype)
    assert worst <= 1.0, f"error {worst:.3g} x the bound"
    return want


def rand_weight(gen, shape, block, lo=0, hi=254, fp8_views=True):
    """Random e4m3 bytes (every finite code, NaNs replaced by 0) [*, N, K] and ue8m0 bytes in
    [lo, hi] [*, ceil(N/bn), ceil(K/bk)], as float8 tensors or as raw uint8."""
    *lead, n, k = shape
    wb = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    wb[(wb & 0x7F) == 0x7F] = 0
    sshape = (*lead, -(-n // block[0]), -(-k // block[1]))
    sb = torch.randint(lo, hi + 1, sshape, generator=gen, dtype=torch.uint8)
    if fp8_views:
        return wb.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu)
    return wb, sb


def quantized_weight(gen, shape, block):
    """A realistic weight: N(0, 1/K) quantized with the checkpoint's recipe (square blocks)."""
    *lead, n, k = shape
    w = torch.randn(*lead, n, k, generator=gen) * k ** -0.5
    if not lead:
        return quantize_fp8_block(w, block[0])
    qs = [quantize_fp8_block(wi, block[0]) for wi in w]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def rand_x(gen, m, g, k, dtype, scale=1.0):
    shape = (m, g, k) if g else (m, k)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# -- conformance -----------------------------------------------------------------------------------
SHAPES = [  # m, n, k, g (None = plain), block
    (1, 256, 384, None, (128, 128)),    # decode
    (3, 200, 300, None, (128, 128)),    # ragged N and K
    (5, 64, 256, 3, (128, 128)),        # grouped (wo_a form)
    (17, 100, 150, 2, (32, 32)),        # grouped, V4.1 blocks, ragged
    (70, 130, 200, None, (32, 32)),     # two M tiles, ragged
    (300, 40, 48, None, (32, 32)),      # a prefill-like M, ragged K block
    (0, 64, 128, None, (128, 128)),     # empty batch
    (0, 40, 50, 3, (32, 32)),           # empty batch, grouped
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,g,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_oracle(backend, m, n, k, g, block, dtype, gen):
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = rand_x(gen, m, g, k, dtype)
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block)
    assert got.shape == ((m, g, n) if g else (m, n))
    assert_close(got, x, wq, sc, block)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_dtype,out_dtype", [
    (torch.float16, None),
    (torch.float64, None),
    (torch.bfloat16, torch.float32),    # fp32 out: no bf16 rounding of the result
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.float32),
])
def test_dtypes(backend, x_dtype, out_dtype, gen):
    block = (32, 32)
    wq, sc = rand_weight(gen, (2, 72, 100), block, lo=118, hi=124)
    x = rand_x(gen, 3, 2, 100, x_dtype)
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block, out_dtype)
    assert_close(got, x, wq, sc, block, out_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lo,hi,x_scale", [
    (0, 3, 1.0),                # scales 2^-127 .. 2^-124 (byte 0: the fp32 subnormal 2^-127)
    (251, 254, 2.0 ** -120),    # scales 2^124 .. 2^127 (e4m3 * 2^127 would overflow fp32)
])
@pytest.mark.parametrize("block,g", [((128, 128), None), ((32, 32), 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ue8m0_range_ends(backend, lo, hi, x_scale, block, g, dtype, gen):
    m, n, k = 3, 150, 200
    wq, sc = rand_weight(gen, ((g,) if g else ()) + (n, k), block, lo, hi,
                         fp8_views=bool(lo))  # raw uint8 bytes at one end, float8 at the other
    x = rand_x(gen, m, g, k, dtype, x_scale)
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block)
    want = assert_close(got, x, wq, sc, block)
    assert want.abs().max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_spread_without_underflow(backend, dtype, gen):
    """Scales 254 binades apart within one row block: the first K block of every row block has
    scale 2^127 but x is zero there; the others have 2^-127 .. 2^-87. The result (~2^-80 and
    below) is representable; a tile dequantized relative to the row block's largest scale alone
    (s / c = 2^-254) would underflow to zero in fp32."""
    block = (32, 32)
    m, n, k = 4, 96, 256
    wq, sc = rand_weight(gen, (n, k), block, 0, 40)
    sc = sc.view(torch.uint8).clone()
    sc[:, 0] = 254
    x = rand_x(gen, m, None, k, dtype)
    x[:, :32] = 0
    got = impl(FP8_BLOCK_LINEAR, backend)(x, wq, sc, block)
    want = assert_close(got, x, wq, sc, block)
    assert (want != 0).all() and (got != 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_agree(backend, gen):
    """float8 and uint8 views of weight and scale give identical results."""
    block = (128, 128)
    wq, sc = quantized_weight(gen, (160, 300), block)
    x = rand_x(gen, 2, None, 300, torch.bfloat16)
    fn = impl(FP8_BLOCK_LINEAR, backend)
    outs = [fn(x, w, s, block) for w in (wq, wq.view(torch.uint8))
            for s in (sc, sc.view(torch.uint8))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert_close(outs[0], x, wq, sc, block)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    fn = impl(FP8_BLOCK_LINEAR, backend)
    x = torch.zeros(2, 300, dtype=torch.bfloat16)
    w = torch.zeros(200, 300, dtype=torch.uint8)
    s = torch.zeros(2, 3, dtype=torch.uint8)
    fn(x, w, s, (128, 128))  # the valid call
    with pytest.raises(ValueError, match=r"weight must be \[N, K=300\].*got \(200, 299\)"):
        fn(x, w[:, :299], s, (128, 128))
    with pytest.raises(ValueError, match=r"scale must be \[2, 3\].*got \(2, 2\)"):
        fn(x, w, s[:, :2], (128, 128))
    with pytest.raises(ValueError, match=r"scale must be \[7, 10\].*got \(2, 3\)"):
        fn(x, w, s, (32, 32))
    with pytest.raises(ValueError, match=r"weight must be \[G=2, N, K=300\].*got \(200, 300\)"):
        fn(x.view(1, 2, 300), w, s, (128, 128))
    with pytest.raises(ValueError, match=r"weight must be .*float8_e4m3fn.*got torch.int8"):
        fn(x, w.view(torch.int8), s, (128, 128))
    with pytest.raises(ValueError, match=r"scale must be .*float8_e8m0fnu.*got torch.float32"):
        fn(x, w, s.float(), (128, 128))
    with pytest.raises(ValueError, match=r"x must be \[M, K\] or \[M, G, K\]"):
        fn(x[0], w, s, (128, 128))


# -- the reference's bounded memory ----------------------------------------------------------------
_MEM_SCRIPT = r'''
import torch
from vllm_dsv4_hw.ops.reference.linear import fp8_block_linear

def peak_mib():
    # VmHWM: this process's own peak (ru_maxrss keeps the parent's peak across fork + exec)
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024

torch.manual_seed(0)
n = k = 8192
w = torch.randint(0, 256, (n, k), dtype=torch.uint8)  # 64 MiB of e4m3, made in place
w.bitwise_and_(0xBF)                                    # no NaN codes (exponent < 8)
s = torch.randint(120, 128, (n // 128, k // 128), dtype=torch.uint8)
x = torch.randn(2, k).to(torch.bfloat16)
fp8_block_linear(x[:, :256], w[:256, :256], s[:2, :2], (128, 128))  # load the math libraries
before = peak_mib()
y = fp8_block_linear(x, w, s, (128, 128))
after = peak_mib()
assert y.shape == (2, n) and bool(torch.isfinite(y).all())
whole = w.view(torch.float8_e4m3fn).float()  # what a whole dequantized copy costs: 256 MiB
print("MEM", before, after, peak_mib())
'''


def test_reference_memory_is_bounded():
    before, after, copy = memory_mib(_MEM_SCRIPT)
    # a bf16 copy of the weight would be 128 MiB, fp32 256 MiB; the reference holds one 16 MiB tile
    assert after - before < 48, (before, after)
    assert copy - after > 200, (after, copy)  # the measurement does see a whole copy


# -- Triton: split-K and launch heuristics (the old benchmark W8A16 test) --------------------------
triton_only = pytest.mark.skipif("triton" not in BACKENDS, reason="no triton backend here")


@triton_only
@pytest.mark.parametrize("m,n,k,g,split", [
    (1, 200, 300, None, 3),       # ragged N and K, forced 3-way split
    (1, 128, 256, None, 2),       # 2-way split
    (5, 96, 384, 2, 2),           # grouped, odd M, split
    (4, 192, 256, None, 5),       # more splits than K blocks: clamped
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_split_k(m, n, k, g, split, dtype, gen):
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    block = (128, 128)
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = rand_x(gen, m, g, k, dtype)
    got = fp8_block_linear(x, wq, sc, block, split_k=split)
    assert_close(got, x, wq, sc, block)


@triton_only
@pytest.mark.parametrize("m,n,k,g,split", [
    (1, 200, 300, None, 3),       # ragged, the last split shorter
    (5, 96, 384, 2, 2),           # grouped, several row / column tiles
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_serial_split_k_same_bits(m, n, k, g, split, dtype, gen):
    """The split-K partials summed by each tile's last split inside the launch give the bits of
    the separate sum launch, against the oracle too, and leave the arrival counters zeroed (the
    next launch on the stream reuses them)."""
    from vllm_dsv4_hw.ops.triton.common.counters import arrival_counters
    from vllm_dsv4_hw.ops.triton.linear import fp8_block_linear as fp8_op

    block = (128, 128)
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = rand_x(gen, m, g, k, dtype)
    serial = fp8_op.fp8_block_linear(x, wq, sc, block, split_k=split, block_n=32, serial=True)
    again = fp8_op.fp8_block_linear(x, wq, sc, block, split_k=split, block_n=32, serial=True)
    two = fp8_op.fp8_block_linear(x, wq, sc, block, split_k=split, block_n=32, serial=False)
    assert torch.equal(serial.view(torch.uint8), two.view(torch.uint8))
    assert torch.equal(again.view(torch.uint8), two.view(torch.uint8))
    assert_close(serial, x, wq, sc, block)
    assert not arrival_counters(x.device, 1).any()


@triton_only
@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("m,n,k,g,block,split", [
    (1, 200, 300, None, (128, 128), 1),     # decode, ragged N and K
    (70, 130, 200, None, (32, 32), 1),      # two M tiles, ragged, V4.1 blocks
    (5, 96, 384, 2, (128, 128), 2),         # grouped, split-K partials
    (17, 100, 150, 2, (32, 32), 3),         # grouped, ragged, more splits
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_folded_scale(fold, m, n, k, g, block, split, dtype, gen):
    """The scale folded into the weight tile (1) and the transposed product with the weight as
    the dot's A operand (2): same bound against the oracle (x * (e4m3 * 2^e) is the same exact
    product; only the summation order differs). Both ends of the scale range."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    wq, sc = rand_weight(gen, ((g,) if g else ()) + (n, k), block, lo=100, hi=150)
    x = rand_x(gen, m, g, k, dtype)
    got = fp8_block_linear(x, wq, sc, block, split_k=split, fold=fold,
                           block_m=16 if m < 32 else 32, block_n=32)
    assert_close(got, x, wq, sc, block)


@triton_only
@pytest.mark.parametrize("g", [None, 2])
def test_triton_prefill_tile(g, gen):
    """From 2048 rows: the 128 x 256 tile with the scale folded (the interpreter takes it too),
    ragged N and K, a partial last row tile."""
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import fp8_block_linear

    m, n, k, block = 2100, 1100, 200, (128, 128)
    wq, sc = quantized_weight(gen, ((g,) if g else ()) + (n, k), block)
    x = rand_x(gen, m, g, k, torch.bfloat16)
    assert_close(fp8_block_linear(x, wq, sc, block), x, wq, sc, block)


def test_triton_launch_heuristics():
    tf = pytest.importorskip("vllm_dsv4_hw.ops.triton.linear.block")
    sms = 132
    assert tf._auto_split_k(kb=32, base=32, sms=sms) == 8       # wq_a: few blocks, 8-way
    assert tf._auto_split_k(kb=8, base=512, sms=sms) == 1       # wq_b: the blocks fill the device
    assert tf._auto_split_k(kb=64, base=128, sms=sms) == 4      # wo_b: at most 16 K blocks each
    assert tf._auto_split_k(kb=128, base=224, sms=sms) == 8     # Pro wo_b: long K splits anyway
    assert tf._auto_split_k(kb=2, base=1, sms=sms) == 2         # never more splits than K blocks
    assert tf._auto_block_n(8192, 1) == 32 and tf._auto_block_n(32768, 1) == 64
    # from 17 rows the long-K weights with >= 1024 columns take 64 (wo_a, wo_b, Pro wq_a), not wkv
    assert tf._auto_block_n(1024, 8, m=32, k=4096) == 64
    assert tf._auto_block_n(1024, 8, m=16, k=4096) == 32
    assert tf._auto_block_n(512, 1, m=32, k=4096) == 32
    assert tf._auto_block_n(8192, 1, m=32, k=1024) == 32
    # the prefill tile from 2048 rows, only where the declared shared memory holds it
    assert tf._prefill_tile(2048, 1024, torch.device("cpu"))["fold"] == tf.FOLD_W
    assert tf._prefill_tile(2047, 1024, torch.device("cpu")) == {}
    assert tf._prefill_tile(8192, 512, torch.device("cpu")) == {}  # narrow weights keep theirs
    assert tf.split_k_for(torch.device("cpu"), 4096, 32, 4, 1) == 1  # no split off CUDA
    assert [tf.k_tile(b) for b in (128, 32, 16, 8, 100)] == [128, 32, 16, 16, 128]


# -- Triton: ahead-of-time compile for sm_90 (hardware e4m3 cvt) and sm_80 (integer decode) --------
_COMPILE_SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_dsv4_hw.ops.triton.linear import block as f
from vllm_dsv4_hw.ops.triton.linear import split_k

DIV16 = {"x_ptr", "w_ptr", "s_ptr", "out_ptr", "part_ptr", "K", "sxg", "sxm", "swg", "swn"}
results = []


def comp(fn, sig, consts, name, cap, **opts):
    consts = dict(consts, PDL=cap >= 90)  # programmatic dependent launch where the GPU has it
    if "PF_BYTES" in fn.arg_names:  # the weight rows asked of L2 before the wait (PDL only)
        consts["PF_BYTES"] = 256 if cap >= 90 else 0
    full = dict(sig)
    full.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if k in DIV16}
    try:
        k = triton.compile(ASTSource(fn, full, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", cap, 32), options=opts)
        # which e4m3 decode the PTX holds: the hardware cvt (e4m3x2) or the packed PTX one
        ptx = k.asm["ptx"]
        results.append((name, None, "hw" if "e4m3x2" in ptx else "ptx" if "prmt.b32" in ptx
                        and "x2 " in ptx.split("prmt.b32", 1)[1] else "int"))
    except Exception as exc:  # report every failure, not just the first
        results.append((name, f"{type(exc).__name__}: {str(exc)[:1500]}", None))


ints = ("M", "N", "K", "KB", "kb_per_split", "n_nblk", "n_mblk", "sxg", "sxm", "swg", "swn",
        "ssg", "ssn", "sos", "sog", "som")
HW, PTX, INT = 1, 2, 0  # ptx_codecs.CVT_*
for cap, x, out, math, cvt, sbk, bm, bn, fold in (
        (90, "bf16", "bf16", f.MATH_X16, HW, 128, 16, 32, 0),    # decode, V4 blocks
        (90, "bf16", "bf16", f.MATH_X16, PTX, 128, 16, 32, 0),   # decode, packed PTX decode
        (90, "bf16", "fp32", f.MATH_X16, PTX, 32, 64, 64, 0),    # prefill tile, V4.1, split
        (90, "fp16", "fp16", f.MATH_X16, PTX, 128, 16, 64, 0),
        (90, "fp32", "fp32", f.MATH_F32, PTX, 128, 32, 32, 0),
        (90, "fp32", "fp32", f.MATH_F32, HW, 128, 32, 32, 0),
        (90, "fp64", "fp64", f.MATH_F64, INT, 32, 16, 32, 0),
        (90, "bf16", "bf16", f.MATH_X16, PTX, 128, 128, 128, 1),  # scale folded, large tile
        (90, "bf16", "bf16", f.MATH_X16, HW, 128, 16, 64, 2),    # weight tile as the A operand
        (80, "bf16", "bf16", f.MATH_X16, INT, 128, 16, 32, 0),   # sm_80: no fp8e4nv in Triton
        (80, "bf16", "bf16", f.MATH_X16, PTX, 128, 16, 32, 0),
        (80, "bf16", "fp32", f.MATH_X16, PTX, 32, 64, 64, 0),
        (80, "bf16", "bf16", f.MATH_X16, PTX, 128, 64, 64, 2),
        (80, "fp32", "fp32", f.MATH_F32, INT, 128, 16, 32, 0)):
    serial = x == "bf16" and out == "fp32"  # split-K partials, summed in the launch (bf16 out)
    sig = dict(x_ptr="*" + x, w_ptr="*u8", s_ptr="*u8", out_ptr="*" + out,
               red_ptr="*bf16" if serial else "*" + out, cnt_ptr="*i32",
               **{k: "i32" for k in ints})
    name = {HW: "hw", PTX: "ptx", INT: "int"}[cvt]
    comp(f._fp8_block_linear_kernel, sig,
         dict(SBN=128, SBK=sbk, BM=bm, BN=bn, BK=f.k_tile(sbk), MATH=math, CVT=cvt,
              OUT_BF16=out == "bf16", FOLD=fold, SERIAL=serial, SPLITS=4 if serial else 1,
              RED_BF16=serial or out == "bf16", W16=False),
         f"sm_{cap} x {x} -> {out} math {math} cvt {name} block {sbk} tile {bm}x{bn} fold {fold}",
         cap,
         num_warps=4, num_stages=3)
for cap in (90, 80):  # ops.dense_linear: the 16-bit weight read as it lies, fp32 out, serial split
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", out_ptr="*fp32", red_ptr="*fp32",
               cnt_ptr="*i32", **{k: "i32" for k in ints})
    comp(f._fp8_block_linear_kernel, sig,
         dict(SBN=128, SBK=128, BM=16, BN=32, BK=128, MATH=f.MATH_X16, CVT=INT, OUT_BF16=False,
              FOLD=1, SERIAL=True, SPLITS=4, RED_BF16=False, W16=True),
         f"sm_{cap} dense bf16 weight -> fp32 tile 16x32", cap, num_warps=4, num_stages=3)
for cap in (90, 80):
    comp(split_k.splitk_sum_kernel, dict(part_ptr="*fp32", out_ptr="*bf16", n_splits="i32",
                                    n_elems="i32", stride_s="i32"),
         dict(BLOCK=1024, OUT_BF16=True), f"sm_{cap} split-K sum", cap, num_warps=4)
print("RESULTS" + json.dumps(results))
'''

@pytest.mark.skipif(not HAS_PTXAS, reason="no Triton with bundled ptxas")
def test_triton_kernels_compile_for_sm90_and_sm80():
    results = compile_results(_COMPILE_SCRIPT)
    failed = [f"{name}: {err}" for name, err, _ in results if err]
    assert len(results) == 18
    assert not failed, "\n".join(failed)
    # each kernel holds the e4m3 decode it was compiled for (the float64 path: integer)
    got = {name: used for name, _, used in results if "split-K" not in name and "dense" not in name}
    # the dense kernel decodes nothing: no e4m3 cvt, no packed PTX decode
    assert {used for name, _, used in results if "dense" in name} == {"int"}, results
    assert all(name.split(" cvt ")[1].startswith(used) for name, used in got.items()), got

# -- the conformance kit's cases -------------------------------------------------------------------
@pytest.mark.parametrize("backend,caps_name",  # float8 dtypes (cpu caps) / raw bytes (no fp8)
                         [(b, "cpu") for b in BACKENDS] + [("reference", "npu")])
def test_kit_cases_pass(backend, caps_name, gen):
    from vllm_dsv4_hw.conformance import cases as C
    from vllm_dsv4_hw.conformance.cases_weights import fp8_block_linear_cases
    from vllm_dsv4_hw.platform.capabilities import CPU, NPU_A2_A3

    caps = CPU if caps_name == "cpu" else NPU_A2_A3
    ctx = C.Ctx(device=torch.device("cpu"), caps=caps, dims=C.SHAPES["small"], gen=gen,
                main_fmt="bf16", indexer_fmt="bf16", main_formats=("bf16",),
                indexer_formats=("bf16",))
    cases = fp8_block_linear_cases(ctx)
    assert len(cases) == 14 and all(c.op == FP8_BLOCK_LINEAR for c in cases)
    assert sum(c.name.startswith("e4m3 x: ") for c in cases) == 4   # quantize_x=True
    assert sum(c.name.startswith("e4m3 codes in: ") for c in cases) == 2   # x_scales
    failures = []
    for case in cases:
        ok, detail, _ = case.run(impl(FP8_BLOCK_LINEAR, backend))
        if not ok:
            failures.append(f"{case.name}: {detail}")
    assert not failures, "\n".join(failures)
    # and the checks see a result 2% off
    ref = impl(FP8_BLOCK_LINEAR, "reference")
    assert not any(c.run(lambda *a: (ref(*a).float() * 1.02).to(torch.bfloat16))[0] for c in cases)
