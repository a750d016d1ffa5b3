# SPDX-License-Identifier: Apache-2.0
"""Peer rows for the cache ops: KV insert (fp8_ds_mla), KV gather, Q norm + RoPE + window insert."""

from __future__ import annotations

import torch

from benchmarks.peer import oracles, upstream
from benchmarks.peer.run import Row

E = 64  # entries per page on both sides (upstream's SWA / c4a block of 64 tokens)
D = 512


def _fmt():
    from vllm_dsv4_hw.kv_cache.formats import make_format

    return make_format("fp8_ds_mla", "main", E)


def _rows(n: int, device, gen) -> torch.Tensor:
    x = torch.randn(n, D, generator=gen)
    mag = torch.exp2(torch.empty(n, 1).uniform_(-3, 3, generator=gen))
    return (x * mag).to(torch.bfloat16).to(device)


def kv_insert_rows(device, sizes, gen) -> list[Row]:
    from vllm_dsv4_hw import ops

    fmt = _fmt()
    up = upstream.kernel("quantize_and_insert_k_cache")
    out = []
    for n in sizes:
        pages = n // E + 2
        x = _rows(n, device, gen)
        slots = torch.randperm(pages * E, generator=gen)[:n].to(device)
        ours_c = fmt.new_cache(pages, device=device)
        up_c = fmt.new_cache(pages, device=device)
        slots64 = slots.to(torch.int64)

        def run_ours():
            ops.kv_insert(ours_c, slots, x, fmt)

        def run_up():
            up(x, up_c, slots64, block_size=E)

        row = Row("kv_insert", f"fp8_ds_mla N={n}")
        row.time(run_ours, run_up, device)
        run_ours(), run_up()
        want = x.double()
        row.errors(
            "entries",
            oracles.rel_err(oracles.entries(ours_c, slots, fmt), want),
            oracles.rel_err(oracles.entries(up_c, slots, fmt), want),
            tol=2**-4,
        )
        same = bool(torch.equal(ours_c, up_c))
        row.note = "caches byte-identical" if same else "caches differ in bytes"
        out.append(row)
    return out


def kv_gather_rows(device, cases, gen) -> list[Row]:
    """Gather the last L entries of R requests through a block table (upstream's contiguous-sequence
    gather; ours takes the same positions as slots)."""
    from vllm_dsv4_hw import ops

    fmt = _fmt()
    up = upstream.kernel("dequantize_and_gather_k_cache")
    out = []
    for reqs, seq in cases:
        blocks = (seq + E - 1) // E
        pages = reqs * blocks + 1
        cache = fmt.new_cache(pages, device=device)
        ops.kv_insert(
            cache, torch.arange(pages * E, device=device), _rows(pages * E, device, gen), fmt
        )
        table = torch.randperm(pages, generator=gen)[: reqs * blocks].view(reqs, blocks)
        table = table.to(torch.int32).to(device)
        pos = torch.arange(seq, device=device)
        slots = table[:, pos // E].long() * E + pos % E
        seq_lens = torch.full((reqs,), seq, dtype=torch.int32, device=device)
        up_out = torch.empty(reqs, seq, D, dtype=torch.bfloat16, device=device)
        up_cache = cache.view(pages, E, -1) if cache.shape[1] == E * fmt.entry_bytes else cache

        def run_ours():
            return ops.kv_gather(cache, slots, fmt)

        def run_up():
            up(up_out, up_cache, seq_lens, None, table, E, 0)

        row = Row("kv_gather", f"fp8_ds_mla {reqs} x {seq}")
        row.time(run_ours, run_up, device)
        run_up()
        want = oracles.entries(cache, slots, fmt)
        row.errors(
            "rows", oracles.rel_err(run_ours(), want), oracles.rel_err(up_out, want), tol=2**-7
        )
        row.note = "ours fp32 out, upstream bf16 out"
        out.append(row)
    return out


def qnorm_rope_insert_rows(device, sizes, gen, table, heads=64, eps=1e-6) -> list[Row]:
    from vllm_dsv4_hw import ops

    fmt = _fmt()
    up = upstream.kernel("qnorm_rope_kv_fp8_insert")
    rope = oracles.ref("rope")
    norm = oracles.ref("rms_norm")
    out = []
    for n in sizes:
        pages = n // E + 2
        q = _rows(n * heads, device, gen).view(n, heads, D)
        kv = _rows(n, device, gen)
        pos = torch.randint(0, table.shape[0], (n,), generator=gen).to(device)
        slots = torch.randperm(pages * E, generator=gen)[:n].to(device)
        ours_c, up_c = (fmt.new_cache(pages, device=device) for _ in range(2))
        up_q = q.clone()
        slots64, pos64 = slots.long(), pos.long()

        def run_ours():
            return ops.qnorm_rope_kv_insert(q, kv, pos, table, eps, ours_c, slots, fmt)

        def run_up():  # rotates its q in place (re-made from q before the checked call)
            up(up_q, kv, up_c, slots64, pos64, table, eps, E)

        row = Row("qnorm_rope_kv_insert", f"fp8_ds_mla T={n} H={heads}")
        row.time(run_ours, run_up, device)
        q_ours = run_ours()
        up_q.copy_(q)
        run_up()
        t64 = table.double()
        q_want = rope(norm(q.double(), None, eps), pos, t64)
        kv_want = rope(kv.double(), pos, t64)
        row.errors("q", oracles.rel_err(q_ours, q_want), oracles.rel_err(up_q, q_want), tol=2**-7)
        row.errors(
            "entries",
            oracles.rel_err(oracles.entries(ours_c, slots, fmt), kv_want),
            oracles.rel_err(oracles.entries(up_c, slots, fmt), kv_want),
            tol=2**-4,
        )
        row.note = "upstream: its XPU variant (Triton), q rotated in place"
        out.append(row)
    return out
