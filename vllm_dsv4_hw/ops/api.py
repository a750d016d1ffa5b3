# SPDX-License-Identifier: Apache-2.0
"""The op contracts: what every backend implements, and the dispatched entry points call sites use.

Each function below resolves its implementation once per device type through the registry (the
device is taken from the first tensor argument) and calls it. Shapes: T = tokens of all requests in
the batch (varlen, concatenated), H = attention heads, D = head dim (512), R = rope dims (64, the last
R dims of each vector), d = compressor output dim (512 main, 128 indexer).

Paged caches: a cache is a uint8 tensor ``[num_pages, page_bytes]`` laid out by an entry format
(``kv_cache.formats``); a *slot* is ``page * entries_per_page + offset``; slot -1 means "none".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dsv4_hw.ops.registry import REGISTRY

# Op names: one per contract below. Backends register implementations under these names.
RMS_NORM = "rms_norm"
ROPE = "rope"
COMPRESSOR_POOL = "compressor_pool"
COMPRESSOR_STORE = "compressor_store"
INDEXER_TOPK = "indexer_topk"
SPARSE_ATTENTION = "sparse_attention"
KV_INSERT = "kv_insert"
KV_GATHER = "kv_gather"

ALL_OPS = (RMS_NORM, ROPE, COMPRESSOR_POOL, COMPRESSOR_STORE, INDEXER_TOPK, SPARSE_ATTENTION)
ALL_OPS = ALL_OPS + (KV_INSERT, KV_GATHER)


def _impl(op: str, t: torch.Tensor):
    return REGISTRY.resolve(op, t.device).impl.fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 math; ``weight=None`` is the weightless form. Same dtype out."""
    return _impl(RMS_NORM, x)(x, weight, eps)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """GPT-J interleaved RoPE on the last R dims of ``x`` [T, ..., D] at ``positions`` [T].

    ``cos_sin`` [P, R]: row p holds cos of the R/2 angles, then their sin (``ops.reference.rope``
    builds it). Pairs (2j, 2j+1) of the rotated part rotate by angle j. ``inverse`` rotates by the
    negated angle (conjugate). Returns a new tensor, same dtype; dims before the last R untouched.
    """
    return _impl(ROPE, x)(x, positions, cos_sin, inverse)


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    ape: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    group_rows: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    """Write new tokens' rows into the compressor state, then pool every completed group.

    kv, score: [T, coff*d] fp32 (W_kv x, W_gate x; ``ape[pos % ratio]`` is added to score here).
    state: [S, 2*coff*d] fp32 rows (kv | score), written in place at ``state_slots`` [T].
    group_rows: [G, coff*ratio] state slots of each completed group's member rows, oldest first
    (-1 = absent: kv 0, score -inf). For ratio 4 (coff 2) rows 0..3 are the previous group (channels
    [0, d)) and rows 4..7 the group itself (channels [d, 2d)); for ratio 128 (coff 1) the 128 rows.
    Returns the pooled entries [G, d] fp32 (before RMSNorm / RoPE).
    """
    return _impl(COMPRESSOR_POOL, kv)(
        kv, score, positions, ape, state, state_slots, group_rows, ratio
    )


def compressor_store(
    kv,
    score,
    positions,
    ape,
    state,
    state_slots,
    group_rows,
    ratio,
    norm_weight,
    eps,
    cos_sin,
    group_entry_index,
    cache,
    cache_slots,
    fmt,
) -> None:
    """``compressor_pool`` + RMSNorm_w + RoPE at position ``ratio * group_entry_index`` + quantize
    and insert into the paged ``cache`` at ``cache_slots`` [G] with entry format ``fmt``."""
    return _impl(COMPRESSOR_STORE, kv)(
        kv,
        score,
        positions,
        ape,
        state,
        state_slots,
        group_rows,
        ratio,
        norm_weight,
        eps,
        cos_sin,
        group_entry_index,
        cache,
        cache_slots,
        fmt,
    )


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_fmt,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    topk: int,
    ratio: int = 4,
    q_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning-indexer top-k over each token's visible compressed entries.

    q [T, Hi, Di] (RoPE applied), weights [T, Hi] fp32 (already scaled by Di^-0.5 * Hi^-0.5).
    ``q_scales`` [T, Hi] fp32 positive (optional): q holds e4m3 codes (torch.float8_e4m3fn, from
    ``rope_fp8_quant``) and the query is q * q_scales[..., None], exactly (so backends may fold
    the scale into the weights: relu commutes with a positive factor).
    Keys of request r, entry s live at slot ``block_table[r, s // E] * E + s % E`` with
    E = key_fmt entries per page. Score(t, s) = sum_h w[t,h] * relu(q[t,h] . k[s]); entry s is visible
    to token t iff ratio*s + ratio - 1 <= token_pos[t]. Returns [T, topk] int32 entry indices,
    the top min(topk, visible) first, -1 after. The selected entries are a set: the reference
    returns them in descending score, other backends in any order (the Triton one unsorted).
    """
    return _impl(INDEXER_TOPK, q)(
        q, weights, key_cache, key_fmt, block_table, token_req, token_pos, topk, ratio, q_scales
    )


def sparse_attention(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    comp_cache: torch.Tensor | None,
    comp_slots: torch.Tensor | None,
    fmt,
    sink: torch.Tensor,
    scale: float,
    comp_fmt=None,
) -> torch.Tensor:
    """One softmax per (token, head) over window candidates plus compressed candidates, with sink.

    q [T, H, D]; window_slots [T, W] and comp_slots [T, K] int (physical slots, -1 = none) into the
    paged caches: the window cache in entry format ``fmt``, the compressed cache in ``comp_fmt``
    (default ``fmt``; c128a pages hold 2 entries against the window's 64, so the two differ in
    ``entries_per_page``). sink [H] fp32 only enlarges the denominator.
    Returns o [T, H, D] in q's dtype (a token with no candidates gets zeros).
    """
    return _impl(SPARSE_ATTENTION, q)(
        q, window_cache, window_slots, comp_cache, comp_slots, fmt, sink, scale, comp_fmt=comp_fmt
    )


def kv_insert(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    """Quantize rows x [N, dim] with ``fmt`` and write them at ``slots`` [N] (-1 skipped)."""
    return _impl(KV_INSERT, x)(cache, slots, x, fmt)


def kv_gather(cache: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    """Dequantized rows at ``slots`` (any shape S) -> [*S, dim] fp32; slot -1 gives zeros."""
    return _impl(KV_GATHER, cache)(cache, slots, fmt)


# The indexer's selection as cache slots (decode: one launch instead of ~14 small torch ops).
ENTRY_SLOTS = "entry_slots"

ALL_OPS = ALL_OPS + (ENTRY_SLOTS,)


def entry_slots(
    block_table: torch.Tensor, token_req: torch.Tensor, idx: torch.Tensor, per_page: int
) -> torch.Tensor:
    """Paged-cache slots [T, K] int64 of logical entry indices ``idx`` [T, K] (int32 / int64) of
    each token's request: ``block_table[token_req[t], i // per_page] * per_page + i % per_page``;
    -1 where i < 0, the page is absent (< 0) or i lies past the table's columns. No host
    synchronization and no validation (the indices come from ``indexer_topk``: visible entries;
    ``kv_cache.paged.logical_to_slot`` is the validating form)."""
    return _impl(ENTRY_SLOTS, idx)(block_table, token_req, idx, per_page)


# -- fused prologue / epilogue ops (issue 4) ------------------------------------------------------
# Each is exactly the composition of the ops above that its docstring names (the reference backend
# composes them); accelerated backends fuse them into one launch. Call sites may use either form.
QNORM_ROPE_KV_INSERT = "qnorm_rope_kv_insert"
INV_ROPE_FP8_QUANT = "inv_rope_fp8_quant"
QKV_RMS_NORM = "qkv_rms_norm"

ALL_OPS = ALL_OPS + (QNORM_ROPE_KV_INSERT, INV_ROPE_FP8_QUANT, QKV_RMS_NORM)

# inv_rope_fp8_quant: FP8 group size and the floor on a group's amax before its scale is taken
# (vLLM's fused_inv_rope_fp8_quant uses eps=1e-10 here; the KV cache formats use 1e-4).
O_QUANT_GROUP = 128
O_QUANT_AMAX_FLOOR = 1e-10


def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    fmt,
) -> torch.Tensor:
    """Query prologue + window-KV insert of one layer (spec section 2, steps 2-3).

    q [T, H, D] (W_qb q_r), kv [T, D] (already ``RMSNorm_w``-ed upstream), positions [T] int,
    cos_sin [P, R] (as ``rope``), window_slots [T] int (physical slots of ``window_cache``, entry
    format ``fmt`` with fmt.dim == D; -1 = do not insert). Returns a new q_out [T, H, D] in q's dtype:
        q_out = rope(rms_norm(q, None, eps), positions, cos_sin)   (per head, weightless)
    and, in place, ``kv_insert(window_cache, window_slots, rope(kv, positions, cos_sin), fmt)``.
    Intermediates stay in fp32 (one rounding of q_out; the cache format does its own rounding).
    """
    return _impl(QNORM_ROPE_KV_INSERT, q)(
        q, kv, positions, cos_sin, eps, window_cache, window_slots, fmt
    )


def inv_rope_fp8_quant(
    o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-output epilogue (spec section 2, step 6 + the input of step 7).

    o [T, H, D] -> x = rope(o, positions, cos_sin, inverse) in fp32 (not rounded), then FP8 per
    128-dim group g of each head: s = 2^ceil(log2(max(amax_g, O_QUANT_AMAX_FLOOR) / 448)) (a power
    of two, exact), o_fp8 = e4m3(clamp(x / s, -448, 448)) (round to nearest even).
    Returns (o_fp8 [T, H, D] torch.float8_e4m3fn, scales [T, H, D/128] fp32 = s); D % 128 == 0.
    Dequantized value: o_fp8.float() * scales.repeat_interleave(128, -1).
    ``inverse=False`` (``rope_fp8_quant``): the forward rotation, for the indexer's q^I.
    """
    return _impl(INV_ROPE_FP8_QUANT, o)(o, positions, cos_sin, inverse)


def rope_fp8_quant(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE, then the same FP8 group quantization: ``inv_rope_fp8_quant(..., inverse=False)``.
    The indexer's q^I [T, Hi, 128] -> e4m3 codes and one power-of-two scale per (token, head),
    which ``indexer_topk`` takes as ``q_scales`` (upstream vLLM's indexer quantizes q^I so too)."""
    return _impl(INV_ROPE_FP8_QUANT, x)(x, positions, cos_sin, False)


def qkv_rms_norm(
    q_r: torch.Tensor, q_w: torch.Tensor, kv: torch.Tensor, kv_w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both input RMSNorms of a layer at once (horizontal fusion, one launch):
    (rms_norm(q_r, q_w, eps), rms_norm(kv, kv_w, eps)) for q_r [T, q_lora] and kv [T, D] of one
    dtype (rows may be strided, e.g. column slices of one fused projection). New tensors, same dtype.
    """
    return _impl(QKV_RMS_NORM, q_r)(q_r, q_w, kv, kv_w, eps)


# -- weights as shipped (issue 12) -----------------------------------------------------------------
# The checkpoint's quantized weights stay resident in their formats (``vllm_dsv4_hw/quant``); these
# two ops are their matmuls. Every backend applies each scale to the fp32 partial sum of its block
# (never to a dequantized weight), so any ue8m0 byte 0..254 is exact as long as the result is
# representable; the reference dequantizes one bounded tile at a time, never a whole weight.
FP8_BLOCK_LINEAR = "fp8_block_linear"
MOE_EXPERTS = "moe_experts"
DENSE_LINEAR = "dense_linear"

ALL_OPS = ALL_OPS + (FP8_BLOCK_LINEAR, MOE_EXPERTS, DENSE_LINEAR)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``y = x @ weight^T`` for the projections the checkpoints ship in a float dtype (the
    compressors' merged ``wkv | wgate``, the indexer's ``weights_proj``; every linear of a bf16
    checkpoint): x [M, K], weight [N, K] -> y [M, N]. Math: fp32 accumulation of the exact
    products (float64 for float64 x or weight), rounded once to ``out_dtype`` (default x's dtype);
    x is first cast to weight's dtype where the two differ (as ``F.linear`` needs)."""
    return _impl(DENSE_LINEAR, x)(x, weight, out_dtype)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
    quantize_x: bool = False,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ dequant(weight)^T`` for an FP8 block-quantized weight as the checkpoint ships it.

    Plain: x [M, K], weight [N, K] e4m3 (``torch.float8_e4m3fn`` or its uint8 bytes), scale
    [ceil(N/bn), ceil(K/bk)] ue8m0 (``torch.float8_e8m0fnu`` or its uint8 bytes; value
    2^(byte - 127)) -> y [M, N]. Grouped (the grouped output projection ``wo_a``): x [M, G, K],
    weight [G, N, K], scale [G, ceil(N/bn), ceil(K/bk)] -> y [M, G, N]. ``block = (bn, bk)`` is the
    checkpoint's ``weight_block_size`` (128x128 for V4, 32x32 for V4.1).
    Math: ``y[m, n] = sum_kb s[n // bn, kb] * sum_{k in block kb} x[m, k] * e4m3(weight[n, k])`` with
    fp32 accumulation (float64 for float64 x), rounded once to ``out_dtype`` (default x's dtype).
    ``quantize_x``: x is first replaced by its e4m3 quantization, the checkpoint's dynamic
    activation scheme (``ops.reference.fp8_linear.quantize_activations``: per row and ``bk``-wide
    block of K, a power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, codes rounded to
    nearest even), so backends with FP8 x FP8 tensor-core dots read both operands as e4m3.
    ``x_scales``: x is already quantized, as e4m3 codes (``torch.float8_e4m3fn``) with fp32 scales
    ``x_scales [M, (G,) ceil(K/bk)]``, one per row and ``bk`` block (a producer's own quantization,
    e.g. ``inv_rope_fp8_quant``'s for the o projection); y is as for x = codes * scales (exact in
    fp32), ``out_dtype`` bf16 unless given; ``quantize_x`` is then moot.
    """
    return _impl(FP8_BLOCK_LINEAR, x)(
        x, weight, scale, block, out_dtype, quantize_x, x_scales=x_scales
    )


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    swiglu_limit: float | None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts of one MoE layer (routing stays in the model):
    ``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) (+ add[t])`` -> [T, D] fp32
    (float64 for float64 x). ``add`` [T, D] (the shared expert's output, any float dtype) is added
    to the slot sum last, in the math dtype, so that the MoE needs no add of its own.

    x [T, D]; topk_weights [T, k] fp32; topk_ids [T, k] int, expert ids in [0, E) or -1 (a slot that
    contributes nothing, e.g. an expert held by another rank). Expert e is a clamped SwiGLU:
    ``h = w13[e] x`` (rows 0..I-1 the gate w1, rows I..2I-1 the up projection w3; fp32, not rounded),
    ``a = silu(min(h_gate, L)) * clamp(h_up, -L, L)`` (L = ``swiglu_limit``; None or <= 0: no
    clamp), rounded to x's dtype, then ``w2[e] a`` in fp32.
    Weights, either FP4 as shipped: w13 uint8/int8 [E, 2I, D/2] (two e2m1 codes per byte, element 2j
    in the low nibble), w13_scale ue8m0 [E, 2I, D/32] (one per 32 consecutive elements along D), w2
    [E, D, I/2] with w2_scale [E, D, I/32]; or dense: w13 [E, 2I, D] and w2 [E, D, I] in a float
    dtype with both scales None. The k contributions of a token are summed in slot order (k = 0
    first), so results do not depend on how tokens are grouped by expert.
    """
    return _impl(MOE_EXPERTS, x)(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, swiglu_limit, add
    )


# -- graph-safe decode metadata (issue 12) ---------------------------------------------------------
DECODE_METADATA = "decode_metadata"

ALL_OPS = ALL_OPS + (DECODE_METADATA,)


@dataclass(frozen=True)
class DecodeLayout:
    """The static geometry of one layer kind's decode metadata: positions / entries / rows per
    page of each cache, the state matrices' row stride between pages, the c128a candidate width
    (``max_comp_entries``: every entry a position below the model length can see) and the page id
    that marks "no page" (``null_page``: -1 in our tables, vLLM's null block 0 in its tables; ids
    <= null_page are absent)."""

    ratio: int
    sliding_window: int
    window_per_page: int
    comp_per_page: int = 0
    indexer_per_page: int = 0
    main_state_per_page: int = 0
    main_state_stride: int = 0
    indexer_state_per_page: int = 0
    indexer_state_stride: int = 0
    max_comp_entries: int = 0
    null_page: int = -1


def decode_metadata(
    seq_lens: torch.Tensor, tables: dict[str, torch.Tensor], layout: DecodeLayout
) -> dict[str, torch.Tensor]:
    """Index metadata of a decode step (one new token per row) with fixed shapes and no host
    synchronization, so that it can be captured in a device graph and replayed.

    seq_lens [B] int: tokens cached after the step (row b decodes position seq_lens[b] - 1); 0 is
    a padding row, whose every slot comes out -1 (nothing read, nothing written). tables: block
    tables [B, *] of the kind's caches (keys ``window``, ``comp``, ``indexer``, ``main_state``,
    ``indexer_state`` as the kind has them). Returns int64 tensors:

    * ``positions`` [B], ``window_insert_slots`` [B], ``window_slots`` [B, W] (oldest first; -1
      for positions < 0 or absent pages);
    * per compressor (``main.`` and, c4a, ``indexer.``): ``state_slots`` [B] (row of the state
      matrix: page * stride + offset), ``group_rows`` [B, coff*ratio] (the group's member rows when
      the token completes an entry, else all -1), ``entry`` [B] (the completed entry's index, 0 when
      none) and ``cache_slots`` [B] (its cache slot, -1 when none);
    * c128a: ``comp_slots`` [B, K] (slots of entries 0 .. seq_lens // 128 - 1, -1 after);
    * ``comp_table`` / ``indexer_table``: those tables with absent pages as -1.
    Values equal ``build_step_metadata`` of the same step (its plans padded to one group per row).
    """
    return _impl(DECODE_METADATA, seq_lens)(seq_lens, tables, layout)


# -- mHC: the hyper-connection seams around every sub-block (issue 45) ----------------------------
# Shapes: h [T, hc, D] the residual streams (stream dtype: bf16 / fp32 / fp64), y [T, D] a
# sub-block's output, post [T, hc] and comb [T, hc, hc] in the mix dtype (fp32; fp64 for fp64
# streams), fn [(2 + hc) * hc, hc * D], scale [3], base [(2 + hc) * hc] (mix dtype), norm_w [D]
# the next sub-block's RMSNorm weight. The math: ``ops.reference.mhc``'s docstring; the model's
# ``rms_norm_eps`` serves both the mix's weightless norm and the sub-block's RMSNorm.
HC_PRE = "hc_pre"
HC_POST = "hc_post"
HC_SEAM = "hc_seam"

ALL_OPS = ALL_OPS + (HC_PRE, HC_POST, HC_SEAM)


def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_w: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixes of the sub-block after ``h`` and its normalised input: returns
    ``(rms_norm(x, norm_w, eps), post, comb)`` where ``x = sum_j pre_j h_j`` is rounded once to
    h's dtype before the norm (``x`` [T, D] and its norm in h's dtype; post / comb as above)."""
    return _impl(HC_PRE, h)(h, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)


def hc_post(
    y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams ``h'_k = post_k * y + sum_j comb[j, k] h_j`` [T, hc, D] in h's dtype (mix-dtype
    math, one rounding); y of any float dtype is first rounded to h's (the MoE's fp32 sum)."""
    return _impl(HC_POST, h)(y, h, post, comb)


def hc_seam(
    y: torch.Tensor,
    h: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_w: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seam between two sub-blocks: ``h2 = hc_post(y, h, post, comb)``, then ``hc_pre(h2,
    fn, scale, base, norm_w, ...)``; returns ``(h2, x_normed, post2, comb2)`` (backends fuse it)."""
    return _impl(HC_SEAM, h)(y, h, post, comb, fn, scale, base, norm_w, sinkhorn_iters, hc_eps, eps)


# -- MoE routing and the experts' activation (issue 45) -------------------------------------------
MOE_ROUTE = "moe_route"
SWIGLU = "swiglu"

ALL_OPS = ALL_OPS + (MOE_ROUTE, SWIGLU)


def moe_route(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V4's router: ``(weights [T, k] fp32, ids [T, k] int64)`` for x [T, D] and the gate
    weight gate_w [E, D] (math in fp32, fp64 for fp64 x). ``s = sqrt(softplus(x @ gate_w^T))``;
    top-k layers (``hash_ids`` None) take the k experts with the largest ``s + bias`` (bias [E] or
    None; it only selects), in descending order, equal values by the lower expert id first;
    hash-routed layers take ``hash_ids`` [T, k] (the tokens' ``tid2eid`` rows) in their order.
    Weights: the selected ``s``, divided by their sum (+1e-20) when ``norm_topk_prob``, times
    ``scaling``. Slot j of the result is the j-th expert so ordered."""
    return _impl(MOE_ROUTE, x)(x, gate_w, bias, hash_ids, top_k, norm_topk_prob, scaling)


def swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU of a merged gate | up projection h [T, 2I] (gate columns first; rows may be
    strided): ``silu(min(gate, L)) * clamp(up, -L, L)`` [T, I] in h's dtype (L = ``limit``; None
    or <= 0: no clamp), fp32 math (fp64 for fp64 h), one rounding."""
    return _impl(SWIGLU, h)(h, limit)
