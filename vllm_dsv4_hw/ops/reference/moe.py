# SPDX-License-Identifier: Apache-2.0
"""Reference routed experts (``moe_experts``) with the weights as shipped: FP4 e2m1 + ue8m0, or
dense.

Why it looks like this:

* one stable sort groups the (token, slot) pairs by expert, and a host loop visits only the experts
  that got pairs (the reference may synchronize; the Triton backend does not);
* FP4 weights are dequantized one expert at a time, in row tiles of bounded size, never all experts
  (a V4-Flash layer's 256 experts are ~25 GB once dequantized to fp32);
* a ue8m0 scale spans 2^-127 .. 2^127 and ``6 * 2^127`` overflows fp32, so each output row n is
  factored: ``c_n = max_g s[n, g]``, the tile holds ``e2m1 * (s / c_n)`` (<= 6, exact) and the
  matmul's row n is multiplied by ``c_n`` afterwards; any byte is exact while the result is
  representable (in fp32 a group more than 2^149 below its row's largest scale underflows to 0:
  its share of the row is below fp32 resolution unless x is far larger there);
* each pair's row is its own M=1 product (:func:`_rowwise_mm`), so its bits do not depend on the
  other rows of its expert;
* every pair's weighted output lands at its (token, slot) position of a ``[T, k, D]`` buffer and the
  slots are added in slot order, so the result does not depend on how tokens group by expert.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.numerics import FP4_BLOCK, e2m1_decode, ue8m0_decode, unpack_nibbles
from vllm_dsv4_hw.ops.api import MOE_EXPERTS, MOE_ROUTE, SWIGLU
from vllm_dsv4_hw.ops.registry import register_op

# Elements of one dequantized weight tile (rows x K): 4M fp32 values = 16 MiB.
TILE_ELEMENTS = 1 << 22

_FP4_DTYPES = (torch.int8, torch.uint8)
_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def _shape_error(name: str, t: torch.Tensor, want: str) -> ValueError:
    return ValueError(f"moe_experts: {name} must be {want}, got {t.dtype} {tuple(t.shape)}")


def validate_moe_args(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale):
    """Shape / dtype checks shared by the backends (no data access: graph-safe).

    Returns ``(E, I, fp4)``; raises one ValueError naming the tensor and the expected shape."""
    if x.dim() != 2 or not x.is_floating_point():
        raise _shape_error("x", x, "a float [T, D] tensor")
    t, d = x.shape
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != t
        or topk_ids.is_floating_point()
        or topk_ids.dtype == torch.bool
    ):
        raise _shape_error("topk_ids", topk_ids, f"an integer [T={t}, k] tensor")
    k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (t, k) or not topk_weights.is_floating_point():
        raise _shape_error("topk_weights", topk_weights, f"a float [T={t}, k={k}] tensor")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError(
            "moe_experts: w13_scale and w2_scale must both be given (FP4) or both be None (dense)"
        )
    fp4 = w13_scale is not None
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise _shape_error("w13", w13, "[E, 2I, D/2] (FP4) or [E, 2I, D] (dense)")
    e, i = w13.shape[0], w13.shape[1] // 2
    if fp4:
        if d % FP4_BLOCK or i % FP4_BLOCK:
            raise ValueError(
                f"moe_experts: FP4 experts need D and I multiples of {FP4_BLOCK}, got D={d}, I={i}"
            )
        for name, w, want in (("w13", w13, (e, 2 * i, d // 2)), ("w2", w2, (e, d, i // 2))):
            if tuple(w.shape) != want or w.dtype not in _FP4_DTYPES:
                raise _shape_error(name, w, f"int8/uint8 {list(want)}")
        for name, s, want in (
            ("w13_scale", w13_scale, (e, 2 * i, d // FP4_BLOCK)),
            ("w2_scale", w2_scale, (e, d, i // FP4_BLOCK)),
        ):
            if tuple(s.shape) != want or s.dtype not in _SCALE_DTYPES:
                raise _shape_error(name, s, f"ue8m0 (float8_e8m0fnu or uint8) {list(want)}")
    else:
        for name, w, want in (("w13", w13, (e, 2 * i, d)), ("w2", w2, (e, d, i))):
            if tuple(w.shape) != want or not w.is_floating_point() or w.element_size() == 1:
                raise _shape_error(name, w, f"a float (bf16/fp16/fp32/fp64) {list(want)}")
    return e, i, fp4


def _row_factored_tile(packed: torch.Tensor, scale: torch.Tensor, md: torch.dtype):
    """FP4 rows [n, K/2] + scales [n, K/32] -> (e2m1 * s / c [n, K] in ``md``, c [n] in ``md``)."""
    n = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed.view(torch.uint8))).to(md)
    s = ue8m0_decode(scale).to(md)  # exact: 2^-127 .. 2^127 fit fp32
    c = s.amax(dim=1)
    rel = (s / c[:, None]).repeat_interleave(FP4_BLOCK, dim=1)  # powers of two <= 1 (exact)
    return (vals * rel).reshape(n, -1), c


def _rowwise_mm(xr: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``xr [n, K] @ wt [N, K]^T`` as n separate M=1 products (one bmm over a stride-0 weight): a
    row's bits then do not depend on which other rows share the expert (a plain mm's M-blocking
    changes them, e.g. MKL for n = 7), so permuting tokens permutes the output bit-exactly."""
    n = xr.shape[0]
    return torch.bmm(xr.unsqueeze(1), wt.t().unsqueeze(0).expand(n, -1, -1)).squeeze(1)


def expert_linear(
    xr: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, md: torch.dtype
) -> torch.Tensor:
    """``xr [n, K] (md) @ W^T`` for one expert's weight W [N, K] (FP4 rows + scales, or dense),
    dequantized in row tiles of at most ``TILE_ELEMENTS`` -> [n, N] in ``md``."""
    rows, k = w.shape[0], xr.shape[1]
    step = max(1, TILE_ELEMENTS // max(k, 1))
    out = torch.empty(xr.shape[0], rows, dtype=md, device=xr.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if s is None:
            out[:, r0:r1] = _rowwise_mm(xr, w[r0:r1].to(md))
        else:
            wt, c = _row_factored_tile(w[r0:r1], s[r0:r1], md)
            out[:, r0:r1] = _rowwise_mm(xr, wt) * c
    return out


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` (no clamp for L None or <= 0): every expert's
    activation, routed (``moe_experts``) and shared (``swiglu``)."""
    if limit is not None and limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def sum_slots(buf: torch.Tensor) -> torch.Tensor:
    """[T, k, D] -> [T, D], adding slot 0, then 1, ... (a fixed order every backend shares)."""
    out = buf[:, 0].clone()
    for j in range(1, buf.shape[1]):
        out += buf[:, j]
    return out


@register_op(MOE_EXPERTS, "reference")
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
    """See ``ops.api.moe_experts``. Math in fp32 (float64 for float64 x)."""
    n_exp, inter, fp4 = validate_moe_args(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale)
    check_addend(x, add)
    md = torch.float64 if x.dtype == torch.float64 else torch.float32
    t, d = x.shape
    k = topk_ids.shape[1]
    buf = torch.zeros(t, k, d, dtype=md, device=x.device)
    if t == 0 or k == 0:
        return buf.sum(dim=1) if add is None else add.to(md)
    flat = topk_ids.reshape(-1).to(torch.int64)
    bad = (flat < -1) | (flat >= n_exp)
    if bool(bad.any()):
        raise ValueError(f"moe_experts: topk_ids must be in [-1, {n_exp}), got {int(flat[bad][0])}")
    order = torch.argsort(flat, stable=True)  # -1 slots first, then expert 0, 1, ...
    counts = torch.bincount(flat + 1, minlength=n_exp + 1).tolist()
    w_flat = topk_weights.reshape(-1).to(md)
    buf_flat = buf.view(t * k, d)
    start = counts[0]  # skip the -1 slots
    for e in range(n_exp):
        n = counts[e + 1]
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        xr = x[pairs // k].to(md)
        h = expert_linear(xr, w13[e], None if not fp4 else w13_scale[e], md)
        act = swiglu_clamped(h[:, :inter], h[:, inter:], swiglu_limit).to(x.dtype).to(md)
        y = expert_linear(act, w2[e], None if not fp4 else w2_scale[e], md)
        buf_flat[pairs] = y * w_flat[pairs, None]
    out = sum_slots(buf)
    return out if add is None else out.add_(add.to(md))


def check_addend(x: torch.Tensor, add: torch.Tensor | None) -> None:
    """``moe_experts``' ``add``: None or a float [T, D] like x."""
    if add is not None and (tuple(add.shape) != tuple(x.shape) or not add.is_floating_point()):
        raise ValueError(
            f"moe_experts: add must be a float [T, D] = {tuple(x.shape)} tensor, got "
            f"{add.dtype} {tuple(add.shape)}"
        )


def _check_route_args(x, gate_w, bias, hash_ids, top_k) -> None:
    if x.dim() != 2 or gate_w.dim() != 2 or gate_w.shape[1] != x.shape[1]:
        raise ValueError(
            f"moe_route: x must be [T, D] and gate_w [E, D], got {tuple(x.shape)} / "
            f"{tuple(gate_w.shape)}"
        )
    e = gate_w.shape[0]
    if not 0 < top_k <= e:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, E={e}]")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"moe_route: bias must be [E={e}], got {tuple(bias.shape)}")
    if hash_ids is not None and tuple(hash_ids.shape) != (x.shape[0], top_k):
        raise ValueError(
            f"moe_route: hash_ids must be [T={x.shape[0]}, k={top_k}], got {tuple(hash_ids.shape)}"
        )


def router_scores(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x @ gate_w^T))`` [T, E] in fp32 (fp64 for fp64 x)."""
    md = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.nn.functional.softplus(x.to(md) @ gate_w.to(md).T).sqrt()


@register_op(MOE_ROUTE, "reference")
def moe_route(x, gate_w, bias, hash_ids, top_k, norm_topk_prob, scaling):
    _check_route_args(x, gate_w, bias, hash_ids, top_k)
    scores = router_scores(x, gate_w)
    if hash_ids is not None:
        idx = hash_ids.to(torch.int64)
    else:
        sel = scores if bias is None else scores + bias.to(scores.dtype)
        # descending, equal values lower id first (a stable sort keeps index order among ties)
        idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, idx


@register_op(SWIGLU, "reference")
def swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: h must be [T, 2I], got {tuple(h.shape)}")
    md = torch.float64 if h.dtype == torch.float64 else torch.float32
    gate, up = h.to(md).chunk(2, dim=-1)
    return swiglu_clamped(gate, up, limit).to(h.dtype)
