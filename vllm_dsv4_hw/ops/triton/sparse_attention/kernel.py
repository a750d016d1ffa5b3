# SPDX-License-Identifier: Apache-2.0
"""Triton ``sparse_attention``: paged window + compressed candidates, dequantized in the kernel,
one softmax per (token, head) with the per-head sink, fp32 math inside.

Design (decode: T small, H = 64 / 128 heads sharing one KV vector per candidate, MQA):

* **Grid** (1-D): one program per (token, candidate split, block of ``BLOCK_H`` heads); the head
  block varies fastest, so the programs that read the same token's candidates run side by side and
  share them through L2. A program loads each of its candidate entries once (a ``[BLOCK_N, D]``
  tile, dequantized in registers) and uses it for all its heads: ``S = Q K^T`` is a
  ``[BLOCK_H, D] x [D, BLOCK_N]`` ``tl.dot`` and ``O += P V`` a
  ``[BLOCK_H, BLOCK_N] x [BLOCK_N, D]`` one (K = V). On CUDA with bf16 queries the dot inputs
  are bf16 (exact for the bf16 and fp8_ds_mla entries: an e4m3 value times a power-of-two scale is
  a bf16 value; P is rounded to bf16) with fp32 accumulation; otherwise (fp32 / fp16 / fp64
  queries, the fp32 format, the CPU interpreter) fp32 ``ieee`` dots.
* **Online softmax** over the program's candidates in tiles of ``BLOCK_N``: window candidates first
  (their own cache and slot list), then compressed ones, in one loop whose tiles pick their cache
  (``ONE_LOOP``: a window of whole tiles and one slot dtype, as the model passes them; else one
  loop per cache); slot -1 is masked (never loaded). Logits
  are kept in the log2 domain (``exp2``); the running max starts at the sink, so it is never -inf.
* **Split-K** (flash-decoding) when T x head-blocks is too small to fill the device: the candidate
  list ``[0, W + K)`` is cut into ``S`` chunks (multiples of ``BLOCK_N``); each split writes its
  unnormalized ``acc [D]`` and ``(m, l)`` per head to an fp32 workspace, and a second kernel (one
  program per (token, head)) merges them and adds the sink to the denominator. With ``S = 1`` the
  first kernel normalizes and writes the output itself (prefill: many tokens, no split).
* Dtype-specific loads / dequantization live in small ``@triton.jit`` helpers
  (``sparse_attention_tiles``: ``_load_raw_tile``, ``_dequant_tile``, the online-softmax step, and
  the codecs of ``ops.triton.quant``); the launch plan (tunables per device, split-K) in
  ``sparse_attention_launch``. Optionally (``prefetch``) the raw
  bytes of the next tile are loaded before the current one is computed. fp8 decoding is integer
  bit manipulation (portable to triton-ascend, which has no fp8 dtypes), the hardware conversion
  (sm_89+), or where the device declares inline PTX the packed decode of ``ptx_codecs`` straight to
  bf16 (fewer conversion instructions per element); grids are 1-D and split into launches of at most
  ``max_grid`` programs (Ascend: 65535).

Slots must be -1 or lie inside their cache (not checked here: a check would need a device sync).

Formats read in the kernel: ``bf16``, ``fp8_ds_mla``, ``fp32``. Any other entry format (e.g. a test
format) goes through the generic path: its distinct candidate rows are dequantized once by the
format's own codec into an fp32 table, which the same kernel then reads as an fp32 "cache" with
one entry per page.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_dsv4_hw.kv_cache.paged import gather_rows
from vllm_dsv4_hw.ops import tuning
from vllm_dsv4_hw.ops.api import SPARSE_ATTENTION
from vllm_dsv4_hw.ops.checks import check_sparse_attention_args
from vllm_dsv4_hw.ops.registry import register_op
from vllm_dsv4_hw.ops.triton.common.launch import cdiv, grid_limit, next_pow2
from vllm_dsv4_hw.ops.triton.common.pdl import pdl_launch, pdl_start
from vllm_dsv4_hw.ops.triton.common.ptx_codecs import CVT_INT, e4m3_mode
from vllm_dsv4_hw.ops.triton.common.quant import FMT_BF16, FMT_FP8_DS_MLA, FMT_FP32
from vllm_dsv4_hw.ops.triton.sparse_attention.launch import (
    _config,
    _interpreting,
    _num_cores,
    _plan_splits,
)
from vllm_dsv4_hw.ops.triton.sparse_attention.tiles import (
    _attend_candidates,
    _attend_range,
    _store_rows,
)

_LOG2E = 1.4426950408889634  # the kernels work in log2 units: exp(x) = exp2(x * log2(e))

_KNOWN = {"bf16": FMT_BF16, "fp8_ds_mla": FMT_FP8_DS_MLA, "fp32": FMT_FP32}


# Slots scanned per load when looking for a split's last compressed candidate (``TRIM``), and
# whether calls trim by default: walking the -1 slots past a long --max-model-len's visible
# entries costs more than the scan (evidence: docs/tuning.md, Sparse walk trim).
TRIM_BLOCK = 1024


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _visited_end(c_row, lo, hi, W, TRIM: tl.constexpr):
    """Where a program's walk over candidates ``[lo, hi)`` may stop: after the last compressed
    slot of the range that is not -1 (the window part, ``[0, W)``, is always walked). The tiles
    past it hold only -1 slots, and a tile of -1 slots leaves (m, l, acc) as they were (up to
    the sign of a zero in acc), so stopping there gives the same values. Why: vLLM's graph-safe decode metadata sizes the c128a
    candidate lists by ``--max-model-len`` (at 128K context under 1M: 8,192 slots, 1,024 taken),
    and the programs walked every -1 tile. ``TRIM`` = 0: walk to ``hi`` (no scan)."""
    end = hi
    if TRIM:
        c_lo = tl.maximum(lo, W) - W
        c_hi = hi - W
        last = tl.full([], -1, tl.int32)
        for s0 in range(c_lo, c_hi, TRIM):
            j = s0 + tl.arange(0, TRIM)
            sl = tl.load(c_row + j, mask=j < c_hi, other=-1)
            last = tl.maximum(last, tl.max(tl.where(sl >= 0, j, -1), axis=0))
        end = tl.minimum(hi, tl.maximum(W + last + 1, tl.minimum(hi, W)))
    return end


@triton.jit
def _sparse_attn_fwd(
    q_ptr, stride_qt, stride_qh,
    w_u8_ptr, w_typed_ptr, w_slots_ptr, stride_ws, W, w_E, w_page_bytes, w_page_elems,
    c_u8_ptr, c_typed_ptr, c_slots_ptr, stride_cs, K, c_E, c_page_bytes, c_page_elems,
    sink_ptr, out_ptr, stride_ot, stride_oh, ws_acc_ptr, ws_ml_ptr,
    H, num_hb, num_splits, chunk, t_start, qk_scale2,
    FMT: tl.constexpr, D: tl.constexpr, DATA_ELEMS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CVT: tl.constexpr, DOT_BF16: tl.constexpr, SPLIT: tl.constexpr, ROUND_BF16: tl.constexpr,
    PREFETCH: tl.constexpr, ONE_LOOP: tl.constexpr, TRIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    hb = pid % num_hb
    rest = pid // num_hb
    sp = rest % num_splits
    t = (rest // num_splits + t_start).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=qmask,
                other=0.0)
    if not DOT_BF16:  # bf16 q goes to the dots as loaded (no register round trip: it can stay
        q = q.to(tl.float32)  # in shared memory, which the 64-head prefill tile needs)

    sink2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.maximum(sink2, -1.0e30)  # finite even for a -inf sink
    if SPLIT:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # the combine kernel adds the sink
    else:
        l_i = tl.exp2(sink2 - m_i)  # 1, or 0 for a -inf sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    lo = sp * chunk
    hi = tl.minimum(lo + chunk, W + K)
    # the tiles after the last compressed slot that is not -1 only hold -1: not visited
    end = _visited_end(c_slots_ptr + t * stride_cs, lo, hi, W, TRIM)
    if ONE_LOOP:
        m_i, l_i, acc = _attend_candidates(q, m_i, l_i, acc, lo, hi, end, W,
                                           w_u8_ptr, w_typed_ptr, w_slots_ptr + t * stride_ws, w_E,
                                           w_page_bytes, w_page_elems,
                                           c_u8_ptr, c_typed_ptr, c_slots_ptr + t * stride_cs, c_E,
                                           c_page_bytes, c_page_elems, qk_scale2, FMT, D,
                                           DATA_ELEMS, BLOCK_N, BLOCK_D, CVT, DOT_BF16, PREFETCH)
    else:  # a window length that is no multiple of BLOCK_N: one loop per cache
        m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, w_u8_ptr, w_typed_ptr,
                                      w_slots_ptr + t * stride_ws, tl.minimum(lo, W),
                                      tl.minimum(hi, W), w_E, w_page_bytes, w_page_elems,
                                      tl.minimum(hi, W),
                                      qk_scale2, FMT, D, DATA_ELEMS, BLOCK_N, BLOCK_D, CVT,
                                      DOT_BF16, PREFETCH)
        m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, c_u8_ptr, c_typed_ptr,
                                      c_slots_ptr + t * stride_cs, tl.maximum(lo, W) - W,
                                      tl.maximum(hi, W) - W, c_E, c_page_bytes, c_page_elems,
                                      tl.maximum(end, W) - W,
                                      qk_scale2, FMT, D, DATA_ELEMS, BLOCK_N, BLOCK_D, CVT,
                                      DOT_BF16, PREFETCH)

    if SPLIT:
        row = (t * H + heads) * num_splits + sp  # [BLOCK_H] rows of the [T, H, S] workspace
        # a split that took no candidate (l = 0: acc is 0 too) stores no acc, and the combine
        # reads none: under a long --max-model-len most c128a splits are such
        tl.store(ws_acc_ptr + row[:, None] * D + dims[None, :], acc,
                 mask=qmask & (l_i > 0)[:, None])
        tl.store(ws_ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ws_ml_ptr + row * 2 + 1, l_i, mask=hmask)
    else:
        # l == 0 only without candidates and with a -inf sink; acc is 0 there too
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        _store_rows(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :], o, qmask,
                    ROUND_BF16)


@triton.jit
def _sparse_attn_combine(
    ws_acc_ptr, ws_ml_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, H, num_splits, t_start,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge the splits of one (token, head) over dims [BLOCK_DC * program_id(1), +BLOCK_DC):
    o = sum_s 2^(m_s-M) acc_s / (sum_s 2^(m_s-M) l_s + 2^(sink-M)). One dim chunk per program
    (at decode one program per head looping over the chunks left the device idle)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    t = (pid // H + t_start).to(tl.int64)
    h = pid % H
    ss = tl.arange(0, BLOCK_S)
    smask = ss < num_splits
    row = (t * H + h) * num_splits + ss
    m_s = tl.load(ws_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(ws_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    sink2 = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(m_s, axis=0), sink2)
    w = tl.exp2(m_s - m)
    denom = tl.sum(w * l_s, axis=0) + tl.exp2(sink2 - m)
    inv = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
    dd = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dm = dd < D
    # the partials load at once with m / l (a mask on l_s > 0 made it wait for them: a second
    # round trip); a split that saw no candidate (l_s == 0) never wrote its partial, so what
    # its slot holds (even NaN) is dropped by the where, not multiplied by its zero weight
    part = tl.load(ws_acc_ptr + row[:, None] * D + dd[None, :],
                   mask=smask[:, None] & dm[None, :], other=0.0)
    o = tl.sum(tl.where((l_s > 0)[:, None], part * w[:, None], 0.0), axis=0) * inv
    _store_rows(out_ptr + t * stride_ot + h * stride_oh + dd, o, dm, ROUND_BF16)


# ------------------------------------------------------------------------------------------------
# host side (launch plan: ``sparse_attention_launch``)
# ------------------------------------------------------------------------------------------------
def _cache_views(cache: torch.Tensor, data_bytes: int, code: int):
    """(u8 view, typed view, page bytes, page elements of the typed view, data elements)."""
    if code == FMT_FP32:
        typed, size = cache.view(torch.float32), 4
    else:  # bf16 entries and the bf16 rope dims of fp8_ds_mla
        typed, size = cache.view(torch.bfloat16), 2
    page_bytes = cache.stride(0)
    return cache, typed, page_bytes, page_bytes // size, data_bytes // size


def _direct_ok(cache: torch.Tensor | None, fmt, code: int | None) -> bool:
    """The kernel reads ``cache`` directly: a known format and 4-byte aligned, row-major pages."""
    if cache is None:
        return True
    if code is None or cache.dtype != torch.uint8 or cache.dim() != 2:
        return False
    if cache.shape[0] and cache.shape[1] < fmt.min_page_bytes:
        raise ValueError(f"{fmt.name}: page of {cache.shape[1]} B < {fmt.min_page_bytes} B")
    return (cache.stride(1) == 1 and cache.stride(0) % 4 == 0 and cache.shape[1] % 4 == 0
            and cache.data_ptr() % 4 == 0)


def _format_code(fmt) -> int | None:
    code = _KNOWN.get(getattr(fmt, "name", None))
    if code is None:
        return None
    size = {FMT_FP32: 4, FMT_BF16: 2, FMT_FP8_DS_MLA: None}[code]
    if code == FMT_FP8_DS_MLA:
        ok = (fmt.dim == 512 and fmt.data_bytes == 576 and fmt.scale_bytes == 8)
    else:
        ok = fmt.data_bytes == size * fmt.dim and fmt.scale_bytes == 0
    return code if ok else None


def _dense_table(cache: torch.Tensor, slots: torch.Tensor, fmt, dim: int):
    """Generic path: distinct rows dequantized once by the format's codec -> (fp32 table [U, dim]
    as a uint8 "cache" with one entry per page, slots remapped into it)."""
    dev = slots.device
    if slots.numel() == 0:
        table = torch.zeros(1, dim, dtype=torch.float32, device=dev)
        return table.view(torch.uint8), slots
    uniq, inverse = torch.unique(slots.to(torch.int64), return_inverse=True)
    table = gather_rows(cache, uniq.to(cache.device), fmt).to(dev)  # -1 -> zero row, never read
    remapped = torch.where(slots >= 0, inverse, -1).to(torch.int32)
    return table.contiguous().view(torch.uint8), remapped


def _one_loop(wanted: bool | None, n_w: int, block_n: int, w_slots: torch.Tensor,
              c_slots: torch.Tensor) -> bool:
    """Whether the kernel takes the single loop over both caches: it selects a tile's slot row
    per tile, so the window must be whole tiles and both slot lists of one dtype."""
    return wanted is not False and n_w % block_n == 0 and w_slots.dtype == c_slots.dtype


def sparse_attention_triton(q: torch.Tensor, window_cache: torch.Tensor, window_slots: torch.Tensor,
                            comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None,
                            fmt, sink: torch.Tensor, scale: float, comp_fmt=None, *,
                            out: torch.Tensor | None = None,
                            num_splits: int | None = None, block_h: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, prefetch: bool | None = None,
                            maxnreg: int | None = None, cvt: int | None = None,
                            one_loop: bool | None = None, trim: bool | None = None,
                            poison_workspace: bool = False,
                            max_grid: int | None = None) -> torch.Tensor:
    """The op contract of ``ops.api.sparse_attention`` plus tuning / testing knobs: ``out``
    (written in full, q's dtype), forced ``num_splits`` / blocks / warps, ``poison_workspace``
    (fill the split workspace with NaN first: every element read must have been written),
    ``max_grid`` (programs per launch), ``one_loop`` (False: one loop per cache, as before the
    single loop; True / None: the single loop wherever the window is a multiple of the tile),
    ``trim`` (True: stop each walk after its last compressed candidate, ``_visited_end``; False:
    walk every tile, also those of -1 slots; None: ``SparseAttentionTuning.trim``) and
    ``cvt`` (the e4m3 decode, ``ptx_codecs.CVT_*``; e.g.
    CVT_INT: integer ops even where the GPU converts fp8 in hardware, as on Ascend)."""
    comp_fmt = fmt if comp_fmt is None else comp_fmt
    t, h, d, use_comp = check_sparse_attention_args(q, window_slots, comp_cache, comp_slots, fmt,
                                                     sink, comp_fmt)
    dev = q.device
    if out is None:
        out = torch.empty(t, h, d, dtype=q.dtype, device=dev)
    elif out.shape != (t, h, d) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"sparse_attention: out must be [T, H, D] {q.dtype} with contiguous rows")
    if t == 0 or h == 0:
        return out

    code = _format_code(fmt)
    direct = _direct_ok(window_cache, fmt, code) and (
        not use_comp or (_format_code(comp_fmt) == code and _direct_ok(comp_cache, comp_fmt, code)))
    w_slots = window_slots.to(dev).contiguous()
    c_slots = comp_slots.to(dev).contiguous() if use_comp else w_slots[:, :0]
    w_cache = window_cache
    c_cache = comp_cache if use_comp else window_cache
    if not direct:
        code = FMT_FP32
        w_cache, w_slots = _dense_table(window_cache, w_slots, fmt, d)
        if use_comp:
            c_cache, c_slots = _dense_table(comp_cache, c_slots, comp_fmt, d)
        else:
            c_cache = w_cache
        w_e = c_e = 1
        w_views = _cache_views(w_cache, 4 * d, code)
        c_views = _cache_views(c_cache, 4 * d, code)
    else:
        w_e = fmt.entries_per_page
        c_e = comp_fmt.entries_per_page if use_comp else w_e
        w_views = _cache_views(w_cache, fmt.data_bytes, code)
        c_views = _cache_views(c_cache, (comp_fmt if use_comp else fmt).data_bytes, code)
    w_cache_u8, w_typed, w_pb, w_pe, data_elems = w_views
    c_cache_u8, c_typed, c_pb, c_pe, _ = c_views

    qq = q if q.stride(-1) == 1 else q.contiguous()
    sink_f = sink.to(device=dev, dtype=torch.float32).contiguous()
    n_w = w_slots.shape[1]
    n_c = c_slots.shape[1]

    dot_bf16 = (dev.type != "cpu" and not _interpreting() and q.dtype == torch.bfloat16
                and code in (FMT_BF16, FMT_FP8_DS_MLA))
    cfg = _config(dev, t, h, getattr(fmt, "name", None), n_cand=n_w + n_c, bf16_dots=dot_bf16)
    bh = block_h or max(16, min(next_pow2(h), cfg["block_h"]))
    bn = block_n or cfg["block_n"]
    nw = num_warps or cfg["num_warps"]
    ns = num_stages or cfg["num_stages"]
    pf = cfg["prefetch"] if prefetch is None else bool(prefetch)
    launch_opts = dict(num_warps=nw, num_stages=ns)
    if (maxnreg or cfg["maxnreg"]) and dev.type == "cuda":
        launch_opts["maxnreg"] = maxnreg or cfg["maxnreg"]
    block_d = next_pow2(d)
    if code == FMT_FP8_DS_MLA:
        assert block_d == 512
    num_hb = cdiv(h, bh)
    splits, chunk = _plan_splits(t, num_hb, n_w + n_c, bn, cfg["min_chunk"], _num_cores(dev),
                                 num_splits, cfg.get("max_chunk"))
    split = splits > 1
    if split:
        ws_acc = torch.empty(t, h, splits, d, dtype=torch.float32, device=dev)
        ws_ml = torch.empty(t, h, splits, 2, dtype=torch.float32, device=dev)
        if poison_workspace:
            ws_acc.fill_(float("nan"))
            ws_ml.fill_(float("nan"))
    else:
        ws_acc = ws_ml = sink_f  # unused
    round_bf16 = _interpreting() and q.dtype == torch.bfloat16
    if cvt is None:
        cvt = CVT_INT if _interpreting() else e4m3_mode(dev)
    if code != FMT_FP8_DS_MLA:
        cvt = CVT_INT  # no e4m3 in the entries (one compiled variant less)
    qk_scale2 = float(scale) * _LOG2E
    one_loop = _one_loop(one_loop, n_w, bn, w_slots, c_slots)

    grid_cap = max_grid or grid_limit(dev)
    per_token = splits * num_hb
    tok_step = max(1, grid_cap // per_token)
    for t0 in range(0, t, tok_step):
        nt = min(tok_step, t - t0)
        _sparse_attn_fwd[(nt * per_token,)](
            qq, qq.stride(0), qq.stride(1),
            w_cache_u8, w_typed, w_slots, w_slots.stride(0), n_w, w_e, w_pb, w_pe,
            c_cache_u8, c_typed, c_slots, max(c_slots.stride(0), 1) if n_c else 0, n_c, c_e, c_pb,
            c_pe,
            sink_f, out, out.stride(0), out.stride(1), ws_acc, ws_ml,
            h, num_hb, splits, chunk, t0, qk_scale2,
            FMT=code, D=d, DATA_ELEMS=data_elems, BLOCK_H=bh, BLOCK_N=bn, BLOCK_D=block_d,
            CVT=cvt, DOT_BF16=dot_bf16, SPLIT=split, ROUND_BF16=round_bf16, PREFETCH=pf,
            ONE_LOOP=one_loop,
            TRIM=TRIM_BLOCK if ((tuning.current().sparse_attention.trim if trim is None else trim)
                                 and n_c) else 0,
            **launch_opts, **pdl_launch(dev),
        )
    if split:
        bdc = min(128, block_d)
        n_dc = cdiv(d, bdc)
        c_step = max(1, grid_cap // (h * n_dc))
        for t0 in range(0, t, c_step):
            nt = min(c_step, t - t0)
            _sparse_attn_combine[(nt * h, n_dc)](
                ws_acc, ws_ml, sink_f, out, out.stride(0), out.stride(1), h, splits, t0,
                D=d, BLOCK_S=next_pow2(splits), BLOCK_DC=bdc,
                ROUND_BF16=round_bf16, num_warps=4, **pdl_launch(dev),
            )
    return out


@register_op(SPARSE_ATTENTION, "triton")
def sparse_attention(q: torch.Tensor, window_cache: torch.Tensor, window_slots: torch.Tensor,
                     comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None,
                     fmt, sink: torch.Tensor, scale: float, comp_fmt=None) -> torch.Tensor:
    return sparse_attention_triton(q, window_cache, window_slots, comp_cache, comp_slots, fmt, sink,
                                   scale, comp_fmt)
