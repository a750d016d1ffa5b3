"""The op cases of the conformance kit: fresh random inputs on the device under test, a float64
oracle, poisoned caches, and a check per case.

Each builder returns :class:`Case` objects. A case holds its pristine inputs (on the device); for
every backend it clones the mutable ones (caches, states: poisoned with 0xFF bytes / NaN where
nothing is written), calls the implementation, and checks the result against an oracle computed
once in float64 -- the reference implementation run on float64 copies of the inputs (on the
device when it has fp64, else on the CPU), or, for the compressor and the indexer's scores, float64
formulas written here. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_dsv4_hw.attention.compressor_plan import compressor_plan
from vllm_dsv4_hw.config import YarnParams
from vllm_dsv4_hw.conformance.tolerances import dense_bound, entry_bound, ratio
from vllm_dsv4_hw.kinds import C4A, C128A, INDEXER_COMPRESSOR, AttentionKind
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.blocks import BLOCK_POSITIONS
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.reference import output_proj as ref_oproj
from vllm_dsv4_hw.ops.reference import rms_norm as ref_norm
from vllm_dsv4_hw.ops.reference import rope as ref_rope
from vllm_dsv4_hw.ops.reference import sparse_attention as ref_sa
from vllm_dsv4_hw.ops.reference.indexer import indexer_head_weights
from vllm_dsv4_hw.platform.capabilities import DeviceCapabilities

POISON = 0xFF  # NaN in bf16 / fp32 / e4m3 data bytes, inf as a ue8m0 scale byte
EPS = 1e-6


@dataclass(frozen=True)
class Dims:
    name: str
    tokens: int
    heads: int
    index_heads: int
    topk: int
    window: int
    q_lora: int
    o_groups: int
    o_lora: int
    hidden: int
    positions: tuple[int, ...]  # one decode token per request, len == tokens
    head_dim: int = 512
    rope_dim: int = 64
    index_dim: int = 128


SHAPES = {
    # fast everywhere (CPU included); the real head / rope / index dims, few heads and tokens
    "small": Dims("small", tokens=4, heads=4, index_heads=16, topk=16, window=16, q_lora=64,
                  o_groups=2, o_lora=32, hidden=128, positions=(5, 130, 259, 600)),
    # V4-Flash at decode batch 8: 64 heads of 512 (448 + 64 rope), indexer 64 x 128, top-512,
    # window 128, q_lora 1024, 8 groups x 1024, hidden 4096
    "real": Dims("real", tokens=8, heads=64, index_heads=64, topk=512, window=128, q_lora=1024,
                 o_groups=8, o_lora=1024, hidden=4096,
                 positions=(1500, 2051, 2559, 3333, 4095, 5000, 6143, 8191)),
}


@dataclass
class Ctx:
    device: torch.device
    caps: DeviceCapabilities
    dims: Dims
    gen: torch.Generator
    main_fmt: str
    indexer_fmt: str
    main_formats: tuple[str, ...]
    indexer_formats: tuple[str, ...]
    _table: torch.Tensor | None = None

    @property
    def oracle_device(self) -> torch.device:
        return self.device if self.caps.fp64 else torch.device("cpu")

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype).to(self.device)

    def rows(self, n: int, dim: int, dtype=torch.bfloat16, lo=-6.0, hi=6.0) -> torch.Tensor:
        """Rows with per-row magnitudes 2^lo .. 2^hi (exercise the block scales)."""
        x = torch.randn(n, dim, generator=self.gen)
        x = x * torch.exp2(torch.empty(n, 1).uniform_(lo, hi, generator=self.gen))
        return x.to(dtype).to(self.device)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    @property
    def table(self) -> torch.Tensor:
        """The c4a / c128a RoPE table (theta 160000, YaRN) up to the largest position used."""
        if self._table is None:
            n = max(self.dims.positions) + 256
            self._table = ref_rope.rope_cos_sin(160000.0, self.dims.rope_dim, n, YarnParams(),
                                                device=self.device)
        return self._table

    def to_oracle(self, t):
        if isinstance(t, torch.Tensor):
            if t.is_floating_point():
                return t.to(device=self.oracle_device, dtype=torch.float64)
            return t.to(self.oracle_device)
        return t


Check = Callable[[Any, tuple], tuple[bool, str, float]]


@dataclass
class Case:
    op: str
    name: str
    args: tuple
    check: Check
    mutable: tuple[int, ...] = ()
    kwargs: dict = field(default_factory=dict)

    def run(self, fn: Callable) -> tuple[bool, str, float]:
        args = tuple(a.clone() if i in self.mutable else a for i, a in enumerate(self.args))
        out = fn(*args, **self.kwargs)
        return self.check(out, args)


def _verdict(r: float, what: str = "") -> tuple[bool, str, float]:
    ok = r <= 1.0
    return ok, (f"{what}err/tol {r:.3g}" if math.isfinite(r) else f"{what}non-finite result"), r


def _same(out: torch.Tensor, shape, dtype) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a tensor"
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        return f"returned {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(shape)}"
    return None


# -- cache helpers ---------------------------------------------------------------------------------
def poisoned_cache(fmt, pages: int, device, pad: int = 64) -> torch.Tensor:
    return fmt.new_cache(pages, page_bytes=fmt.min_page_bytes + pad).fill_(POISON).to(device)


def entry_spans(fmt, slot: int) -> tuple[int, slice, slice]:
    e = fmt.entries_per_page
    page, off = divmod(slot, e)
    d0 = off * fmt.data_bytes
    s0 = e * fmt.data_bytes + off * fmt.scale_bytes
    return page, slice(d0, d0 + fmt.data_bytes), slice(s0, s0 + fmt.scale_bytes)


def check_entries(cache: torch.Tensor, before: torch.Tensor, fmt, slots, want: torch.Tensor,
                  fmt_name: str) -> tuple[bool, str, float]:
    """Written entries decode to ``want`` within one code step; every other byte is unchanged."""
    cache, before = cache.cpu(), before.cpu()
    slots = [int(s) for s in slots.tolist()]
    written = torch.zeros_like(cache, dtype=torch.bool)
    got_rows, want_rows = [], []
    for i, s in enumerate(slots):
        if s < 0:
            continue
        page, ds, ss = entry_spans(fmt, s)
        written[page, ds] = True
        written[page, ss] = True
        got_rows.append(fmt.dequantize(cache[page, ds][None].clone(),
                                       cache[page, ss][None].clone())[0])
        want_rows.append(want[i].cpu())
    if not torch.equal(cache[~written], before[~written]):
        n = int((cache[~written] != before[~written]).sum())
        return False, f"{n} bytes outside the written entries changed (poison overwritten)", \
            float("inf")
    if not got_rows:
        return True, "nothing to write", 0.0
    got, w = torch.stack(got_rows).double(), torch.stack(want_rows).double()
    return _verdict(ratio(got, w, entry_bound(fmt_name, w)), "entries ")


# -- norms -----------------------------------------------------------------------------------------
def rms_norm_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    out = []
    for name, x, w in (
        (f"weighted bf16 [{d.tokens}, {d.q_lora}]", ctx.rows(d.tokens, d.q_lora, lo=-3, hi=3),
         (torch.rand(d.q_lora, generator=ctx.gen) * 2 - 0.5).to(torch.bfloat16).to(ctx.device)),
        (f"per-head weightless fp32 [{d.tokens}, {d.heads}, {d.head_dim}]",
         ctx.rows(d.tokens * d.heads, d.head_dim, torch.float32).reshape(d.tokens, d.heads,
                                                                         d.head_dim), None),
    ):
        want = ref_norm.rms_norm(ctx.to_oracle(x), ctx.to_oracle(w), EPS)

        def check(res, args, want=want, x=x):
            bad = _same(res, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
            return _verdict(ratio(res.to(want.device), want, dense_bound(want, x.dtype, 1e-4)))

        out.append(Case(api.RMS_NORM, name, (x, w, EPS), check))
    return out


def qkv_rms_norm_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    fused = ctx.rows(d.tokens, d.q_lora + d.head_dim, lo=-3, hi=3)
    q_r, kv = fused[:, :d.q_lora], fused[:, d.q_lora:]  # column slices of one projection
    q_w = (torch.rand(d.q_lora, generator=ctx.gen) + 0.5).to(torch.bfloat16).to(ctx.device)
    kv_w = (torch.rand(d.head_dim, generator=ctx.gen) + 0.5).to(torch.bfloat16).to(ctx.device)
    wq = ref_norm.rms_norm(ctx.to_oracle(q_r), ctx.to_oracle(q_w), EPS)
    wk = ref_norm.rms_norm(ctx.to_oracle(kv), ctx.to_oracle(kv_w), EPS)

    def check(res, args):
        if not isinstance(res, tuple) or len(res) != 2:
            return False, "expected a (q, kv) pair", float("inf")
        for r_, x in zip(res, (q_r, kv)):
            bad = _same(r_, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
        r = max(ratio(res[0].to(wq.device), wq, dense_bound(wq, torch.bfloat16, 1e-4)),
                ratio(res[1].to(wk.device), wk, dense_bound(wk, torch.bfloat16, 1e-4)))
        return _verdict(r)

    return [Case(api.QKV_RMS_NORM, f"bf16 q_lora {d.q_lora} + kv {d.head_dim} (strided)",
                 (q_r, q_w, kv, kv_w, EPS), check)]


# -- RoPE ------------------------------------------------------------------------------------------
def rope_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    pos = torch.tensor(d.positions, device=ctx.device)
    out = []
    for name, dtype, inverse in (("forward bf16", torch.bfloat16, False),
                                 ("inverse fp32", torch.float32, True)):
        x = ctx.rows(d.tokens * d.heads, d.head_dim, dtype, -2, 2).reshape(d.tokens, d.heads,
                                                                            d.head_dim)
        want = ref_rope.rope(ctx.to_oracle(x), pos.to(ctx.oracle_device), ctx.table.to(
            ctx.oracle_device), inverse)

        def check(res, args, x=x, want=want):
            bad = _same(res, x.shape, x.dtype)
            if bad:
                return False, bad, float("inf")
            nope = d.head_dim - d.rope_dim
            if not torch.equal(res[..., :nope], x[..., :nope]):
                return False, "dims before the rotated part changed", float("inf")
            return _verdict(ratio(res.to(want.device), want, dense_bound(want, x.dtype, 1e-6)))

        out.append(Case(api.ROPE, f"{name} [{d.tokens}, {d.heads}, {d.head_dim}] YaRN", (
            x, pos, ctx.table, inverse), check))
    return out


# -- cache layouts: kv_insert / kv_gather per format -----------------------------------------------
def layout_cases(ctx: Ctx) -> list[Case]:
    """kv_insert bytes at hand-computed offsets (data region, then scale region, padding intact)
    and kv_gather decoding, for every format the device holds."""
    out = []
    combos = [("main", f, 64) for f in ctx.main_formats] + \
             [("main", f, 2) for f in ctx.main_formats] + \
             [("indexer", f, 64) for f in ctx.indexer_formats]
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
            ok, detail, r = check_entries(got, _poisoned_like(want, fmt, slots), fmt, slots,
                                          x.double(), fname)
            nbytes = int((got != want).sum())
            return ok, f"{nbytes} bytes differ from the reference codec; {detail}", r

        out.append(Case(api.KV_INSERT, f"layout {label}", (cache, slots.to(ctx.device), x, fmt),
                        check_insert, mutable=(0,)))

        # gather from a cache written by the reference codec: exact decode, -1 -> zeros
        filled = want.to(ctx.device)
        q = slots.clone()
        q[0] = -1
        query = torch.stack([q, q.flip(0)])
        exp = torch.zeros(*query.shape, fmt.dim)
        dec = fmt.dequantize(data, scales)
        for (i, j), s in zip(torch.cartesian_prod(torch.arange(2), torch.arange(n)).tolist(),
                             query.flatten().tolist()):
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

        out.append(Case(api.KV_GATHER, f"layout {label}", (filled, query.to(ctx.device), fmt),
                        check_gather))
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


# -- fused prologue / epilogue ---------------------------------------------------------------------
def qnorm_rope_kv_insert_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    t = d.tokens
    fmt = make_format(ctx.main_fmt, "main", 64)
    pages = max(2, t // 64 + 2)
    q = ctx.rows(t * d.heads, d.head_dim, lo=-4, hi=4).reshape(t, d.heads, d.head_dim)
    kv = ctx.rows(t, d.head_dim, lo=-6, hi=6)
    pos = torch.tensor(d.positions, device=ctx.device)
    slots = ctx.randperm(pages * 64)[:t]
    slots[0] = -1
    cache = poisoned_cache(fmt, pages, ctx.device)
    oq = ref_rope.rope(ref_norm.rms_norm(ctx.to_oracle(q), None, EPS), pos.to(ctx.oracle_device),
                       ctx.table.to(ctx.oracle_device))
    ok_ = ref_rope.rope(ctx.to_oracle(kv), pos.to(ctx.oracle_device), ctx.table.to(
        ctx.oracle_device))

    def check(res, args):
        bad = _same(res, q.shape, q.dtype)
        if bad:
            return False, bad, float("inf")
        rq = ratio(res.to(oq.device), oq, dense_bound(oq, q.dtype, 1e-6))
        ok, detail, rc = check_entries(args[5], cache, fmt, slots, ok_, fmt.name)
        r = max(rq, rc)
        return (rq <= 1 and ok), f"q err/tol {rq:.3g}; window cache: {detail}", r

    return [Case(api.QNORM_ROPE_KV_INSERT, f"bf16 [{t}, {d.heads}, {d.head_dim}] -> "
                 f"{fmt.name} window", (q, kv, pos, ctx.table, EPS, cache, slots.to(ctx.device),
                                        fmt), check, mutable=(5,))]


def inv_rope_fp8_quant_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    o = ctx.rows(d.tokens * d.heads, d.head_dim, lo=-12, hi=8).reshape(d.tokens, d.heads,
                                                                        d.head_dim)
    pos = torch.tensor(d.positions, device=ctx.device)
    x = ref_rope.rope(ctx.to_oracle(o), pos.to(ctx.oracle_device), ctx.table.to(
        ctx.oracle_device), inverse=True).cpu()

    def check(res, args):
        if not isinstance(res, tuple) or len(res) != 2:
            return False, "expected (o_fp8, scales)", float("inf")
        q, s = res
        g = api.O_QUANT_GROUP
        for bad in (_same(q, o.shape, torch.float8_e4m3fn),
                    _same(s, (d.tokens, d.heads, d.head_dim // g), torch.float32)):
            if bad:
                return False, bad, float("inf")
        s64, q64 = s.cpu().double(), q.cpu().double()
        if not torch.equal(torch.exp2(torch.log2(s64).round()), s64):
            return False, "scales are not powers of two", float("inf")
        amax = x.reshape(d.tokens, d.heads, -1, g).abs().amax(-1).clamp_min(api.O_QUANT_AMAX_FLOOR)
        if not (bool(torch.all(448 * s64 >= amax * (1 - 1e-6)))
                and bool(torch.all(448 * s64 < 2 * amax * (1 + 1e-6)))):
            return False, "scale is not 2^ceil(log2(amax / 448))", float("inf")
        s_el = s64.repeat_interleave(g, -1)
        deq = q64 * s_el
        return _verdict(ratio(deq, x, x.abs() * (2 ** -4 + 1e-6) + s_el * 2 ** -10))

    return [Case(api.INV_ROPE_FP8_QUANT, f"bf16 [{d.tokens}, {d.heads}, {d.head_dim}]",
                 (o, pos, ctx.table), check)]


def grouped_o_proj_cases(ctx: Ctx) -> list[Case]:
    d = ctx.dims
    k = (d.heads // d.o_groups) * d.head_dim
    o = ctx.randn(d.tokens, d.heads, d.head_dim, dtype=torch.bfloat16)
    wo_a = ctx.randn(d.o_groups, d.o_lora, k, dtype=torch.bfloat16, scale=k ** -0.5)
    wo_b = ctx.randn(d.hidden, d.o_groups * d.o_lora, dtype=torch.bfloat16,
                     scale=(d.o_groups * d.o_lora) ** -0.5)
    want = ref_oproj.grouped_o_proj(ctx.to_oracle(o), ctx.to_oracle(wo_a), ctx.to_oracle(wo_b))

    def check(res, args):
        bad = _same(res, (d.tokens, d.hidden), torch.bfloat16)
        if bad:
            return False, bad, float("inf")
        return _verdict(ratio(res.to(want.device), want, dense_bound(want, torch.bfloat16, 2e-2)))

    return [Case(api.GROUPED_O_PROJ, f"bf16 H {d.heads}, G {d.o_groups} x {d.o_lora}, hidden "
                 f"{d.hidden}", (o, wo_a, wo_b), check)]


# -- sparse attention ------------------------------------------------------------------------------
def _garbage_cache(ctx: Ctx, fmt, rows: torch.Tensor, spare: int = 2, pad: int = 96):
    """Rows at random distinct slots of a cache full of random bytes -> (cache, slot of row)."""
    e = fmt.entries_per_page
    m = rows.shape[0]
    pages = (m + e - 1) // e + spare
    cache = torch.randint(0, 256, (pages, fmt.min_page_bytes + pad), generator=ctx.gen,
                          dtype=torch.uint8)
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
            scale = dim ** -0.5
            args = (q, wc, ws.to(ctx.device), cc, cs.to(ctx.device), wf, sink, scale)
            want = ref_sa.sparse_attention(*(ctx.to_oracle(a) for a in args), comp_fmt=cf)

            def check(res, args, want=want, q=q):
                bad = _same(res, q.shape, q.dtype)
                if bad:
                    return False, bad, float("inf")
                return _verdict(ratio(res.to(want.device), want,
                                      dense_bound(want, q.dtype, 1e-2, rtol=2 ** -6)))

            out.append(Case(api.SPARSE_ATTENTION, f"{kind.name} {wf.name} bf16 T {t} H {h} W "
                            f"{d.window} K {k}", args, check, kwargs={"comp_fmt": cf}))
    return out


# -- indexer ---------------------------------------------------------------------------------------
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
        paged.insert_rows(cache, everything, 30.0 * torch.randn(pool * e, di, generator=ctx.gen),
                          fmt)
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

        out.append(Case(api.INDEXER_TOPK, f"{fmt.name} keys, Hi {hi} x {di}, top-{topk}, visible "
                        f"{int(visible.min())}..{int(visible.max())}",
                        (q, w, cache.to(ctx.device), fmt, bt.to(ctx.device),
                         torch.arange(t, device=ctx.device), pos.to(ctx.device), topk, ratio_),
                        check))
    return out


# -- compressor ------------------------------------------------------------------------------------
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
    need = [sorted({int(p) // rpp for p in range(max(0, int(p0) - width + 1), int(p0) + 1)})
            for p0 in pos]
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
            kvm[j] = kvr[p, blk * dim:(blk + 1) * dim]
            scm[j] = scr[p, blk * dim:(blk + 1) * dim] + ape[p % ratio_, blk * dim:(blk + 1) * dim]
        pooled[gi] = (torch.softmax(scm, dim=0) * kvm).sum(0)
    new_rows = torch.cat([kv, sc + ape[pos % ratio_]], dim=-1)
    return dict(pos=pos, state=state, ape=ape, plan=plan, kv=kv, sc=sc, pooled=pooled,
                new_rows=new_rows, kbt=kbt, pool_pages=t + 2)


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
        common = (s["kv"].to(dev), s["sc"].to(dev), s["pos"].to(dev), s["ape"].to(dev), state,
                  plan.state_slots.to(dev), plan.group_rows.to(dev), ratio_)
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

        out.append(Case(api.COMPRESSOR_POOL, f"{label} ratio {ratio_} d {dim}: {g} of "
                        f"{d.tokens} tokens complete a group", common, check_pool, mutable=(4,)))

        # store: pool + RMSNorm_w + RoPE at ratio * i + quantize into the entry cache
        norm_w = (1.0 + 0.2 * torch.randn(dim, generator=ctx.gen))
        entries = s["pooled"]
        normed = entries / torch.sqrt(entries.square().mean(-1, keepdim=True) + EPS) * \
            norm_w.double()
        rpos = plan.group_entry_index.cpu() * ratio_
        want = ref_rope.rope(normed, rpos, ctx.table.cpu())
        cache = poisoned_cache(fmt, s["pool_pages"], dev)
        args = common + (norm_w.to(dev), EPS, ctx.table, plan.group_entry_index.to(dev), cache,
                         plan.cache_slots.to(dev), fmt)

        def check_store(res, args, s=s, state=state, cache=cache, fmt=fmt, want=want, plan=plan):
            ok_s, why = _check_state(args[4], state, plan, s["new_rows"])
            ok, detail, r = check_entries(args[12], cache, fmt, plan.cache_slots.cpu(), want,
                                          fmt.name)
            return ok and ok_s, f"{detail}; {why}", r if ok_s else float("inf")

        out.append(Case(api.COMPRESSOR_STORE, f"{label} -> {fmt.name}, {g} entries", args,
                        check_store, mutable=(4, 12)))
    return out


BUILDERS: dict[str, Callable[[Ctx], list[Case]]] = {
    api.RMS_NORM: rms_norm_cases,
    api.QKV_RMS_NORM: qkv_rms_norm_cases,
    api.ROPE: rope_cases,
    "layouts": layout_cases,  # kv_insert + kv_gather
    api.QNORM_ROPE_KV_INSERT: qnorm_rope_kv_insert_cases,
    api.INV_ROPE_FP8_QUANT: inv_rope_fp8_quant_cases,
    api.GROUPED_O_PROJ: grouped_o_proj_cases,
    api.SPARSE_ATTENTION: sparse_attention_cases,
    api.INDEXER_TOPK: indexer_topk_cases,
    "compressor": compressor_cases,  # compressor_pool + compressor_store
}


def _register_weight_and_metadata_cases() -> None:
    # their modules import this one (Case, Ctx): registered after it is complete
    from vllm_dsv4_hw.conformance.cases_metadata import decode_metadata_cases
    from vllm_dsv4_hw.conformance.cases_moe import moe_experts_cases
    from vllm_dsv4_hw.conformance.cases_weights import fp8_block_linear_cases

    BUILDERS[api.FP8_BLOCK_LINEAR] = fp8_block_linear_cases
    BUILDERS[api.MOE_EXPERTS] = moe_experts_cases
    BUILDERS[api.DECODE_METADATA] = decode_metadata_cases


_register_weight_and_metadata_cases()

# Ops the model only uses where the device has a capability (skipped, with the reason, elsewhere).
OP_NEEDS = {api.INV_ROPE_FP8_QUANT: ("fp8",)}
