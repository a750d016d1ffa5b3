# SPDX-License-Identifier: Apache-2.0
"""Conformance cases of ``decode_metadata``: the graph-safe decode metadata of every layer kind
against the general builder (``attention.metadata.build_step_metadata``) of the same step.

Block tables are vLLM's (page ids >= 1, the null block 0 for released pages), the decode positions
cross entry completions (p % 4 == 3, p % 128 == 127) and a padding row (seq_len 0) closes each
batch. Exact integer equality is required (the plans padded to one group per row: the builder's
groups at their completing tokens, -1 elsewhere).
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.attention.metadata import BlockTables, PageGeometry, build_step_metadata
from vllm_dsv4_hw.conformance.cases import Case, Ctx
from vllm_dsv4_hw.kinds import KINDS
from vllm_dsv4_hw.ops import api

_GEOM = {
    0: PageGeometry(),
    4: PageGeometry(comp_entries_per_page=64, main_state_rows_per_page=8),
    128: PageGeometry(comp_entries_per_page=2),
}
_PER = {
    "window": "window_positions_per_page",
    "main_state": "main_state_rows_per_page",
    "indexer_state": "indexer_state_rows_per_page",
}


def _positions_per_page(geom: PageGeometry, cache: str, ratio: int) -> int:
    if cache == "comp":
        return geom.comp_entries_per_page * ratio
    if cache == "indexer":
        return geom.indexer_entries_per_page * 4
    return getattr(geom, _PER[cache])


def _fields(meta, n: int) -> dict[str, torch.Tensor]:
    out = {
        "positions": meta.positions,
        "window_insert_slots": meta.window_insert_slots,
        "window_slots": meta.window_slots,
    }
    if meta.comp_slots is not None:
        out["comp_slots"] = meta.comp_slots
    for name in ("main_plan", "indexer_plan"):
        plan = getattr(meta, name)
        if plan is not None:
            out[f"{name}.state_slots"] = plan.state_slots
    return {k: v[:n].cpu() for k, v in out.items()}


def decode_metadata_cases(ctx: Ctx) -> list[Case]:
    from vllm_dsv4_hw.attention.decode_metadata import decode_layout

    positions = sorted(set(ctx.dims.positions) | {3, 127, 255})
    n = len(positions)
    max_pos = max(positions) + 256
    out = []
    for ratio, kind in KINDS.items():
        geom = _GEOM[ratio]
        raw = {}
        for cache in kind.caches:
            cols = -(-max_pos // _positions_per_page(geom, cache, ratio))
            perm = ctx.randperm((n + 1) * cols)[: (n + 1) * cols] + 1
            raw[cache] = perm.view(n + 1, cols).to(torch.int32)
        seq_lens = torch.tensor([p + 1 for p in positions] + [0])
        layout = decode_layout(ratio, geom, ctx.dims.window, max_pos, null_page=0)
        tables = BlockTables(**{k: v[:n].to(torch.int64) for k, v in raw.items()})
        want_meta = build_step_metadata(
            positions,
            [1] * n,
            ratio,
            tables,
            geom,
            ctx.dims.window,
            max_comp_entries=layout.max_comp_entries or None,
        )
        want = _fields(want_meta, n)
        args = (seq_lens.to(ctx.device), {k: v.to(ctx.device) for k, v in raw.items()}, layout)

        def check(res, args, want=want, want_meta=want_meta, kind=kind):
            got = {
                k: res[k][:n].cpu() for k in ("positions", "window_insert_slots", "window_slots")
            }
            if "comp_slots" in want:
                got["comp_slots"] = res["comp_slots"][:n].cpu()
            for name, key in (("main_plan", "main"), ("indexer_plan", "indexer")):
                if f"{name}.state_slots" in want:
                    got[f"{name}.state_slots"] = res[f"{key}.state_slots"][:n].cpu()
                    plan = getattr(want_meta, name)
                    cs = res[f"{key}.cache_slots"].cpu()
                    tok = torch.nonzero(cs[:n] >= 0).squeeze(1)
                    if not torch.equal(tok, plan.group_token.cpu()):
                        return (
                            False,
                            f"{key}: groups at tokens {tok.tolist()}, want "
                            f"{plan.group_token.tolist()}",
                            float("inf"),
                        )
                    rows = res[f"{key}.group_rows"].cpu()
                    if not (
                        torch.equal(rows[tok], plan.group_rows.cpu())
                        and torch.equal(cs[tok], plan.cache_slots.cpu())
                        and bool((rows[:n][cs[:n] < 0] == -1).all())
                    ):
                        return False, f"{key}: group rows / cache slots differ", float("inf")
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            last = res["window_slots"][n:].cpu()
            if bad:
                return False, f"differs from build_step_metadata: {bad}", float("inf")
            if not bool((last == -1).all()) or int(res["window_insert_slots"][n]) != -1:
                return False, "padding row reads or writes a slot", float("inf")
            return True, f"{kind.name}: {n} rows equal the general builder's + padding", 0.0

        out.append(Case(api.DECODE_METADATA, f"{kind.name}, {n} rows + 1 padding", args, check))
    return out
