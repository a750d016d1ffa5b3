# SPDX-License-Identifier: Apache-2.0
"""Host-side launch rules of the Triton indexer (``indexer``): the dots' mode of a call and q as
the kernel reads it, the key decode, the keys as the dots' A operand, programs per call, entry
blocks per program, tokens scored together, the decode tile's register cap. Plain Python: what
the score kernel is launched with, not the kernel."""

from __future__ import annotations

import torch

from vllm_dsv4_hw.ops.triton.common import quant
from vllm_dsv4_hw.ops.triton.common.launch import capabilities, program_cap, sm_count
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_INT, CVT_PTX, e4m3_mode

DOT_F32 = 0
DOT_BF16 = 1
DOT_BF16X2 = 2
DOT_FP8 = 3  # e4m3 q codes x e4m3 keys (MXFP4 placed exactly, fp8 as stored) on FP8 dots
DOT_FP8_EMU = 4  # the same program with fp32 ``ieee`` dots and integer decodes (interpreter)
MX_DIMS = 32  # MXFP4: dims per ue8m0 scale (the score kernel's ``_MX_BLOCK``)


def _grid(n: int, device: torch.device, cube: bool = False) -> int:
    """Programs for ``n`` units of work: one each, capped by the device (``launch.program_cap``)."""
    return max(1, min(n, program_cap(device, cube)))


def _key_decode(fmt_code: int, dot: int, device: torch.device) -> int:
    """MXFP4 keys into bf16 dots: the packed PTX e2m1 decode where the device declares inline
    PTX (``ptx_codecs``: exact, the same bf16 keys); else the integer decode (``CVT_INT``)."""
    if fmt_code != quant.FMT_MXFP4 or dot in (DOT_F32, DOT_FP8_EMU):
        return CVT_INT
    return CVT_PTX if e4m3_mode(device) == CVT_PTX else CVT_INT


def _dot_mode(q: torch.Tensor, fmt_code: int) -> int:
    """The dots of a call. e4m3 q codes (``q_scales``) meet MXFP4 keys of head dim 128 or fp8
    keys on FP8 dots where the device has them (``fp8_dot``), in the interpreter on the same
    program with fp32 dots; any other e4m3 q is scored as its exact bf16 / fp32 values."""
    cpu = q.device.type == "cpu"
    if q.dtype == torch.float8_e4m3fn and (
        fmt_code == quant.FMT_FP8_INDEXER
        or (fmt_code == quant.FMT_MXFP4 and q.shape[-1] == 4 * MX_DIMS)
    ):
        if cpu:
            return DOT_FP8_EMU
        if capabilities(q.device).fp8_dot:
            return DOT_FP8
    if cpu or fmt_code == quant.FMT_FP32:
        return DOT_F32  # interpreter (bf16 dots are wrong there) / fp32 keys
    return DOT_BF16 if q.dtype in (torch.bfloat16, torch.float8_e4m3fn) else DOT_BF16X2


def _q_operand(q: torch.Tensor, dot: int) -> torch.Tensor:
    """q as the kernel reads it: e4m3 codes as they lie for FP8 dots, else their exact values
    (bf16 on a GPU, fp32 in the interpreter, which has no fp8 loads)."""
    if q.dtype != torch.float8_e4m3fn or dot == DOT_FP8:
        return q
    return q.to(torch.float32 if dot in (DOT_F32, DOT_FP8_EMU) else torch.bfloat16)


# Register cap of the decode tile (one token per program, MXFP4 keys on bf16 dots) for grids of
# at least ``from_programs_per_sm`` programs per SM: 114 registers hold 4 programs on an SM, 80
# hold 6, which the instruction-issue-bound loop turns into speed where the grid is many waves
# deep, and loses where it is not (evidence: docs/tuning.md, Indexer score pass register cap).
REG_CAP = {"maxnreg": 80, "from_programs_per_sm": 32}


def _reg_cap(programs: int, tb: int, fmt_code: int, dot: int, device: torch.device) -> dict:
    """The decode tile's register cap for a grid of ``programs`` (``REG_CAP``), as launch
    options."""
    if (
        device.type != "cuda"
        or tb != 1
        or fmt_code != quant.FMT_MXFP4
        or dot != DOT_BF16
        or programs < REG_CAP["from_programs_per_sm"] * sm_count(device)
    ):
        return {}
    return {"maxnreg": REG_CAP["maxnreg"]}


def _launch_config(num_tokens: int, n_blocks: int, device: torch.device) -> int:
    """ITERS: entry blocks per program (amortizes the q load; keeps >= ~4 programs per SM)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    want = max(1, (num_tokens * n_blocks) // (4 * sms))
    iters = 1
    while iters * 2 <= min(want, 16):
        iters *= 2
    return iters


# Tokens scored together (one key tile read and dequantized for all of them) from this many tokens
# in a call on (prefill chunks; decode batches keep one token per program): 4 tokens beat 1, 2
# and 8 at prefill (evidence: docs/tuning.md, Indexer score pass token groups).
GROUP_TOKENS = {"from_tokens": 512, "tokens": 4}


def _tokens_per_program(t: int) -> int:
    return GROUP_TOKENS["tokens"] if t >= GROUP_TOKENS["from_tokens"] else 1
