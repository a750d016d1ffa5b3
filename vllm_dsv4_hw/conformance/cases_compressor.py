# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of ``compressor_pool`` and ``compressor_store`` (c4a and c128a main entries,
c4a indexer keys): a decode batch over a paged state holding each request's live history, checked
against float64 pooling written here; state rows other than the new tokens' must stay untouched.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.attention.compressor_plan import compressor_plan
from vllm_dsv4_hw.conformance.cases import (
    EPS,
    Case,
    Ctx,
    _same,
    _verdict,
    check_entries,
    poisoned_cache,
)
from vllm_dsv4_hw.conformance.tolerances import dense_bound, ratio
from vllm_dsv4_hw.kinds import C4A, C128A, INDEXER_COMPRESSOR, AttentionKind
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import rope as ref_rope


def _compressor_setup(ctx: Ctx, kind: AttentionKind, dim: int, entry_fmt):
    """A decode batch (one token per request at the dims' positions, moved so that half the tokens
    complete a group) over a paged state holding each request's live history."""
    ratio_, coff, width = kind.ratio, kind.coff, kind.group_width
    t = ctx.dims.tokens
    base = torch.tensor(ctx.dims.positions)
    pos = torch.where(torch.arange(t) % 2 == 0, (base // ratio_) * ratio_ + ratio_ - 1, base)
    pos = pos.clamp(min=ratio_ - 1)
    rpp = 16
    # state pages: only the columns covering each request's window are allocated
    ncol = int(pos.max()) // rpp + 1
    need = [
        sorted({int(p) // rpp for p in range(max(0, int(p0) - width + 1), int(p0) + 1)})
        for p0 in pos
    ]
    npages = sum(len(c) for c in need) + 2
    perm = ctx.randperm(npages).tolist()
    sbt = torch.full((t, ncol), -1, dtype=torch.int64)
    for r, cols in enumerate(need):
        for c in cols:
            sbt[r, c] = perm.pop()
    state = torch.full((npages * rpp, kind.state_width(dim)), float("nan"))
    hist_kv = [torch.randn(int(p) + 1, coff * dim, generator=ctx.gen) for p in pos]
    hist_sc = [2.0 * torch.randn(int(p) + 1, coff * dim, generator=ctx.gen) for p in pos]
    ape = torch.randn(ratio_, coff * dim, generator=ctx.gen)
    for r, p0 in enumerate(pos.tolist()):
        for p in range(max(0, p0 - width + 1), p0):  # live history rows (not the new token)
            slot = int(sbt[r, p // rpp]) * rpp + p % rpp
            state[slot] = torch.cat([hist_kv[r][p], hist_sc[r][p] + ape[p % ratio_]])
    # compressed-entry cache: pages only for the entries completed now
    e = entry_fmt.entries_per_page
    ecol = int(pos.max()) // ratio_ // e + 1
    kbt = torch.full((t, ecol), -1, dtype=torch.int64)
    kpages = ctx.randperm(t + 2)
    for r, p0 in enumerate(pos.tolist()):
        kbt[r, ((p0 + 1) // ratio_ - 1) // e] = int(kpages[r])
    qsl = torch.arange(t + 1, dtype=torch.int32)
    plan = compressor_plan(qsl, pos, sbt, rpp, ratio_, kbt, e)
    kv = torch.stack([hist_kv[r][-1] for r in range(t)])
    sc = torch.stack([hist_sc[r][-1] for r in range(t)])
    # float64 pooling oracle of every completed group
    g = plan.num_groups
    pooled = torch.zeros(g, dim, dtype=torch.float64)
    for gi in range(g):
        r, i = int(plan.group_req[gi]), int(plan.group_entry_index[gi])
        kvr, scr = hist_kv[r].double(), hist_sc[r].double()
        members = [ratio_ * i + ratio_ - width + j for j in range(width)]
        kvm = torch.zeros(width, dim, dtype=torch.float64)
        scm = torch.full((width, dim), float("-inf"), dtype=torch.float64)
        for j, p in enumerate(members):
            if p < 0:
                continue
            blk = j // ratio_  # coff 2: previous group -> channels [0, d), own -> [d, 2d)
            kvm[j] = kvr[p, blk * dim : (blk + 1) * dim]
            scm[j] = (
                scr[p, blk * dim : (blk + 1) * dim] + ape[p % ratio_, blk * dim : (blk + 1) * dim]
            )
        pooled[gi] = (torch.softmax(scm, dim=0) * kvm).sum(0)
    new_rows = torch.cat([kv, sc + ape[pos % ratio_]], dim=-1)
    return dict(
        pos=pos,
        state=state,
        ape=ape,
        plan=plan,
        kv=kv,
        sc=sc,
        pooled=pooled,
        new_rows=new_rows,
        kbt=kbt,
        pool_pages=t + 2,
    )


def _check_state(state_after, state_before, plan, new_rows) -> tuple[bool, str]:
    sa, sb = state_after.cpu(), state_before.cpu()
    slots = plan.state_slots.cpu()
    live = slots[slots >= 0]
    if not torch.equal(sa[live], new_rows[slots >= 0]):
        err = float((sa[live] - new_rows[slots >= 0]).abs().max())
        return False, f"state rows of the new tokens differ (max err {err:.3g})"
    mask = torch.ones(sa.shape[0], dtype=torch.bool)
    mask[live] = False
    if not torch.equal(sa[mask].view(torch.int32), sb[mask].view(torch.int32)):
        return False, "state rows other than the new tokens' changed"
    return True, "state rows ok"


def compressor_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    out = []
    for compressor, dim, kind, fmt_name in (
        (C4A, d.head_dim, "main", ctx.main_fmt),
        (C128A, d.head_dim, "main", ctx.main_fmt),
        (INDEXER_COMPRESSOR, d.index_dim, "indexer", ctx.indexer_fmt),
    ):
        label, ratio_ = f"{compressor.name} {kind}", compressor.ratio
        fmt = make_format(fmt_name, kind, BLOCK_POSITIONS // ratio_)
        s = _compressor_setup(ctx, compressor, dim, fmt)
        plan = s["plan"]
        dev = ctx.device
        state = s["state"].to(dev)
        common = (
            s["kv"].to(dev),
            s["sc"].to(dev),
            s["pos"].to(dev),
            s["ape"].to(dev),
            state,
            plan.state_slots.to(dev),
            plan.group_rows.to(dev),
            ratio_,
        )
        g = plan.num_groups

        def check_pool(res, args, s=s, state=state, g=g, dim=dim):
            bad = _same(res, (g, dim), torch.float32)
            if bad:
                return False, bad, float("inf")
            ok_s, why = _check_state(args[4], state, s["plan"], s["new_rows"])
            want = s["pooled"]
            r = ratio(res.cpu(), want, dense_bound(want, torch.float32, 1e-5))
            ok, detail, r = _verdict(r)
            return ok and ok_s, f"{detail}; {why}", r if ok_s else float("inf")

        out.append(
            Case(
                api.COMPRESSOR_POOL,
                f"{label} ratio {ratio_} d {dim}: {g} of {d.tokens} tokens complete a group",
                common,
                check_pool,
                mutable=(4,),
            )
        )

        # store: pool + RMSNorm_w + RoPE at ratio * i + quantize into the entry cache
        norm_w = 1.0 + 0.2 * torch.randn(dim, generator=ctx.gen)
        entries = s["pooled"]
        normed = (
            entries / torch.sqrt(entries.square().mean(-1, keepdim=True) + EPS) * norm_w.double()
        )
        rpos = plan.group_entry_index.cpu() * ratio_
        want = ref_rope.rope(normed, rpos, ctx.table.cpu())
        cache = poisoned_cache(fmt, s["pool_pages"], dev)
        args = common + (
            norm_w.to(dev),
            EPS,
            ctx.table,
            plan.group_entry_index.to(dev),
            cache,
            plan.cache_slots.to(dev),
            fmt,
        )

        def check_store(res, args, s=s, state=state, cache=cache, fmt=fmt, want=want, plan=plan):
            ok_s, why = _check_state(args[4], state, plan, s["new_rows"])
            ok, detail, r = check_entries(
                args[12], cache, fmt, plan.cache_slots.cpu(), want, fmt.name
            )
            return ok and ok_s, f"{detail}; {why}", r if ok_s else float("inf")

        out.append(
            Case(
                api.COMPRESSOR_STORE,
                f"{label} -> {fmt.name}, {g} entries",
                args,
                check_store,
                mutable=(4, 12),
            )
        )
    return out
