# SPDX-License-Identifier: Apache-2.0
"""The packed PTX e4m3 decode (``ops.triton.ptx_codecs``) checked without a GPU: its assembly text,
run instruction by instruction by a small emulator of the six PTX instructions it uses, decodes
every finite e4m3 code exactly as torch does (bf16 and fp16 outputs), signs and zeros included;
which devices select it. On the H200 the GPU tier compares it bit for bit with the hardware cvt
(``benchmarks/gpu/weights.py``: a weight of every code, decode and prefill tiles)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from vllm_dsv4_hw.ops.triton.common import ptx_codecs  # noqa: E402
from vllm_dsv4_hw.platform.capabilities import CPU, NPU_A2_A3, cuda_capabilities  # noqa: E402

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 0x7]
        if nib & 0x8:  # sign-replicate mode: the selected byte's msb through all 8 bits
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _lanes(word: int, dtype: torch.dtype) -> list[float]:
    halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return halves.view(dtype).double().tolist()


def _pack(values: list[float], dtype: torch.dtype) -> int:
    h = torch.tensor(values, dtype=torch.float64).to(dtype).view(torch.int16).int() & 0xFFFF
    return int(h[0]) | int(h[1]) << 16


def _exec(asm: str, inputs: dict[str, int], outputs: tuple[str, ...]) -> tuple[int, ...]:
    """Execute inline PTX on 32-bit input registers; returns the output registers."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else int(tok) if tok.isdigit() else regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [t.strip() for t in rest.split(",")]
        v = [val(t) for t in args]
        if op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "mul.lo.u32":
            regs[dst] = (v[0] * v[1]) & MASK32
        elif op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & MASK32
        elif op == "mov.b32":
            regs[dst] = v[0]
        elif op == "prmt.b32":
            regs[dst] = _prmt(v[0], v[1], v[2])
        elif op.startswith("fma.rn."):  # packed: exact products of powers of two, then rounded
            dt = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            a, b, c = (_lanes(x, dt) for x in v)
            regs[dst] = _pack([a[i] * b[i] + c[i] for i in range(2)], dt)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it with the asm")
    return tuple(regs[o] for o in outputs)


def _run(asm: str, word: int) -> tuple[int, int]:
    """The e4m3 decode's PTX on one 32-bit input ($2); returns ($0, $1)."""
    return _exec(asm, {"$2": word}, ("$0", "$1"))


@pytest.mark.parametrize(
    "dtype,asm",
    [(torch.bfloat16, ptx_codecs._ASM_BF16.value), (torch.float16, ptx_codecs._ASM_F16.value)],
)
def test_every_finite_code_decodes_exactly(dtype, asm):
    codes = list(range(256))
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype)
    got = []
    for i in range(0, 256, 4):
        lo, hi = _run(asm, codes[i] | codes[i + 1] << 8 | codes[i + 2] << 16 | codes[i + 3] << 24)
        got += [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
    got = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.tensor([(c & 0x7F) != 0x7F for c in codes])
    # bit patterns, so -0.0 against +0.0 and every subnormal count
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    # the NaN codes (never in a shipped checkpoint) come out as -+480, as documented
    assert got[~finite].double().tolist() == [480.0, -480.0]


def _e2m1(code: int) -> float:
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][code & 7]
    return -mag if code & 8 else mag


@pytest.mark.parametrize("scale_byte", [1, 120, 127, 128, 134, 200, 254])
def test_every_e2m1_pair_byte_decodes_exactly(scale_byte):
    """``e2m1_pairs_to_bf16``'s assembly: every pair byte (both nibbles, signed zeros included)
    times the block's ue8m0 scale, bit for bit as bf16, at scales from 2^-126 to 2^127."""
    asm = ptx_codecs._E2M1_ASM.value
    sbits = max(scale_byte << 7, 0x40)
    pair = sbits | sbits << 16
    got_e, got_o = [], []
    for i in range(0, 256, 4):
        word = i | (i + 1) << 8 | (i + 2) << 16 | (i + 3) << 24
        e01, e23, o01, o23 = _exec(
            asm, {"$4": word, "$5": pair, "$6": pair}, ("$0", "$1", "$2", "$3")
        )
        got_e += [e01 & 0xFFFF, e01 >> 16, e23 & 0xFFFF, e23 >> 16]
        got_o += [o01 & 0xFFFF, o01 >> 16, o23 & 0xFFFF, o23 >> 16]
    scale = 2.0 ** (scale_byte - 127)

    def want(nibbles):
        v = torch.tensor([_e2m1(c) * scale for c in nibbles], dtype=torch.float64)
        bits = v.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
        neg_zero = torch.tensor([c == 8 for c in nibbles])
        return torch.where(neg_zero, 0x8000, bits).tolist()

    assert got_e == want([b & 0xF for b in range(256)])
    assert got_o == want([b >> 4 for b in range(256)])


def test_every_e2m1_pair_byte_decodes_to_its_bare_fp32_value():
    """``e2m1_pairs_to_f32``'s assembly (the routed-expert GEMV's decode): every pair byte's two
    codes as fp32 bit patterns of the format's table (0.5 and -0.0 included)."""
    asm = ptx_codecs._E2M1_BARE_ASM.value
    got_e, got_o = [], []
    for i in range(0, 256, 4):
        word = i | (i + 1) << 8 | (i + 2) << 16 | (i + 3) << 24
        out = _exec(asm, {"$8": word}, tuple(f"${r}" for r in range(8)))
        got_e += out[:4]
        got_o += out[4:]

    def want(nibbles):
        v = torch.tensor([_e2m1(c) for c in nibbles], dtype=torch.float32)
        v = torch.where(torch.tensor([c == 8 for c in nibbles]), -0.0, v)
        return (v.view(torch.int32).long() & MASK32).tolist()

    assert got_e == want([b & 0xF for b in range(256)])
    assert got_o == want([b >> 4 for b in range(256)])


def test_asm_uses_only_the_emulated_instructions():
    for asm, fma in (
        (ptx_codecs._ASM_BF16, "fma.rn.bf16x2"),
        (ptx_codecs._ASM_F16, "fma.rn.f16x2"),
    ):
        ops = set(re.findall(r"^\s*([a-z]+\.[a-z0-9.]+)\s", asm.value, re.M))
        assert ops == {"and.b32", "prmt.b32", "shl.b32", "mov.b32", fma}, ops
    ops = set(re.findall(r"^\s*([a-z]+\.[a-z0-9.]+)\s", ptx_codecs._E2M1_ASM.value, re.M))
    assert ops == {"and.b32", "prmt.b32", "mul.lo.u32", "mov.b32", "fma.rn.bf16x2"}, ops
    ops = set(re.findall(r"^\s*([a-z]+\.[a-z0-9.]+)\s", ptx_codecs._E2M1_BARE_ASM.value, re.M))
    assert ops == {"and.b32", "prmt.b32", "mul.lo.u32", "mov.b32", "fma.rn.bf16x2", "shl.b32"}


def test_which_devices_take_the_packed_decode():
    assert cuda_capabilities(8, 0).ptx_inline and cuda_capabilities(9, 0).ptx_inline
    assert cuda_capabilities(12, 0).ptx_inline
    assert not cuda_capabilities(9, 4, hip=True).ptx_inline  # ROCm: hardware cvt
    assert not CPU.ptx_inline and not NPU_A2_A3.ptx_inline
    assert ptx_codecs.e4m3_mode(torch.device("cpu")) == ptx_codecs.CVT_INT
