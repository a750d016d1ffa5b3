# SPDX-License-Identifier: Apache-2.0
"""Shared ``@triton.jit`` codecs for the cache entry formats (``kv_cache.formats``), bit-exact with
the PyTorch codecs there.

Everything here works on integer bit patterns and fp32 values only: no bf16 / fp8 tensor dtypes are
used for arithmetic (the Triton interpreter gets bf16 math wrong, and Ascend has no fp8 dtypes), so
the helpers run unchanged on NVIDIA GPUs, triton-ascend and the CPU interpreter. Rounding is
round-to-nearest-even everywhere, as torch's casts.

Format codes (``FMT`` constexpr of the kernels; :func:`format_code` maps an ``EntryFormat``):

* ``FMT_FP32``        ``dim`` little-endian fp32 (tests only);
* ``FMT_BF16``        ``dim`` little-endian bf16;
* ``FMT_FP8_DS_MLA``  main KV (dim 512): dims 0..447 e4m3 in 7 blocks of 64 with ue8m0 scales,
  dims 448..511 bf16 at data bytes 448..575; scale part = 7 ue8m0 bytes + 1 zero pad;
* ``FMT_FP8_INDEXER`` indexer key: ``dim`` e4m3 codes + one fp32 power-of-two scale (4 bytes);
* ``FMT_MXFP4``       indexer key: e2m1 pairs (element 2j low nibble, 2j+1 high nibble) + one ue8m0
  byte per 32-element block.

Addressing convention of the entry-level helpers: ``cache_ptr`` is the uint8 base pointer of the
paged cache, ``data_off`` / ``scale_off`` are int64 byte offsets of an entry's data part and scale
part (``page * page_stride + off * data_bytes`` and ``page * page_stride + E * data_bytes + off *
scale_bytes``), ``d`` are dim indices; all broadcast together. bf16 / fp32 parts are read through
2- / 4-byte pointer casts, so page strides and the cache base must be 4-byte aligned (the host
wrappers check it: :func:`check_cache`); the fp32 scale of ``FMT_FP8_INDEXER`` is assembled from
single bytes by :func:`dequant_entry` (any alignment).

Helpers: bit tricks (``pow2_f32``, ``ceil_log2_div``: exact, division-free scale exponents);
element codecs (``bf16_bits_to_f32`` / ``f32_to_bf16_bits`` / ``round_to_bf16``,
``e4m3_bits_to_f32`` / ``f32_to_e4m3_bits``, ``e2m1_to_f32`` / ``f32_to_e2m1``, ``ue8m0_to_f32``);
entry loaders (``dequant_entry`` for any format and dims; ``fp8_ds_mla_dequant`` for the main fp8
entry, e.g. for sparse attention; ``load_entry_pairs``: (even, odd) dim pairs with one wide load per
pair, for dot-product kernels); the entry store ``store_entry_pairs`` (quantize + write, one or
several entries per call). Inside ``@triton.jit`` bodies the format codes are read through the
``_CFMT_*`` constexpr globals (a GPU compile rejects plain-int globals; the interpreter does not).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_dsv4_hw.ops.triton.common.ptx_codecs import e2m1_pairs_to_bf16

FMT_FP32 = 0
FMT_BF16 = 1
FMT_FP8_DS_MLA = 2
FMT_FP8_INDEXER = 3
FMT_MXFP4 = 4

# The same codes as constexpr globals: the only kind of global a @triton.jit body may read when
# compiled for a GPU (the interpreter accepts plain ints, the compiler does not).
_CFMT_FP32 = tl.constexpr(FMT_FP32)
_CFMT_BF16 = tl.constexpr(FMT_BF16)
_CFMT_FP8_DS_MLA = tl.constexpr(FMT_FP8_DS_MLA)
_CFMT_FP8_INDEXER = tl.constexpr(FMT_FP8_INDEXER)
_CFMT_MXFP4 = tl.constexpr(FMT_MXFP4)

_NAME_TO_CODE = {
    "fp32": FMT_FP32,
    "bf16": FMT_BF16,
    "fp8_ds_mla": FMT_FP8_DS_MLA,
    "fp8_indexer": FMT_FP8_INDEXER,
    "mxfp4": FMT_MXFP4,
}


def format_code(fmt) -> int:
    """The ``FMT_*`` code of an entry format (by its ``name``)."""
    try:
        code = _NAME_TO_CODE[fmt.name]
    except (KeyError, AttributeError):
        raise ValueError(f"triton kernels do not support entry format {getattr(fmt, 'name', fmt)!r}; "
                         f"supported: {', '.join(_NAME_TO_CODE)}") from None
    if code == FMT_FP8_DS_MLA and fmt.dim != 512:
        raise ValueError("fp8_ds_mla entries must have dim 512")
    return code


def check_cache(cache, fmt) -> None:
    """Host-side checks the kernels rely on (uint8 2-D cache, 4-byte aligned base and page stride)."""
    if cache.dtype.itemsize != 1 or cache.dim() != 2:
        raise ValueError(f"{fmt.name}: cache must be uint8 [num_pages, page_bytes], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if cache.shape[0] and cache.shape[1] < fmt.min_page_bytes:
        raise ValueError(f"{fmt.name}: page of {cache.shape[1]} B < {fmt.min_page_bytes} B")
    if cache.stride(1) != 1 or cache.stride(0) % 4 or cache.data_ptr() % 4:
        raise ValueError(f"{fmt.name}: triton kernels need a row-contiguous cache with 4-byte aligned "
                         f"pages (stride {cache.stride()}, base {cache.data_ptr()})")


# -- scalar bit tricks ----------------------------------------------------------------------------
@triton.jit
def pow2_f32(e):
    """Exact fp32 2^e for int32 ``e`` in [-126, 127] (normal range; built from bits)."""
    return ((e + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2_div(amax, THRESH: tl.constexpr, SHIFT: tl.constexpr):
    """Exact ``ceil(log2(amax / c))`` (int32) for a positive normal fp32 ``amax`` and c = m * 2^SHIFT
    with mantissa m = 1 + THRESH / 2^23, *as if* ``amax / c`` were divided with correct rounding
    (as torch does), but without a division (Triton's fp32 ``/`` is approximate on NVIDIA GPUs).

    With amax = M * 2^E: amax / c = (M / m) * 2^(E - SHIFT), and the correctly rounded quotient
    exceeds 2^(E - SHIFT) exactly when M > m (M one ulp above m already rounds above 1), so the
    result is E - SHIFT + (frac(amax) > THRESH). c = 448: THRESH 0x600000, SHIFT 8; c = 6:
    THRESH 0x400000, SHIFT 2."""
    bits = amax.to(tl.int32, bitcast=True)
    ex = ((bits >> 23) & 0xFF) - 127
    return ex - SHIFT + ((bits & 0x7FFFFF) > THRESH).to(tl.int32)


@triton.jit
def ceil_log2_f32(x):
    """Exact ``ceil(log2(x))`` (int32) of a positive normal fp32 ``x``, read from its bits."""
    bits = x.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return ex - 127 + (frac != 0).to(tl.int32)


@triton.jit
def ue8m0_to_f32(b):
    """ue8m0 byte (any int dtype) -> fp32 2^(b - 127) (byte 0 -> 2^-127, byte 255 -> inf)."""
    bi = b.to(tl.int32)
    normal = (bi << 23).to(tl.float32, bitcast=True)
    return tl.where(bi == 0, tl.full(bi.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True),
                    normal)


# -- bf16 -----------------------------------------------------------------------------------------
@triton.jit
def bf16_bits_to_f32(u):
    """bf16 bit patterns (uint16 / int) -> fp32 (exact)."""
    return (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 (finite) -> bf16 bit patterns as uint16, round to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16)


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, returned as fp32 (exact)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# -- e4m3 (OCP float8_e4m3fn) -----------------------------------------------------------------------
@triton.jit
def e4m3_bits_to_f32(c):
    """e4m3fn bit patterns (uint8 / int) -> fp32, bit-exact with torch's ``float8_e4m3fn`` on all
    256 codes (0x7F / 0xFF are NaN, which no encoder of ours produces from finite values)."""
    ci = c.to(tl.int32)
    ex = (ci >> 3) & 0xF
    man = ci & 0x7
    # normal: sign | (ex + 120) << 23 | man << 20 ; subnormal (ex == 0): sign | bits(man * 2^-9).
    # The sign goes in as a bit in both cases: negating the subnormal value instead gives +0.0 for
    # code 0x80 where negation is 0 - x (triton-ascend), and torch decodes 0x80 as -0.0.
    sign = (ci & 0x80) << 24
    normal = (sign | ((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = (sign | (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)).to(
        tl.float32, bitcast=True)
    out = tl.where(ex == 0, sub, normal)
    nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)  # keeps the sign
    return tl.where((ci & 0x7F) == 0x7F, nan, out)


@triton.jit
def f32_to_e4m3_bits(v):
    """fp32 -> e4m3fn bit patterns (uint8): saturate to +-448 (Inf included), round to nearest even,
    NaN -> 0x7F with its sign: bit-exact with torch's ``.to(torch.float8_e4m3fn)`` and with
    ``numerics.e4m3_encode``."""
    nan = v != v
    sign = (v.to(tl.uint32, bitcast=True) >> 24) & 0x80  # NaN keeps its sign bit, as in torch
    v = tl.where(nan, 0.0, tl.minimum(tl.maximum(v, -448.0), 448.0))
    a_bits = v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    # normal range |v| >= 2^-6: round the fp32 mantissa at bit 20 (ties to even), rebias 127 -> 7
    rn = (a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20
    code_n = rn.to(tl.int32) - (120 << 3)
    # subnormal range: |v| * 2^9 rounded to an integer (ties to even via the 2^23 magic number)
    a = a_bits.to(tl.float32, bitcast=True)
    m = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a_bits < 0x3C800000, m, code_n)  # 0x3C800000 = 2^-6
    code = tl.where(nan, 0x7F, code)
    return (code | sign.to(tl.int32)).to(tl.uint8)


# -- e2m1 (MXFP4 elements) --------------------------------------------------------------------------
@triton.jit
def e2m1_to_f32(nib):
    """e2m1 nibble codes (0..15) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign."""
    ni = nib.to(tl.int32)
    ex = (ni >> 1) & 0x3
    man = (ni & 0x1).to(tl.float32)
    mag = tl.where(ex == 0, man * 0.5, (1.0 + man * 0.5) * pow2_f32(ex - 1))
    return tl.where((ni & 0x8) != 0, -mag, mag)


@triton.jit
def e2m1_scaled_f32(nib, se):
    """e2m1 nibble codes (int32 0..15) times the ue8m0 scale 2^(sb - 127), given as
    ``se = (sb - 1) << 23`` with 2 <= sb <= 252, built as fp32 bits with integer ops (exact).

    Magnitude code c = (e << 1) | m: for e >= 1 the value 2^(e-1) (1 + m/2) 2^(sb-127) has the
    fp32 bits (c << 22) + se (exponent e + sb - 1, top mantissa bit m); c = 1 (0.5) is 2^(sb-128),
    the bits ``se`` alone; c = 0 is zero. Bit 3 of the code is the sign."""
    c = nib & 0x7
    bits = tl.where(c >= 2, (c << 22) + se, tl.where(c == 1, se, 0))
    return (bits | ((nib & 0x8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e2m1(v):
    """fp32 -> e2m1 nibble codes (int32 0..15): nearest value, ties to the even code, saturating at
    +-6; sign bit as IEEE (bit-exact with ``kv_cache.formats.mxfp4.e2m1_encode``)."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    sign = ((v.to(tl.uint32, bitcast=True) >> 28) & 0x8).to(tl.int32)
    return code | sign


# -- entry-level loaders (dequantize straight from the paged cache) -------------------------------
@triton.jit
def load_bf16_f32(cache_ptr, byte_off, mask):
    """Load bf16 values at byte offsets (2-byte aligned) -> fp32."""
    u = tl.load((cache_ptr + byte_off).to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
    return bf16_bits_to_f32(u)


@triton.jit
def load_f32(cache_ptr, byte_off, mask):
    """Load fp32 values at byte offsets (4-byte aligned)."""
    return tl.load((cache_ptr + byte_off).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)


@triton.jit
def load_f32_bytewise(cache_ptr, byte_off, mask):
    """Load one little-endian fp32 at any byte offset (assembled from 4 single-byte loads).
    ``byte_off`` may be narrower than ``mask`` (one scale per entry, several dims): both are
    broadcast first, since triton-ascend's load broadcasts the mask to the pointer's shape only."""
    byte_off, mask = tl.broadcast(byte_off, mask)
    b0 = tl.load(cache_ptr + byte_off, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(cache_ptr + byte_off + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(cache_ptr + byte_off + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(cache_ptr + byte_off + 3, mask=mask, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_ds_mla_dequant(cache_ptr, data_off, scale_off, d, mask):
    """fp8_ds_mla entries -> fp32 values of dims ``d`` (0..511): e4m3 * ue8m0 block scale for
    d < 448, bf16 for the 64 rope dims. ``data_off``, ``scale_off`` and ``d`` broadcast together."""
    nope = d < 448
    code = tl.load(cache_ptr + data_off + d, mask=mask & nope, other=0)
    sb = tl.load(cache_ptr + scale_off + d // 64, mask=mask & nope, other=127)
    v_nope = e4m3_bits_to_f32(code) * ue8m0_to_f32(sb)
    v_rope = load_bf16_f32(cache_ptr, data_off + 448 + 2 * (d - 448), mask & (d >= 448))
    return tl.where(nope, v_nope, v_rope)


@triton.jit
def mxfp4_dequant(cache_ptr, data_off, scale_off, d, mask):
    """MXFP4 entries -> fp32 values of dims ``d`` (e2m1 * ue8m0 of block d // 32)."""
    byte = tl.load(cache_ptr + data_off + d // 2, mask=mask, other=0).to(tl.int32)
    nib = (byte >> ((d % 2) * 4)) & 0xF
    sb = tl.load(cache_ptr + scale_off + d // 32, mask=mask, other=127)
    return e2m1_to_f32(nib) * ue8m0_to_f32(sb)


@triton.jit
def dequant_entry(cache_ptr, data_off, scale_off, d, mask, FMT: tl.constexpr,
                  APPLY_FP8_INDEXER_SCALE: tl.constexpr = True):
    """Dims ``d`` of the entries at ``data_off`` / ``scale_off`` -> fp32, for any ``FMT``.

    With ``APPLY_FP8_INDEXER_SCALE=False`` an ``FMT_FP8_INDEXER`` entry returns its raw e4m3 values
    (callers multiply a dot product by :func:`fp8_indexer_scale` instead: exact, the scale is a power
    of two; the raw values are then exact in bf16, which lets the GPU use a bf16 tl.dot)."""
    if FMT == _CFMT_FP32:
        v = load_f32(cache_ptr, data_off + 4 * d, mask)
    elif FMT == _CFMT_BF16:
        v = load_bf16_f32(cache_ptr, data_off + 2 * d, mask)
    elif FMT == _CFMT_FP8_DS_MLA:
        v = fp8_ds_mla_dequant(cache_ptr, data_off, scale_off, d, mask)
    elif FMT == _CFMT_FP8_INDEXER:
        v = e4m3_bits_to_f32(tl.load(cache_ptr + data_off + d, mask=mask, other=0))
        if APPLY_FP8_INDEXER_SCALE:
            v = v * load_f32_bytewise(cache_ptr, scale_off, mask)
    else:
        v = mxfp4_dequant(cache_ptr, data_off, scale_off, d, mask)
    return v


def pair_unit_bytes(fmt_code: int) -> int:
    """Bytes of one (2j, 2j+1) pair of an entry, the unit of :func:`load_entry_pairs` offsets."""
    return {FMT_FP32: 8, FMT_BF16: 4, FMT_FP8_INDEXER: 2, FMT_MXFP4: 1}[fmt_code]


@triton.jit
def load_entry_pairs(cache_ptr, pair_off, scale_off, j, mask, FMT: tl.constexpr,
                     SCALE_WORD: tl.constexpr = False, PTX: tl.constexpr = False):
    """Dims (2j, 2j+1) of entries as two fp32 tensors (even, odd), one load per pair.

    ``pair_off``: offset of the entry's data part in *pair units* (:func:`pair_unit_bytes`: fp32 8 B,
    bf16 4 B, fp8_indexer 2 B, mxfp4 1 B); ``j``: pair indices. Loads go through a pointer of the
    pair's width at ``pair_off + j``, so j is the contiguous axis and the compiler can vectorize
    (the host passes the page stride in pair units, so its divisibility is known). ``scale_off``
    (mxfp4 only): byte offset of the entry's scale part, or with ``SCALE_WORD`` (entries with
    exactly 4 scale bytes, 4-byte aligned: dim 128) its offset in 32-bit words, read once per entry
    (shape it like ``pair_off``, e.g. [1, S]). fp8_indexer values come back *unscaled* (multiply
    dot products by the entry's scale). fp8_ds_mla is not supported here (see
    :func:`fp8_ds_mla_dequant`). ``PTX`` (mxfp4, devices with ``ptx_inline``): bf16 values by the
    packed decode of ``ptx_codecs.e2m1_pairs_to_bf16`` (the same values, exact; pair runs of 4
    along the last axis).
    """
    if FMT == _CFMT_FP32:
        p = cache_ptr.to(tl.pointer_type(tl.float32)) + 2 * (pair_off + j)
        ve = tl.load(p, mask=mask, other=0.0)
        vo = tl.load(p + 1, mask=mask, other=0.0)
    elif FMT == _CFMT_BF16:
        u = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + pair_off + j, mask=mask, other=0)
        ve = (u << 16).to(tl.float32, bitcast=True)
        vo = (u & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif FMT == _CFMT_FP8_INDEXER:
        u = tl.load(cache_ptr.to(tl.pointer_type(tl.uint16)) + pair_off + j, mask=mask, other=0)
        ve = e4m3_bits_to_f32(u & 0xFF)
        vo = e4m3_bits_to_f32(u >> 8)
    else:
        tl.static_assert(FMT == _CFMT_MXFP4, "load_entry_pairs: unsupported format")
        b = tl.load(cache_ptr + pair_off + j, mask=mask, other=0).to(tl.int32)
        if SCALE_WORD:
            word = tl.load(cache_ptr.to(tl.pointer_type(tl.uint32)) + scale_off, mask=mask,
                           other=0x7F7F7F7F)
            sb = ((word >> (8 * (j // 16)).to(tl.uint32)) & 0xFF).to(tl.int32)
        else:
            sb = tl.load(cache_ptr + scale_off + j // 16, mask=mask, other=127).to(tl.int32)
        if PTX:
            ve, vo = e2m1_pairs_to_bf16(b.to(tl.uint8), sb)
        else:
            # Integer decode with the scale folded into the exponent (e2m1_scaled_f32) for scale
            # bytes in [2, 252] (every real key); a byte outside is clamped into that range and the
            # value multiplied by the power of two left over (exact, as the general product is).
            sbc = tl.minimum(tl.maximum(sb, 2), 252)
            se = (sbc - 1) << 23
            rest = ((sb - sbc + 127) << 23).to(tl.float32, bitcast=True)
            ve = e2m1_scaled_f32(b & 0xF, se) * rest
            vo = e2m1_scaled_f32(b >> 4, se) * rest
    return ve, vo


@triton.jit
def fp8_indexer_scale(cache_ptr, scale_off, mask):
    """The fp32 scale of ``FMT_FP8_INDEXER`` entries (1.0 where masked)."""
    return tl.where(mask, load_f32_bytewise(cache_ptr, scale_off, mask), 1.0)


# -- entry-level stores (quantize + write one entry from pair-split registers) ---------------------
@triton.jit
def entry_offsets(slot, E, page_stride, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """(data byte offset, scale byte offset) of entry ``slot`` (>= 0) in a paged cache of ``E``
    entries per page and ``page_stride`` bytes per page (a page: every entry's data part, then
    every entry's scale part)."""
    page = slot // E
    off = slot % E
    return (page * page_stride + off * DATA_BYTES,
            page * page_stride + E * DATA_BYTES + off * SCALE_BYTES)


@triton.jit
def store_bytes_u32(cache_ptr, byte_off, bits, mask):
    """Store a uint32 / int32 (little-endian) as 4 single bytes at any byte offset."""
    b = bits.to(tl.uint32)
    tl.store(cache_ptr + byte_off, (b & 0xFF).to(tl.uint8), mask=mask)
    tl.store(cache_ptr + byte_off + 1, ((b >> 8) & 0xFF).to(tl.uint8), mask=mask)
    tl.store(cache_ptr + byte_off + 2, ((b >> 16) & 0xFF).to(tl.uint8), mask=mask)
    tl.store(cache_ptr + byte_off + 3, ((b >> 24) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _bf16_pair_bits(xe, xo):
    """(even, odd) fp32 -> one little-endian uint32 holding their two bf16 (RNE)."""
    return f32_to_bf16_bits(xe).to(tl.uint32) | (f32_to_bf16_bits(xo).to(tl.uint32) << 16)


@triton.jit
def _e4m3_pair_bits(ve, vo):
    """(even, odd) fp32 -> one little-endian uint16 holding their two e4m3 codes."""
    return f32_to_e4m3_bits(ve).to(tl.uint16) | (f32_to_e4m3_bits(vo).to(tl.uint16) << 8)


@triton.jit
def store_entry_pairs(cache_ptr, data_off, scale_off, xe, xo, pidx, blk, ok, FMT: tl.constexpr):
    """Quantize entries and write them (data and scale parts) into the paged cache.

    Entries are held as pairs: ``xe`` / ``xo`` [NB, BP] fp32 are dims 2j and 2j+1 with pair index
    j = ``pidx`` [NB, BP] = blk * BP + p within the entry (``blk`` [NB]: the block index of each row).
    A row of pairs is one quantization block: BP = 32 for ``FMT_FP8_DS_MLA`` (64-dim blocks, 8 rows
    per dim-512 entry), BP = 16 for ``FMT_MXFP4`` (32-dim blocks), BP = dim/2 (a whole entry per row)
    for ``FMT_FP8_INDEXER``; any for bf16 / fp32.

    Pairs are written with one 2-byte (e4m3) / 4-byte (bf16) store each: the cache base and page
    stride must be 4-byte aligned (``check_cache``). fp32 entries use two 4-byte stores per pair.
    One entry per call: ``data_off`` / ``scale_off`` / ``ok`` scalars. Several entries per call
    (rows of different entries stacked): ``data_off`` [NB, 1], ``scale_off`` [NB] and ``ok`` [NB]
    (bool: slot valid) per row.
    """
    de = 2 * pidx  # even dim of every pair
    # vector masks built by comparisons (the interpreter mis-types `vector_bool & scalar_bool`)
    bmask = (blk * 0 + ok.to(tl.int32)) != 0              # [NB]
    mask = bmask[:, None] & (pidx >= 0)                   # [NB, BP]
    if FMT == _CFMT_FP32:
        tl.store((cache_ptr + data_off + 4 * de).to(tl.pointer_type(tl.float32)), xe, mask=mask)
        tl.store((cache_ptr + data_off + 4 * de + 4).to(tl.pointer_type(tl.float32)), xo, mask=mask)
    elif FMT == _CFMT_BF16:  # one 32-bit store per pair
        tl.store((cache_ptr + data_off + 2 * de).to(tl.pointer_type(tl.uint32)),
                 _bf16_pair_bits(xe, xo), mask=mask)
    elif FMT == _CFMT_FP8_DS_MLA:
        xe = round_to_bf16(xe)
        xo = round_to_bf16(xo)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [NB]
        ex = ceil_log2_div(tl.maximum(amax, 1e-4), 0x600000, 8)
        inv = pow2_f32(-ex)[:, None]
        nope = de < 448
        tl.store((cache_ptr + data_off + de).to(tl.pointer_type(tl.uint16)),
                 _e4m3_pair_bits(xe * inv, xo * inv), mask=mask & nope)
        rope_off = data_off + 448 + 2 * (de - 448)
        rope = de >= 448
        tl.store((cache_ptr + rope_off).to(tl.pointer_type(tl.uint32)), _bf16_pair_bits(xe, xo),
                 mask=mask & rope)
        # 7 ue8m0 bytes (row 7 is the bf16 rope block: its byte is the zero pad)
        sbyte = tl.where(blk < 7, ex + 127, 0).to(tl.uint8)
        tl.store(cache_ptr + scale_off + blk, sbyte, mask=bmask & (blk < 8))
    elif FMT == _CFMT_FP8_INDEXER:
        xe = round_to_bf16(xe)
        xo = round_to_bf16(xo)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [NB] = entries
        ex = ceil_log2_div(tl.maximum(amax, 1e-4), 0x600000, 8)
        inv = pow2_f32(-ex)[:, None]
        tl.store((cache_ptr + data_off + de).to(tl.pointer_type(tl.uint16)),
                 _e4m3_pair_bits(xe * inv, xo * inv), mask=mask)
        store_bytes_u32(cache_ptr, scale_off + blk * 0, pow2_f32(ex).to(tl.uint32, bitcast=True),
                        bmask)
    else:  # FMT_MXFP4
        byte, ex = mxfp4_quantize_pairs(xe, xo)
        tl.store(cache_ptr + data_off + pidx, byte, mask=mask)
        tl.store(cache_ptr + scale_off + blk, (ex + 127).to(tl.uint8), mask=bmask)


# -- fp8_ds_mla block quantization as a value-level helper (appended for the bytewise insert path) --
@triton.jit
def fp8_ds_mla_quantize_pairs(xe, xo):
    """The fp8_ds_mla codec on pairs ``xe`` / ``xo`` [NB, BP=32] (a row = one 64-dim block), without
    storing: returns (e4m3 codes of xe, of xo (uint8 [NB, BP]), block exponents ex (int32 [NB]),
    xe and xo rounded to bf16 (fp32; the rope block's values)). Same math as the FMT_FP8_DS_MLA
    branch of :func:`store_entry_pairs` (bf16 rounding, amax floor 1e-4, s = 2^ex)."""
    xe = round_to_bf16(xe)
    xo = round_to_bf16(xo)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [NB]
    ex = ceil_log2_div(tl.maximum(amax, 1e-4), 0x600000, 8)
    inv = pow2_f32(-ex)[:, None]
    return f32_to_e4m3_bits(xe * inv), f32_to_e4m3_bits(xo * inv), ex, xe, xo


@triton.jit
def mxfp4_quantize_pairs(xe, xo):
    """The MXFP4 codec on pairs ``xe`` / ``xo`` [NB, BP=16] (a row = one 32-dim block), without
    storing: returns (packed e2m1 bytes, element 2j in the low nibble (uint8 [NB, BP]), block
    exponents ex (int32 [NB], scale byte ex + 127)). Bf16 rounding first, amax floor 6 * 2^-126,
    ex = clamp(ceil(log2(amax / 6)), -127, 127); shared by :func:`store_entry_pairs` and the
    bytewise insert path."""
    xe = round_to_bf16(xe)
    xo = round_to_bf16(xo)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [NB]
    amax = tl.maximum(amax, 6.0 * 1.1754943508222875e-38)
    ex = tl.minimum(tl.maximum(ceil_log2_div(amax, 0x400000, 2), -127), 127)
    inv = pow2_f32(-ex)[:, None]
    byte = f32_to_e2m1(xe * inv) | (f32_to_e2m1(xo * inv) << 4)
    return byte.to(tl.uint8), ex
