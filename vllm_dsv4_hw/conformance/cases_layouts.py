# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of the cache layouts: ``kv_insert`` bytes at hand-computed offsets (data region,
then scale region, padding intact) and ``kv_gather`` decoding, for every entry format the device
holds; ``entry_slots`` against slots computed by hand.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.conformance.cases import (
    POISON,
    Case,
    Ctx,
    _same,
    check_entries,
    entry_spans,
    poisoned_cache,
)
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api


def layout_cases(ctx: Ctx) -> list[Case]:
    """kv_insert bytes at hand-computed offsets (data region, then scale region, padding intact)
    and kv_gather decoding, for every format the device holds."""
    out = []
    combos = (
        [("main", f, 64) for f in ctx.main_formats]
        + [("main", f, 2) for f in ctx.main_formats]
        + [("indexer", f, 64) for f in ctx.indexer_formats]
    )
    for kind, name, e in combos:
        fmt = make_format(name, kind, e)
        pages = 3
        n = min(8, pages * e - 1)
        slots = ctx.randperm(pages * e)[:n]
        slots[ctx.randperm(n)[:2]] = -1
        x = ctx.rows(n, fmt.dim)
        cache = poisoned_cache(fmt, pages, ctx.device)
        # expected bytes, by hand from the codec on the CPU
        want = cache.cpu().clone()
        data, scales = fmt.quantize(x.cpu())
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                page, ds, ss = entry_spans(fmt, s)
                want[page, ds] = data[i]
                want[page, ss] = scales[i]
        fname = fmt.name
        label = f"{kind} {fname} E={e}"

        def check_insert(res, args, want=want, fmt=fmt, x=x, fname=fname, slots=slots):
            got = args[0].cpu()
            if torch.equal(got, want):
                return True, "bytes identical to the reference codec", 0.0
            ok, detail, r = check_entries(
                got, _poisoned_like(want, fmt, slots), fmt, slots, x.double(), fname
            )
            nbytes = int((got != want).sum())
            return ok, f"{nbytes} bytes differ from the reference codec; {detail}", r

        out.append(
            Case(
                api.KV_INSERT,
                f"layout {label}",
                (cache, slots.to(ctx.device), x, fmt),
                check_insert,
                mutable=(0,),
            )
        )

        # gather from a cache written by the reference codec: exact decode, -1 -> zeros
        filled = want.to(ctx.device)
        q = slots.clone()
        q[0] = -1
        query = torch.stack([q, q.flip(0)])
        exp = torch.zeros(*query.shape, fmt.dim)
        dec = fmt.dequantize(data, scales)
        for (i, j), s in zip(
            torch.cartesian_prod(torch.arange(2), torch.arange(n)).tolist(),
            query.flatten().tolist(),
        ):
            if s >= 0:
                exp[i, j] = dec[slots.tolist().index(s)]

        def check_gather(res, args, exp=exp, fmt=fmt):
            bad = _same(res, exp.shape, torch.float32)
            if bad:
                return False, bad, float("inf")
            if torch.equal(res.cpu(), exp):
                return True, "exact decode; -1 gives zeros", 0.0
            n_bad = int((res.cpu() != exp).sum())
            return False, f"{n_bad} decoded values differ from the format's decode", float("inf")

        out.append(
            Case(
                api.KV_GATHER, f"layout {label}", (filled, query.to(ctx.device), fmt), check_gather
            )
        )
    return out


def entry_slots_cases(ctx: Ctx) -> list[Case]:
    """Selected entry indices (-1 padding, int32 as ``indexer_topk`` returns them, and int64) of
    tokens of several requests to slots, with absent (-1) pages and indices past the table: every
    slot as computed by hand, -1 where there is none."""
    out = []
    for per_page, reqs, cols, k in ((64, 3, 5, 40), (2, 2, 300, 513)):
        table = torch.randperm(reqs * cols * 2, generator=ctx.gen)[: reqs * cols].view(reqs, cols)
        table[torch.rand(reqs, cols, generator=ctx.gen) < 0.2] = -1
        t = 4
        token_req = torch.randint(0, reqs, (t,), generator=ctx.gen)
        idx = torch.randint(-1, cols * per_page + per_page, (t, k), generator=ctx.gen)
        want = torch.full((t, k), -1, dtype=torch.int64)
        for r in range(t):
            for j, i in enumerate(idx[r].tolist()):
                if 0 <= i < cols * per_page:
                    page = int(table[token_req[r], i // per_page])
                    if page >= 0:
                        want[r, j] = page * per_page + i % per_page

        def check(res, args, want=want):
            bad = _same(res, want.shape, torch.int64)
            if bad:
                return False, bad, float("inf")
            n_bad = int((res.cpu() != want).sum())
            return (
                n_bad == 0,
                "every slot as computed by hand"
                if n_bad == 0
                else f"{n_bad} of {want.numel()} slots differ",
                0.0 if n_bad == 0 else float("inf"),
            )

        for dtype in (torch.int32, torch.int64):
            out.append(
                Case(
                    api.ENTRY_SLOTS,
                    f"{t} tokens x {k} of {per_page} per page, "
                    f"{reqs} requests x {cols} pages, {str(dtype)[6:]} indices",
                    (
                        table.to(torch.int32).to(ctx.device),
                        token_req.to(ctx.device),
                        idx.to(dtype).to(ctx.device),
                        per_page,
                    ),
                    check,
                )
            )
    return out


def _poisoned_like(want, fmt, slots):
    """The cache before the insert: want with the written entries reset to poison."""
    before = want.clone()
    for s in slots.tolist():
        if s >= 0:
            page, ds, ss = entry_spans(fmt, s)
            before[page, ds] = POISON
            before[page, ss] = POISON
    return before
