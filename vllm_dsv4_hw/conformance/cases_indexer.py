# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of ``indexer_topk``: the selection, checked as a set against float64 scores
computed here (keys past the visible ones are planted large, so reading one shows).
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import Case, Ctx, _same, _verdict
from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights


def indexer_topk_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    t, hi, di, topk = d.tokens, d.index_heads, d.index_dim, d.topk
    out = []
    ratio_ = INDEXER_COMPRESSOR.ratio
    e = BLOCK_POSITIONS // ratio_
    for name in ctx.indexer_formats:
        fmt = make_format(name, "indexer", e)
        pos = torch.tensor(d.positions)
        visible = (pos + 1) // ratio_
        nb = int(visible.max()) // e + 1
        pool = t * nb + 3
        bt = ctx.randperm(pool)[: t * nb].view(t, nb).to(torch.int32)
        cache = fmt.new_cache(pool)
        # every slot first holds a large key: reading an entry the token must not see shows
        everything = torch.arange(pool * e)
        paged.insert_rows(
            cache, everything, 30.0 * torch.randn(pool * e, di, generator=ctx.gen), fmt
        )
        keys = []
        for r in range(t):
            n = int(visible[r]) + 2  # two entries past the visible ones
            s = torch.arange(n)
            slots = paged.logical_to_slot(bt, torch.full_like(s, r), s, e)
            paged.insert_rows(cache, slots, torch.randn(n, di, generator=ctx.gen), fmt)
            keys.append(paged.gather_rows(cache, slots, fmt).double())
        q = ctx.randn(t, hi, di, dtype=torch.bfloat16)
        w = indexer_head_weights(torch.randn(t, hi, generator=ctx.gen), hi, di).to(ctx.device)
        q64, w64 = q.cpu().double(), w.cpu().double()
        scores = []
        for r in range(t):
            kk = keys[r][: int(visible[r])]
            scores.append(torch.einsum("hd,sd->hs", q64[r], kk).relu().T @ w64[r])

        def check(res, args, scores=scores, visible=visible):
            bad = _same(res, (t, topk), torch.int32)
            if bad:
                return False, bad, float("inf")
            res = res.cpu()
            worst = 0.0
            for r in range(t):
                k = min(topk, int(visible[r]))
                sel = res[r].tolist()
                head, tail = sel[:k], sel[k:]
                if any(v != -1 for v in tail):
                    return False, f"token {r}: expected -1 after {k} entries", float("inf")
                if len(set(head)) != k or any(v < 0 or v >= int(visible[r]) for v in head):
                    return False, f"token {r}: {k} distinct visible entries expected", float("inf")
                if k == 0:
                    continue
                sc = scores[r]
                kth = float(torch.topk(sc, k).values[-1])
                tol = 1e-3 * (1.0 + float(sc.abs().max()))
                low = float(sc[torch.tensor(head)].min())
                worst = max(worst, max(0.0, kth - low) / tol)
            return _verdict(worst, "selection (as a set) ")

        out.append(
            Case(
                api.INDEXER_TOPK,
                f"{fmt.name} keys, Hi {hi} x {di}, top-{topk}, visible "
                f"{int(visible.min())}..{int(visible.max())}",
                (
                    q,
                    w,
                    cache.to(ctx.device),
                    fmt,
                    bt.to(ctx.device),
                    torch.arange(t, device=ctx.device),
                    pos.to(ctx.device),
                    topk,
                    ratio_,
                ),
                check,
            )
        )
    return out
