"""Decode-step metadata with fixed shapes and no host synchronization (CUDA-graph safe).

``build_step_metadata`` (vllm_dsv4_hw.attention.metadata) is the general builder for varlen steps; it
checks pages on the host (``.item()``, ``bool(tensor)``) and sizes its outputs by the data (the
number of completed compressor groups, the number of visible c128a entries), so it cannot run inside
a captured graph. A decode step of B requests (one token each) has a fixed shape if

* every token carries one compressor "group" slot (G = B): a token that completes no group gets
  member rows -1 (nothing read) and cache slot -1 (nothing stored) — the ops skip those;
* the c128a candidate list has a fixed width K = context // 128 (the most entries any position in
  the allocation can see), -1 past each token's visible entries.

:class:`DecodeMeta` holds the one per-step input, ``positions`` [B] (int64, at a stable address:
updated in place between graph replays) and static block tables; :meth:`DecodeMeta.derive` computes
every other field from them with device ops only, into fresh tensors (inside a captured graph these
live in the graph's pool at stable addresses). Two implementations: ``torch`` (~100 small ops) and
``triton`` (5 launches: window, one per compressor plan, c128a candidates); they must agree exactly
(``check_against_builder``, the smoke test).
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.attention.compressor_plan import CompressorPlan
from vllm_dsv4_hw.attention.metadata import StepMetadata, build_step_metadata

try:  # the triton variant is optional (CPU runs use the torch one)
    import triton
    import triton.language as tl

    @triton.jit
    def _window_kernel(pos_ptr, bt_ptr, bt_stride, ins_ptr, win_ptr, PPP: tl.constexpr,
                       W: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + r)
        page = tl.load(bt_ptr + r * bt_stride + pos // PPP).to(tl.int64)
        tl.store(ins_ptr + r, tl.where(page >= 0, page * PPP + pos % PPP, -1))
        wp = pos - (W - 1) + tl.arange(0, W)
        ok = wp >= 0
        wpc = tl.where(ok, wp, 0)
        pg = tl.load(bt_ptr + r * bt_stride + wpc // PPP, mask=ok, other=-1).to(tl.int64)
        tl.store(win_ptr + r * W + tl.arange(0, W), tl.where(ok & (pg >= 0), pg * PPP + wpc % PPP,
                                                              -1))

    @triton.jit
    def _plan_kernel(pos_ptr, sbt_ptr, sbt_stride, cbt_ptr, cbt_stride, state_ptr, rows_ptr,
                     entry_ptr, cslot_ptr, RATIO: tl.constexpr, RPP: tl.constexpr,
                     E: tl.constexpr, WIDTH: tl.constexpr, BW: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + r)
        page = tl.load(sbt_ptr + r * sbt_stride + pos // RPP).to(tl.int64)
        tl.store(state_ptr + r, tl.where(page >= 0, page * RPP + pos % RPP, -1))
        completes = ((pos + 1) % RATIO) == 0
        k = tl.arange(0, BW)
        mp = pos - (WIDTH - 1) + k
        done_v = ((pos + 1 + k * 0) % RATIO) == 0             # `completes` as a vector
        ok = (k < WIDTH) & (mp >= 0) & done_v
        mpc = tl.where(ok, mp, 0)
        pg = tl.load(sbt_ptr + r * sbt_stride + mpc // RPP, mask=ok, other=-1).to(tl.int64)
        tl.store(rows_ptr + r * WIDTH + k, tl.where(ok & (pg >= 0), pg * RPP + mpc % RPP, -1),
                 mask=k < WIDTH)
        entry = tl.where(completes, (pos + 1) // RATIO - 1, 0)
        tl.store(entry_ptr + r, entry)
        cp = tl.load(cbt_ptr + r * cbt_stride + entry // E).to(tl.int64)
        tl.store(cslot_ptr + r, tl.where(completes & (cp >= 0), cp * E + entry % E, -1))

    @triton.jit
    def _c128_kernel(pos_ptr, all_ptr, out_ptr, K, RATIO: tl.constexpr, BK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        end = (tl.load(pos_ptr + r) + 1) // RATIO
        k = blk * BK + tl.arange(0, BK)
        m = k < K
        v = tl.load(all_ptr + r * K + k, mask=m, other=-1)
        tl.store(out_ptr + r * K + k, tl.where(k < end, v, -1), mask=m)

    HAVE_TRITON = True
except Exception:  # pragma: no cover - no triton here
    HAVE_TRITON = False


def _slots(table: torch.Tensor, req: torch.Tensor, index: torch.Tensor, per: int) -> torch.Tensor:
    """table[req, index // per] * per + index % per for index >= 0 (callers mask the rest)."""
    page = table[req, index // per].long()
    return torch.where(page >= 0, page * per + index % per, torch.full_like(page, -1))


class DecodeMeta:
    """Per-kind decode metadata of ``batch`` requests (one token each) over static block tables."""

    def __init__(self, caches, device: torch.device, impl: str = "torch") -> None:
        cfg = caches.cfg
        self.caches = caches
        self.batch = b = caches.batch
        self.device = device
        self.window = cfg.sliding_window
        if impl == "triton" and not (HAVE_TRITON and device.type == "cuda"):
            impl = "torch"
        self.impl = impl
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.req = torch.arange(b, dtype=torch.int64, device=device)
        self.qsl = torch.arange(b + 1, dtype=torch.int64, device=device)
        self.zeros = torch.zeros(b, dtype=torch.int64, device=device)
        self.win_offs = torch.arange(self.window, device=device, dtype=torch.int64) - (self.window - 1)
        self.ratios = sorted(caches.layouts)
        self.geom = {r: caches.layouts[r].geometry for r in self.ratios}
        self.tables = caches.tables
        self.k128 = caches.context // 128 if 128 in self.ratios else 0
        self.all128 = None
        if self.k128:
            g = self.geom[128]
            idx = torch.arange(self.k128, device=device, dtype=torch.int64).expand(b, -1)
            self.all128 = _slots(self.tables[128].comp, self.req[:, None], idx,
                                 g.comp_entries_per_page).contiguous()
            self.k_range = torch.arange(self.k128, device=device, dtype=torch.int64)

    # -- derive -------------------------------------------------------------------------------------
    def derive(self) -> dict[int, StepMetadata]:
        if self.impl == "triton":
            return self._derive_triton()
        return self._derive_torch()

    def _plan_torch(self, pos, ratio, sbt, rpp, cbt, e) -> CompressorPlan:
        req = self.req
        width = (2 if ratio == 4 else 1) * ratio
        state_slots = _slots(sbt, req, pos, rpp)
        completes = torch.remainder(pos + 1, ratio) == 0
        mpos = pos[:, None] + torch.arange(width, device=pos.device) - (width - 1)
        ok = (mpos >= 0) & completes[:, None]
        rows = torch.where(ok, _slots(sbt, req[:, None], mpos.clamp(min=0), rpp),
                           torch.full_like(mpos, -1))
        entry = torch.where(completes, torch.div(pos + 1, ratio, rounding_mode="floor") - 1,
                            torch.zeros_like(pos))
        cslots = torch.where(completes, _slots(cbt, req, entry, e), torch.full_like(pos, -1))
        return CompressorPlan(state_slots=state_slots, group_rows=rows, group_entry_index=entry,
                              group_req=req, group_token=req, cache_slots=cslots,
                              positions=pos, token_req=req)

    def _derive_torch(self) -> dict[int, StepMetadata]:
        pos = self.positions
        req = self.req
        g0 = self.geom[self.ratios[0]]
        wpp = g0.window_positions_per_page
        wbt = self.tables[self.ratios[0]].window
        ins = _slots(wbt, req, pos, wpp)
        wpos = pos[:, None] + self.win_offs
        ok = wpos >= 0
        win = torch.where(ok, _slots(wbt, req[:, None], wpos.clamp(min=0), wpp),
                          torch.full_like(wpos, -1))
        out = {}
        seq_lens = pos + 1
        for r in self.ratios:
            g, bt = self.geom[r], self.tables[r]
            main = idx = comp = None
            if r:
                main = self._plan_torch(pos, r, bt.main_state, g.main_state_rows_per_page,
                                        bt.comp, g.comp_entries_per_page)
            if r == 4:
                idx = self._plan_torch(pos, 4, bt.indexer_state, g.indexer_state_rows_per_page,
                                       bt.indexer, g.indexer_entries_per_page)
            if r == 128:
                end = torch.div(pos + 1, 128, rounding_mode="floor")
                comp = torch.where(self.k_range[None, :] < end[:, None], self.all128,
                                   torch.full_like(self.all128, -1))
            out[r] = self._meta(r, pos, ins, win, main, idx, comp, seq_lens)
        return out

    def _derive_triton(self) -> dict[int, StepMetadata]:
        pos = self.positions
        b = self.batch
        dev = self.device
        g0 = self.geom[self.ratios[0]]
        wbt = self.tables[self.ratios[0]].window
        ins = torch.empty(b, dtype=torch.int64, device=dev)
        win = torch.empty(b, self.window, dtype=torch.int64, device=dev)
        _window_kernel[(b,)](pos, wbt, wbt.stride(0), ins, win,
                             PPP=g0.window_positions_per_page, W=self.window)
        out = {}
        seq_lens = pos + 1
        for r in self.ratios:
            g, bt = self.geom[r], self.tables[r]
            main = idx = comp = None
            if r:
                main = self._plan_triton(pos, r, bt.main_state, g.main_state_rows_per_page,
                                         bt.comp, g.comp_entries_per_page)
            if r == 4:
                idx = self._plan_triton(pos, 4, bt.indexer_state, g.indexer_state_rows_per_page,
                                        bt.indexer, g.indexer_entries_per_page)
            if r == 128:
                comp = torch.empty(b, self.k128, dtype=torch.int64, device=dev)
                bk = 1024
                _c128_kernel[(b, triton.cdiv(self.k128, bk))](pos, self.all128, comp, self.k128,
                                                              RATIO=128, BK=bk)
            out[r] = self._meta(r, pos, ins, win, main, idx, comp, seq_lens)
        return out

    def _plan_triton(self, pos, ratio, sbt, rpp, cbt, e) -> CompressorPlan:
        b = self.batch
        dev = self.device
        width = (2 if ratio == 4 else 1) * ratio
        state = torch.empty(b, dtype=torch.int64, device=dev)
        rows = torch.empty(b, width, dtype=torch.int64, device=dev)
        entry = torch.empty(b, dtype=torch.int64, device=dev)
        cslot = torch.empty(b, dtype=torch.int64, device=dev)
        _plan_kernel[(b,)](pos, sbt, sbt.stride(0), cbt, cbt.stride(0), state, rows, entry, cslot,
                           RATIO=ratio, RPP=rpp, E=e, WIDTH=width,
                           BW=triton.next_power_of_2(width))
        return CompressorPlan(state_slots=state, group_rows=rows, group_entry_index=entry,
                              group_req=self.req, group_token=self.req, cache_slots=cslot,
                              positions=pos, token_req=self.req)

    def _meta(self, r, pos, ins, win, main, idx, comp, seq_lens) -> StepMetadata:
        end = (torch.div(seq_lens, r, rounding_mode="floor") if r else self.zeros)
        return StepMetadata(
            ratio=r, sliding_window=self.window, geometry=self.geom[r],
            block_tables=self.tables[r], num_reqs=self.batch, num_tokens=self.batch,
            query_start_loc=self.qsl, seq_starts=pos, seq_lens=seq_lens, positions=pos,
            token_req=self.req, window_insert_slots=ins, window_slots=win,
            comp_entry_end=end, max_visible_entries=self.k128 if r == 128 else 0,
            main_plan=main, indexer_plan=idx, comp_slots=comp)


def reference_meta(caches, positions: list[int], device) -> dict[int, StepMetadata]:
    """The general builder's metadata of the same decode step (host-checked, data-sized)."""
    out = {}
    for r in sorted(caches.layouts):
        out[r] = build_step_metadata(positions, [1] * len(positions), r, caches.tables[r],
                                     caches.layouts[r].geometry, caches.cfg.sliding_window,
                                     max_comp_entries=caches.context // 128 if r == 128 else None)
    return out


def check_against_builder(dm: DecodeMeta, positions: list[int]) -> dict:
    """Compare derive() with build_step_metadata at ``positions``: window slots, state slots,
    c128a candidates must be equal; the padded compressor plans must hold exactly the builder's
    groups (same rows, entries and cache slots) and nothing else."""
    dm.positions.copy_(torch.tensor(positions, dtype=torch.int64))
    got = dm.derive()
    ref = reference_meta(dm.caches, positions, dm.device)
    bad = []
    for r in ref:
        a, e = got[r], ref[r]
        for name in ("positions", "window_insert_slots", "window_slots"):
            if not torch.equal(getattr(a, name).cpu(), getattr(e, name).cpu()):
                bad.append(f"r{r}.{name}")
        if r == 128 and not torch.equal(a.comp_slots.cpu(), e.comp_slots.cpu()):
            bad.append("r128.comp_slots")
        for pname in ("main_plan", "indexer_plan"):
            pa, pe = getattr(a, pname), getattr(e, pname)
            if pe is None:
                continue
            if not torch.equal(pa.state_slots.cpu(), pe.state_slots.cpu()):
                bad.append(f"r{r}.{pname}.state_slots")
            real = (pa.cache_slots >= 0).cpu()
            tok = torch.nonzero(real).squeeze(1)
            if not torch.equal(tok, pe.group_token.cpu()):
                bad.append(f"r{r}.{pname}.groups")
                continue
            for f in ("group_rows", "group_entry_index", "cache_slots"):
                if not torch.equal(getattr(pa, f).cpu()[tok], getattr(pe, f).cpu()):
                    bad.append(f"r{r}.{pname}.{f}")
            pad_rows = pa.group_rows.cpu()[~real]
            if pad_rows.numel() and bool((pad_rows != -1).any()):
                bad.append(f"r{r}.{pname}.padding_rows")
    return {"ok": not bad, "mismatches": bad, "positions": positions}
