# SPDX-License-Identifier: Apache-2.0
"""Peer rows for the dense prologue / epilogue ops: the output's inverse RoPE + FP8 quantization,
and the indexer's query preparation."""

from __future__ import annotations

import torch

from benchmarks.peer import oracles, upstream
from benchmarks.peer.run import Row

H, D, R, GROUPS = 64, 512, 64, 8  # V4-Flash attention heads, head dim, rope dims, wo_a groups
IH, ID = 64, 128  # indexer heads and head dim


def inv_rope_rows(device, sizes, gen, table) -> list[Row]:
    from vllm_dsv4_hw import ops

    up = upstream.kernel("fused_inv_rope_fp8_quant")
    rope = oracles.ref("rope")
    out = []
    for t in sizes:
        o = (torch.randn(t, H, D, generator=gen) * 2).to(torch.bfloat16).to(device)
        pos = torch.randint(0, table.shape[0], (t,), generator=gen).to(device)
        pos64 = pos.long()

        def run_ours():
            return ops.inv_rope_fp8_quant(o, pos, table)

        def run_up():
            return up(o, pos64, table, GROUPS, H // GROUPS)

        row = Row("inv_rope_fp8_quant", f"T={t} H={H}")
        row.time(run_ours, run_up, device)
        want = rope(o.double(), pos, table.double(), True)
        q, s = run_ours()
        uq, us = run_up()  # [T, G, (H/G) D] and [T, G, (H/G) D / 128]
        up_deq = oracles.dequant_groups(uq.reshape(t, H, D), us.reshape(t, H, D // 128), 128)
        row.errors(
            "o",
            oracles.rel_err(oracles.dequant_groups(q, s, 128), want),
            oracles.rel_err(up_deq, want),
            tol=2**-4,
        )
        out.append(row)
    return out


def indexer_q_rows(device, sizes, gen, table) -> list[Row]:
    """Ours: the RoPE of q^I (the score kernel reads bf16 q). Upstream: RoPE + FP8 quantization of
    q^I with the per-(token, head) scale folded into the head weights."""
    from vllm_dsv4_hw import ops

    up = upstream.kernel("fused_indexer_q_rope_quant")
    rope = oracles.ref("rope")
    softmax_scale, head_scale = ID**-0.5, IH**-0.5
    out = []
    for t in sizes:
        q = torch.randn(t, IH, ID, generator=gen).to(torch.bfloat16).to(device)
        # head weights away from 0, so that upstream's folded q scale can be read back
        w = (torch.rand(t, IH, generator=gen) + 0.5) * torch.randn(t, IH, generator=gen).sign()
        w = w.to(torch.bfloat16).to(device)
        pos = torch.randint(0, table.shape[0], (t,), generator=gen).to(device)
        pos64 = pos.long()

        def run_ours():
            return ops.rope(q, pos, table)

        def run_up():
            return up(pos64, q, table, w, softmax_scale, head_scale)

        row = Row("indexer q prep", f"T={t} H={IH}")
        row.time(run_ours, run_up, device)
        want = rope(q.double(), pos, table.double())
        up_err = None
        if not row.upstream_reason:
            uq, uw = run_up()
            q_scale = uw.double() / (w.double() * softmax_scale * head_scale)
            up_err = oracles.rel_err(uq.double() * q_scale[..., None], want)
        row.errors("q", oracles.rel_err(run_ours(), want), up_err, tol=2**-4)
        row.note = "ours: RoPE (bf16 q to the score kernel); upstream: RoPE + FP8 q, weights folded"
        out.append(row)
    return out
