# SPDX-License-Identifier: Apache-2.0
"""Float64 oracle of the DeepSeek V4 compressor, written from the spec (section 3) alone.

One request, one-shot: the whole token sequence at once; explicit Python loops per entry and per
member token. Nothing here touches the project's code.

    c_p = kv[p], z_p = score[p] + ape[p mod ratio]
    ratio 128: e_i = sum_{p=128i}^{128i+127} softmax_p(z_p) * c_p      (per channel)
    ratio 4:   softmax per channel over 8 rows: channels [0,d) of tokens 4i-4..4i-1 and
               channels [d,2d) of tokens 4i..4i+3; tokens before 0 are absent (kv 0, gate -inf)
    then RMSNorm_w(e_i), RoPE (GPT-J interleaved pairs, last R dims) at position ratio*i.
Entry i exists once token ratio*i + ratio - 1 has been seen.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def num_entries(seq_len: int, ratio: int) -> int:
    """Entries i with ratio*i + ratio - 1 <= seq_len - 1."""
    return seq_len // ratio


def pooled_entries(
    kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int
) -> torch.Tensor:
    """kv, score [N, coff*d] (score without ape), ape [ratio, coff*d] -> [N // ratio, d] float64."""
    kv = kv.to(F64)
    score = score.to(F64)
    ape = ape.to(F64)
    n_tok, width = kv.shape
    overlap = ratio == 4
    d = width // 2 if overlap else width
    out = torch.zeros(num_entries(n_tok, ratio), d, dtype=F64)
    for i in range(out.shape[0]):
        members = []  # (kv channels, gate channels) of each member row
        if overlap:
            for p in range(4 * i - 4, 4 * i):  # previous group: first half of the channels
                if p >= 0:
                    members.append((kv[p, :d], score[p, :d] + ape[p % ratio, :d]))
                # p < 0: absent -> weight exp(-inf) = 0, contributes nothing
            for p in range(4 * i, 4 * i + 4):  # own group: second half
                members.append((kv[p, d:], score[p, d:] + ape[p % ratio, d:]))
        else:
            for p in range(ratio * i, ratio * i + ratio):
                members.append((kv[p], score[p] + ape[p % ratio]))
        gates = torch.stack([z for _, z in members])  # [M, d]
        vals = torch.stack([c for c, _ in members])  # [M, d]
        m = gates.max(dim=0).values
        w = torch.exp(gates - m)
        out[i] = (w * vals).sum(dim=0) / w.sum(dim=0)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.to(F64)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        rms = math.sqrt(float((x[i] * x[i]).mean()) + eps)
        out[i] = x[i] / rms
    if weight is not None:
        out = out * weight.to(F64)
    return out


def rope_rows(x: torch.Tensor, positions: list[int], cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) of the last R dims of each row by angle j of table row pos.

    cos_sin [P, R]: cos of the R/2 angles then their sin (the table is an input, like the op's).
    """
    x = x.to(F64).clone()
    r = cos_sin.shape[1]
    half = r // 2
    dim = x.shape[1]
    for row, p in enumerate(positions):
        c = cos_sin[p, :half].to(F64)
        s = cos_sin[p, half:].to(F64)
        a = x[row, dim - r :: 2].clone()  # even members of the pairs
        b = x[row, dim - r + 1 :: 2].clone()  # odd members
        x[row, dim - r :: 2] = a * c - b * s
        x[row, dim - r + 1 :: 2] = a * s + b * c
    return x


def stored_entries(kv, score, ape, ratio, norm_weight, eps, cos_sin) -> torch.Tensor:
    """Pooled -> RMSNorm_w -> RoPE at ratio*i: the vectors the cache should hold, float64."""
    e = pooled_entries(kv, score, ape, ratio)
    e = rms_norm(e, norm_weight, eps)
    return rope_rows(e, [ratio * i for i in range(e.shape[0])], cos_sin)
