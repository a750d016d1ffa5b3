# SPDX-License-Identifier: Apache-2.0
"""The reference linear family.

``fp8_block_linear``: ``y = x @ dequant(weight)^T`` for an FP8 block-quantized weight
(e4m3 values, one ue8m0 scale per ``bn x bk`` block) kept as the checkpoint ships it.

Never dequantizes a whole weight: it walks the weight in tiles of whole row blocks (and, for very
long K, whole column blocks) of at most ``TILE_ELEMS`` dequantized elements, so the extra memory is
bounded independently of the weight's size (one tile in the math dtype, plus x in the math dtype).

Exact at both ends of the ue8m0 range (2^-127 .. 2^127): e4m3 * 2^127 overflows fp32, so each row
block is factored by c = its largest scale: the tile holds ``e4m3 * (s / c)`` (all <= 448, powers of
two times e4m3: exact), one matmul, and the output columns are multiplied by c (exact). Blocks of a
row block whose scales sit more than ``BAND`` binades below c (so far below that ``s / c`` would
underflow fp32 together with small activations) are handled in further bands with their own c:
one matmul per band, only where such spreads occur (never in real checkpoints). Math in fp32 for
bf16 / fp16 / fp32 x, float64 for float64 x; one rounding to ``out_dtype`` (default x's dtype).
``quantize_x`` first replaces x by :func:`quantize_activations` (exact in fp32 and float64).

:func:`check_fp8_block_linear_args` is the shared argument check of every backend of the op.

``dense_linear``: ``y = x @ weight^T`` with fp32 accumulation and one rounding.

One GEMM with fp32 output where the device's ``torch.mm`` takes ``out_dtype`` (CUDA bf16 / fp16),
else the operands upcast to fp32 (CPU: exact products, fp32 sums); float64 in float64.
:func:`check_dense_linear_args` is the shared argument check of every backend of the op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from vllm_dsv4_hw.numerics import e4m3_decode, fp8_block_quantize, pow2
from vllm_dsv4_hw.ops.api import DENSE_LINEAR, FP8_BLOCK_LINEAR
from vllm_dsv4_hw.ops.registry import register_op

# Largest dequantized tile (elements) held at once: 4 Mi (16 MiB in fp32) whatever the weight size.
TILE_ELEMS = 1 << 22
# Binades of scale spread handled by one matmul (fp32 math); wider spreads take one band each.
BAND = 32
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class Fp8LinearArgs(NamedTuple):
    """Validated arguments, always in grouped form (plain: G = 1)."""

    grouped: bool
    m: int
    g: int
    n: int
    k: int
    bn: int
    bk: int
    x: torch.Tensor  # [M, G, K] (a view of x)
    w: torch.Tensor  # uint8 [G, N, K] e4m3 bytes (a view of weight)
    s: torch.Tensor  # uint8 [G, ceil(N/bn), ceil(K/bk)] ue8m0 bytes (a view of scale)
    out_dtype: torch.dtype


def _bytes(t: torch.Tensor, name: str, fp8: torch.dtype) -> torch.Tensor:
    if t.dtype == fp8:
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise ValueError(
            f"fp8_block_linear: {name} must be {fp8} or its uint8 bytes, got {t.dtype}"
        )
    return t


def check_fp8_block_linear_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block,
    out_dtype: torch.dtype | None,
    x_dtype: torch.dtype | None = None,
) -> Fp8LinearArgs:
    """Validate ``fp8_block_linear`` inputs (one ValueError naming the tensor, the expected and the
    got shape); returns them as :class:`Fp8LinearArgs` (uint8 views, grouped form).
    ``x_dtype``: the dtype x's values take when x holds e4m3 codes (checked in its place)."""
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"fp8_block_linear: block must be (bn, bk), got {block!r}") from None
    if bn < 1 or bk < 1:
        raise ValueError(f"fp8_block_linear: block sizes must be positive, got {(bn, bk)}")
    x_dtype = x.dtype if x_dtype is None else x_dtype
    if x_dtype not in FLOAT_DTYPES:
        raise ValueError(f"fp8_block_linear: x must be one of {FLOAT_DTYPES}, got {x_dtype}")
    out_dtype = x_dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"fp8_block_linear: out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}"
        )
    w = _bytes(weight, "weight", torch.float8_e4m3fn)
    s = _bytes(scale, "scale", torch.float8_e8m0fnu)
    if x.dim() == 2:
        grouped = False
        m, k = x.shape
        g = 1
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(
                f"fp8_block_linear: weight must be [N, K={k}] for x {tuple(x.shape)}, "
                f"got {tuple(w.shape)}"
            )
        n = w.shape[0]
        want = (-(-n // bn), -(-k // bk))
    elif x.dim() == 3:
        grouped = True
        m, g, k = x.shape
        if w.dim() != 3 or w.shape[0] != g or w.shape[2] != k:
            raise ValueError(
                f"fp8_block_linear: weight must be [G={g}, N, K={k}] for grouped x "
                f"{tuple(x.shape)}, got {tuple(w.shape)}"
            )
        n = w.shape[1]
        want = (g, -(-n // bn), -(-k // bk))
    else:
        raise ValueError(f"fp8_block_linear: x must be [M, K] or [M, G, K], got {tuple(x.shape)}")
    if tuple(s.shape) != want:
        raise ValueError(
            f"fp8_block_linear: scale must be {list(want)} for weight "
            f"{tuple(w.shape)} and block {(bn, bk)}, got {tuple(s.shape)}"
        )
    if not grouped:
        x, w, s = x.unsqueeze(1), w.unsqueeze(0), s.unsqueeze(0)
    return Fp8LinearArgs(grouped, m, g, n, k, bn, bk, x, w, s, out_dtype)


def check_prequantized_x(
    x: torch.Tensor, x_scales: torch.Tensor, bk: int, out_dtype: torch.dtype | None
) -> torch.dtype:
    """``fp8_block_linear`` with ``x_scales``: x holds e4m3 codes and ``x_scales`` their fp32
    scales per row and ``bk`` block of K (checked here; one ValueError). Returns the output
    dtype, bf16 unless given."""
    if x.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(
            f"fp8_block_linear: with x_scales, x must be e4m3 codes "
            f"(torch.float8_e4m3fn or its uint8 bytes), got {x.dtype}"
        )
    want = (*x.shape[:-1], -(-x.shape[-1] // bk))
    if x_scales.dtype != torch.float32 or tuple(x_scales.shape) != want:
        raise ValueError(
            f"fp8_block_linear: x_scales must be float32 {list(want)} (one scale per "
            f"row and {bk}-column block of x), got {x_scales.dtype} "
            f"{tuple(x_scales.shape)}"
        )
    return torch.bfloat16 if out_dtype is None else out_dtype


def prequantized_values(x: torch.Tensor, x_scales: torch.Tensor, bk: int) -> torch.Tensor:
    """The fp32 values of checked e4m3 codes x and scales (exact: an e4m3 value times a power
    of two)."""
    codes = x.view(torch.float8_e4m3fn) if x.dtype == torch.uint8 else x
    return codes.float() * x_scales.repeat_interleave(bk, -1)[..., : x.shape[-1]]


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact 2^e (integer tensor e; fp32: -149 <= e <= 127, float64: -1022 <= e <= 1023)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return pow2(e)


def _tile_shape(m: int, k: int, bn: int, bk: int) -> tuple[int, int]:
    """(rows, cols) of a tile: whole row blocks (also bounding the [M, rows] partial product);
    whole K unless one row block of it is too big."""
    if bn * k <= TILE_ELEMS:
        return max(bn, TILE_ELEMS // max(k, m) // bn * bn), k
    return bn, max(bk, TILE_ELEMS // bn // bk * bk)


def quantize_activations(x: torch.Tensor, bk: int) -> torch.Tensor:
    """The e4m3 activation quantization of x [M, K] as fp32 values: per row and ``bk``-wide block
    of K (the last one may be shorter), the scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` and the
    codes of ``x / scale`` rounded to nearest even (``fp8_block_quantize``, the rule of the
    fp8_ds_mla cache entries and of DeepSeek's ``act_quant`` with ue8m0 scales); x is read as
    fp32. Every result is an e4m3 value times a power of two: exact in fp32 (and float64)."""
    m, k = x.shape
    kb = -(-k // bk)
    xf = torch.zeros(m, kb * bk, dtype=torch.float32, device=x.device)
    xf[:, :k] = x
    codes, e = fp8_block_quantize(xf.view(m, kb, bk))
    return (e4m3_decode(codes) * pow2(e)[..., None]).view(m, kb * bk)[:, :k]


@register_op(FP8_BLOCK_LINEAR, "reference")
def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
    quantize_x: bool = False,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    if x_scales is not None:  # the activations' own quantization given: its values, exact
        out_dtype = check_prequantized_x(x, x_scales, int(block[1]), out_dtype)
        x = prequantized_values(x, x_scales, int(block[1]))
        quantize_x = False
    a = check_fp8_block_linear_args(x, weight, scale, block, out_dtype)
    m, g, n, k, bn, bk = a.m, a.g, a.n, a.k, a.bn, a.bk
    out = torch.empty(m, g, n, dtype=a.out_dtype, device=x.device)
    if m and n and not k:
        out.zero_()
    elif m and n:
        md = torch.float64 if x.dtype == torch.float64 else torch.float32
        band = 1 << 30 if md == torch.float64 else BAND  # float64 holds 2^-254 ratios exactly
        rows, cols = _tile_shape(m, k, bn, bk)
        for gi in range(g):
            xg = (quantize_activations(a.x[:, gi], bk) if quantize_x else a.x[:, gi]).to(md)
            for n0 in range(0, n, rows):
                n1 = min(n, n0 + rows)
                out[:, gi, n0:n1] = _row_tile(
                    xg, a.w[gi, n0:n1], a.s[gi, n0 // bn : -(-n1 // bn)], bn, bk, cols, band, md
                ).to(a.out_dtype)
    return out if a.grouped else out[:, 0]


def _row_tile(
    xg: torch.Tensor,
    wb: torch.Tensor,
    sb: torch.Tensor,
    bn: int,
    bk: int,
    cols: int,
    band: int,
    md: torch.dtype,
) -> torch.Tensor:
    """x [M, K] (math dtype) @ dequant(wb [Nt, K] bytes, sb [R, KB] bytes)^T -> [M, Nt] (math)."""
    nt, k = wb.shape
    r = sb.shape[0]
    sbi = sb.to(torch.int32)
    cmax = sbi.amax(1)  # [R] largest scale byte per row block
    d = cmax[:, None] - sbi  # [R, KB] binades below c, >= 0
    n_bands = int(d.max()) // band + 1 if d.numel() else 1
    wq = wb.view(torch.float8_e4m3fn)
    acc = None
    for j in range(n_bands):
        # this band's blocks scaled by s / c_j (c_j = c * 2^(-j*band)) in (2^-band, 1]; others 0
        dj = d - j * band
        if n_bands == 1:
            ratio = _pow2(-dj, md)
        else:
            ratio = torch.where(
                (dj >= 0) & (dj < band),
                _pow2(-dj.clamp(0, band - 1), md),
                torch.zeros((), dtype=md),
            )
        c = _pow2(cmax - 127 - j * band, md).repeat_interleave(bn)[:nt]  # [Nt] per output column
        for k0 in range(0, k, cols):
            k1 = min(k, k0 + cols)
            kb0, kb1 = k0 // bk, -(-k1 // bk)
            # the tile padded to whole blocks, so the ratio multiplies as a [R, 1, KBs, 1] broadcast
            shape = (r * bn, (kb1 - kb0) * bk)
            ragged = shape != (nt, k1 - k0)
            buf = (torch.zeros if ragged else torch.empty)(shape, dtype=md, device=xg.device)
            buf[:nt, : k1 - k0].copy_(wq[:, k0:k1])
            buf.view(r, bn, kb1 - kb0, bk).mul_(ratio[:, None, kb0:kb1, None])
            part = (xg[:, k0:k1] @ buf[:nt, : k1 - k0].t()).mul_(c)
            acc = part if acc is None else acc.add_(part)
    return acc


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_MM_OUT_DTYPE: dict[str, bool] = {}  # per device type: does torch.mm take out_dtype=fp32


def check_dense_linear_args(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.dtype]:
    """Validate (one ValueError naming the tensor, expected and got); returns (x in weight's
    dtype, the output dtype)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dense_linear: {name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"dense_linear: out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"dense_linear: x must be [M, K] and weight [N, K], got x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if x.dtype == torch.float64 or weight.dtype == torch.float64:
        return x.double(), out_dtype
    return x.to(weight.dtype), out_dtype


def linear_acc(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T (same dtype) with fp32 accumulation and fp32 result (float64 for float64)."""
    if x.dtype in (torch.float32, torch.float64):
        return x @ w.to(x.dtype).t()
    dev = x.device.type
    if _MM_OUT_DTYPE.get(dev, True):
        try:
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE[dev] = True
            return y
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[dev] = False  # this device's mm has no fp32 output for these dtypes
    return x.float() @ w.float().t()


@register_op(DENSE_LINEAR, "reference")
def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    x, out_dtype = check_dense_linear_args(x, weight, out_dtype)
    if out_dtype == x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return F.linear(x, weight)  # fp32 accumulation inside, one rounding, one launch
    return linear_acc(x, weight).to(out_dtype)
