# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of ``sparse_attention``: c4a (top-k compressed candidates) and c128a (every
visible entry) layers over window and compressed caches full of random bytes, for every main
format the device holds; the oracle is the reference on float64 copies.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import Case, Ctx, _same, _verdict
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.kinds import C4A, C128A
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import sparse_attention as ref_sa


def _garbage_cache(ctx: Ctx, fmt, rows: torch.Tensor, spare: int = 2, pad: int = 96):
    """Rows at random distinct slots of a cache full of random bytes -> (cache, slot of row)."""
    e = fmt.entries_per_page
    m = rows.shape[0]
    pages = (m + e - 1) // e + spare
    cache = torch.randint(
        0, 256, (pages, fmt.min_page_bytes + pad), generator=ctx.gen, dtype=torch.uint8
    )
    slots = ctx.randperm(pages * e)[:m]
    paged.insert_rows(cache, slots, rows.cpu(), fmt)
    return cache.to(ctx.device), slots


def sparse_attention_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    t, h, dim = d.tokens, d.heads, d.head_dim
    out = []
    pos = torch.tensor(d.positions)
    for main in ctx.main_formats:
        for kind in (C4A, C128A):
            wf = make_format(main, "main", 64)
            cf = make_format(main, "main", BLOCK_POSITIONS // kind.ratio)
            nwin = d.window + 8
            wrows = ctx.rows(nwin, dim, torch.float32, -1, 1)
            visible = (pos + 1) // kind.ratio
            k = d.topk if kind.has_indexer else int(visible.max())
            ncomp = max(k, 1) + 4
            crows = ctx.rows(ncomp, dim, torch.float32, -1, 1)
            wc, wslot = _garbage_cache(ctx, wf, wrows)
            cc, cslot = _garbage_cache(ctx, cf, crows)
            # window: the last min(pos + 1, W) positions (distinct rows), -1 before position 0
            wi = torch.stack([ctx.randperm(nwin)[: d.window] for _ in range(t)])
            wvalid = torch.arange(d.window)[None, :] < (pos + 1).clamp(max=d.window)[:, None]
            ws = torch.where(wvalid, wslot[wi], -1)
            # compressed: min(k, visible) distinct entries, -1 after
            ci = torch.stack([ctx.randperm(ncomp)[:k] for _ in range(t)])
            cvalid = torch.arange(k)[None, :] < visible.clamp(max=k)[:, None]
            cs = torch.where(cvalid, cslot[ci], -1)
            q = ctx.randn(t, h, dim, dtype=torch.bfloat16)
            sink = ctx.randn(h, scale=2.0)
            scale = dim**-0.5
            args = (q, wc, ws.to(ctx.device), cc, cs.to(ctx.device), wf, sink, scale)
            want = ref_sa.sparse_attention(*(ctx.to_oracle(a) for a in args), comp_fmt=cf)

            def check(res, args, want=want, q=q):
                bad = _same(res, q.shape, q.dtype)
                if bad:
                    return False, bad, float("inf")
                return _verdict(
                    ratio(res.to(want.device), want, dense_bound(want, q.dtype, 1e-2, rtol=2**-6))
                )

            out.append(
                Case(
                    api.SPARSE_ATTENTION,
                    f"{kind.name} {wf.name} bf16 T {t} H {h} W {d.window} K {k}",
                    args,
                    check,
                    kwargs={"comp_fmt": cf},
                )
            )
    return out
