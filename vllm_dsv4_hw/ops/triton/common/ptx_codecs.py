# SPDX-License-Identifier: Apache-2.0
"""e4m3 -> bf16 / fp16 decode in packed integer instructions (NVIDIA PTX inline assembly, sm_80+).

Why: a weight-streaming GEMM converts every byte it reads. The hardware conversion Triton emits
for e4m3 -> bf16 on sm_89 / sm_90 is a packed e4m3x2 -> f16x2 ``cvt`` plus one f16 -> bf16
``cvt`` per element, and conversions issue at 16 lanes per clock per SM (a quarter of the integer
and a sixteenth of the half-precision FMA rate): at decode sizes that, not HBM, bounds the FP8
GEMMs (evidence: docs/tuning.md, Packed e4m3 / e2m1 decode).

How (exact for all 254 finite codes): an e4m3 byte's 7 exponent + mantissa bits moved into a
16-bit lane at the right place *are* a bf16 (fp16) of the same value times 2^-120 (2^-8), for
subnormal codes too (they land on subnormal bf16 / fp16 of the same mantissa); one packed FMA by
2^120 (2^8) rescales two lanes exactly. Four codes cost two sign-replicating ``prmt``, two
shifts, two ``and`` and two packed FMAs, all at full integer / FMA rate (12 before the sign came
along with the ``prmt``). The NaN codes 0x7F / 0xFF (never in
a shipped checkpoint) decode as -+480 here, not NaN.

Only where the device declares ``ptx_inline`` (``platform.capabilities``): the CPU interpreter,
AMD and Ascend keep ``quant.e4m3_bits_to_f32`` or the hardware cvt.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_dsv4_hw.platform.device import adaptor_for

# E4M3 decode modes (constexpr ``CVT`` of the kernels that read e4m3 bytes)
CVT_INT = 0  # quant.e4m3_bits_to_f32: integer decode to fp32 (interpreter, no PTX, no cvt)
CVT_HW = 1  # the hardware e4m3 cvt (sm_89+ where PTX is not declared, AMD)
CVT_PTX = 2  # this module: packed integer decode + packed FMA
# (a GPU compile reads only constexpr globals inside @triton.jit bodies)
C_CVT_HW = tl.constexpr(CVT_HW)
C_CVT_PTX = tl.constexpr(CVT_PTX)


def e4m3_mode(device) -> int:
    """The fastest exact e4m3 decode the device declares (``platform.capabilities``); the
    integer decode under the interpreter (CPU tensors)."""
    return e4m3_modes(device)[-1]


def e4m3_modes(device) -> tuple[int, ...]:
    """Every exact e4m3 decode the device declares, slowest first (the GPU checks run each
    against the auto choice, the last): a device declared as sm_80 takes no hardware cvt,
    whatever the part it runs on."""
    if device.type == "cpu":
        return (CVT_INT,)
    caps = adaptor_for(device.type).capabilities
    return (
        (CVT_INT,) + ((CVT_HW,) if caps.fp8_cvt else ()) + ((CVT_PTX,) if caps.ptx_inline else ())
    )


# $2: four codes (byte i = element i); $0 / $1: elements 0, 1 / 2, 3 as two 16-bit lanes each.
# One ``prmt`` puts codes 0, 1 (2, 3) in the low bytes of two lanes with their sign bit replicated
# through the high bytes (selector nibbles 8 / 9 / A / B: sign of byte 0 / 1 / 2 / 3); a shift by
# 4 (bf16) or 7 (fp16) moves the 7 magnitude bits to bits 4..10 (bf16: exponent from bit 7) or
# 7..13 (fp16: exponent from bit 10) and leaves a copy of the sign at bit 15; the mask keeps the
# two and clears the rest (the code's own sign bit and what the 32-bit shift carried over from
# the lower lane); then one packed FMA by the rescale factor. 8 instructions per 4 codes.
_ASM = """{{
.reg .b32 m0, m1, k, z;
prmt.b32 m0, $2, 0, 0x9180;
prmt.b32 m1, $2, 0, 0xb3a2;
shl.b32 m0, m0, {shift};
shl.b32 m1, m1, {shift};
and.b32 m0, m0, {mask};
and.b32 m1, m1, {mask};
mov.b32 k, {scale};
mov.b32 z, 0x80008000;
fma.rn.{ty} $0, m0, k, z;
fma.rn.{ty} $1, m1, k, z;
}}"""

# bf16: 2^120 = exponent byte 247 -> 0x7b80; fp16: 2^8 -> 0x5c00. The addend -0.0 keeps -0.0.
_ASM_BF16 = tl.constexpr(_ASM.format(shift=4, mask="0x87f087f0", scale="0x7b807b80", ty="bf16x2"))
_ASM_F16 = tl.constexpr(_ASM.format(shift=7, mask="0xbf80bf80", scale="0x5c005c00", ty="f16x2"))


@triton.jit
def e4m3_bits_to_16bit(codes, DT: tl.constexpr):
    """e4m3 codes (uint8 tensor, any shape whose per-thread runs are multiples of 4) -> values of
    DT (tl.bfloat16 or tl.float16), exact for every finite code."""
    if DT == tl.float16:
        return tl.inline_asm_elementwise(
            _ASM_F16, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            _ASM_BF16, "=r,=r,r", [codes], dtype=tl.bfloat16, is_pure=True, pack=4
        )


# -- e2m1 (MXFP4 keys) -> bf16 -------------------------------------------------------------------
# The same idea for the indexer's MXFP4 keys, whose integer decode to fp32 plus the fp32 -> bf16
# cvt bounded the score pass at 1M context, not the key bytes (evidence: docs/tuning.md, Packed
# e4m3 / e2m1 decode). An e2m1
# nibble's 3 magnitude bits at bits 6..8 of a bf16 lane are its value times 2^-126, the 0.5 code
# included (a subnormal bf16 of the same mantissa): one packed FMA by 2^126 rescales it exactly,
# a second one by the block's ue8m0 scale (exact: powers of two, every product representable).
# $4: bytes 0..3 of four consecutive pairs (dims 2j low nibble, 2j+1 high nibble); $5 / $6: the
# four pairs' scales as bf16 lanes (pairs 0, 1 / 2, 3); $0 / $1: the even dims of pairs 0, 1 / 2, 3,
# $2 / $3: the odd dims. The -0.0 addends keep the sign of zero codes.
# Placing a nibble: its 4 bits masked out of the 16-bit lane, then one multiply by 2^a + 2^b
# writes two shifted copies that do not overlap (no carries): the one shifted by a puts the
# magnitude at bits 6..8, the one shifted by b the sign at bit 15, and one mask keeps those bits
# (low nibble: x 0x1040, shifts 6 and 12; high nibble: x 0x104, shifts 2 and 8). 3 integer ops
# per lane pair where two shifts, a mask and a masked or took 4 (fewer instructions in the score
# loop; evidence: docs/tuning.md, Packed e4m3 / e2m1 decode).
_E2M1_HALF = """and.b32 m, {t}, {nib};
mul.lo.u32 m, m, {mul};
and.b32 m, m, 0x81c081c0;
"""
# the bare values (times 2^126: exact) as two fp32 (a bf16 lane is an fp32's high half)
_E2M1_TO_F32 = "fma.rn.bf16x2 m, m, k, z;\nshl.b32 {out}, m, 16;\nand.b32 {out2}, m, 0xffff0000;\n"
_E2M1_SCALE = "fma.rn.bf16x2 m, m, k, z;\nfma.rn.bf16x2 {out}, m, {sc}, z;\n"


def _e2m1_asm(scaled: bool) -> str:
    """$4 ($8 bare): four pair bytes. Scaled: $5 / $6 the scales of pairs 0, 1 / 2, 3 (bf16
    lanes), $0 / $1 the even dims of pairs 0, 1 / 2, 3 (bf16 lanes), $2 / $3 the odd. Bare:
    $0..$3 the even dims of pairs 0..3 as fp32, $4..$7 the odd."""
    src = "$4" if scaled else "$8"
    if scaled:
        outs = (("t0", "$5", (("$0", ""), ("$2", ""))), ("t1", "$6", (("$1", ""), ("$3", ""))))
    else:
        outs = (("t0", "", (("$0", "$1"), ("$4", "$5"))), ("t1", "", (("$2", "$3"), ("$6", "$7"))))
    return (
        f"{{\n.reg .b32 t0, t1, m, k, z;\nprmt.b32 t0, {src}, 0, 0x4140;\n"
        f"prmt.b32 t1, {src}, 0, 0x4342;\nmov.b32 k, 0x7e807e80;\n"
        "mov.b32 z, 0x80008000;\n"
        + "".join(
            (_E2M1_HALF + (_E2M1_SCALE if scaled else _E2M1_TO_F32)).format(
                t=t, nib=nib, mul=mul, out=out, out2=out2, sc=sc
            )
            for t, sc, pairs in outs
            for (nib, mul), (out, out2) in zip(
                (("0x000f000f", "0x1040"), ("0x00f000f0", "0x104")), pairs
            )
        )
        + "}"
    )


_E2M1_ASM = tl.constexpr(_e2m1_asm(scaled=True))
# The bare values as fp32 (no scale): where the caller multiplies each 32-element group's dot by
# its scale in fp32 (the routed-expert GEMV, exact over the whole ue8m0 range).
_E2M1_BARE_ASM = tl.constexpr(_e2m1_asm(scaled=False))


@triton.jit
def e2m1_pairs_to_bf16(codes, scale_byte):
    """MXFP4 pair bytes (uint8, low nibble = even dim) and their ue8m0 scale bytes (int32, same
    shape; per-thread runs of 4 along the last axis) -> (even, odd) bf16 values, exact (a scale
    byte 0 counts as 1, i.e. 2^-127; 255 gives inf / NaN)."""
    sbits = tl.maximum(scale_byte << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.inline_asm_elementwise(
        _E2M1_ASM,
        "=r,=r,=r,=r,r,r,r",
        [codes, sbits],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


# -- e2m1 (MXFP4 keys) -> e4m3 codes, for FP8 dots -----------------------------------------------
# An e2m1 nibble (s e1 e0 m) placed as the e4m3 byte (s 0 0 e1 e0 m 0 0) is its value times 2^-6,
# for all 16 codes (0.5 lands on the e4m3 subnormal 4 * 2^-9): no table, no rounding. The 2^6 goes
# into the block's scale on the logits. $2: four pair bytes (low nibble = even dim); $0: the four
# even dims' codes, $1: the four odd dims'. 3 + 4 ALU ops per 8 values (ptxas folds the and / or
# pairs into lop3), against ~4 per value for the bf16 decode above.
E2M1_E4M3_SHIFT = -6
_E2M1_E4M3_ASM = tl.constexpr(
    "{\n.reg .b32 a, b;\n"
    "shl.b32 a, $2, 4;\nand.b32 a, a, 0x80808080;\n"
    "shl.b32 b, $2, 2;\nand.b32 b, b, 0x1C1C1C1C;\nor.b32 $0, a, b;\n"
    "and.b32 a, $2, 0x80808080;\n"
    "shr.b32 b, $2, 2;\nand.b32 b, b, 0x1C1C1C1C;\nor.b32 $1, a, b;\n}"
)


@triton.jit
def e2m1_pairs_to_e4m3(codes, PTX: tl.constexpr):
    """MXFP4 pair bytes (uint8 [..., n], low nibble = even dim; runs of 4 per thread along the
    last axis under ``PTX``) -> the (even, odd) dims as e4m3 codes of the value * 2^-6 (exact):
    uint8 bytes from the packed asm (``PTX``) or from integer ops (the interpreter, devices
    without inline PTX); one return type for both (Triton checks every return of a function)."""
    if PTX:
        return tl.inline_asm_elementwise(
            _E2M1_E4M3_ASM, "=r,=r,r", [codes], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
    b = codes.to(tl.int32)
    even = ((b & 0x08) << 4) | ((b & 0x07) << 2)
    odd = (b & 0x80) | ((b >> 2) & 0x1C)
    return even.to(tl.uint8), odd.to(tl.uint8)


@triton.jit
def e2m1_pairs_to_f32(codes):
    """MXFP4 pair bytes (uint8, low nibble = even dim; per-thread runs of 4 along the last axis)
    -> the (even, odd) bare e2m1 values as fp32, exact (signed zeros kept)."""
    return tl.inline_asm_elementwise(
        _E2M1_BARE_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r",
        [codes],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )
