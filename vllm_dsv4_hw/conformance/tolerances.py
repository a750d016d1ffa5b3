# SPDX-License-Identifier: Apache-2.0
"""Error budgets of the conformance kit: per output dtype and per cache entry format.

Every check computes ``ratio = max(|got - want| / bound)`` elementwise against a float64 oracle; it
passes when ``ratio <= 1``. Bounds (``want`` is the oracle value, ``m`` the largest |want| of the
compared tensor or block):

* returned tensors: ``rtol(dtype) * |want| + atol_rel * m`` (one rounding to the output dtype plus
  accumulation slack);
* cache entries (decoded back to float): one code step of the format, so a value that lands on the
  neighbouring code because the op rounded in fp32 where the oracle used fp64 still passes --
  fp32 ``1e-5 |w|``; bf16 ``2^-7 |w|``; fp8 (e4m3 with a power-of-two block scale s) ``2^-3 |w| +
  2^-9 s``; MXFP4 (e2m1, spacing up to 2 s) ``2 s``; s is bounded by ``2 * amax(block) / max_code``.
  bf16 values (bf16 entries, the rope part of fp8 entries) also get ``2^-20 * amax(row)``: the entry
  is computed in fp32 before it is rounded, and a value near zero that came out of a cancellation
  (RoPE's ``x1 cos - x2 sin``, a softmax-weighted pool) carries fp32 error of the row's magnitude,
  far above ``2^-7`` of itself (seen: 6.4e-6 in a row of max 6, off by 8e-8).
"""

from __future__ import annotations

import torch

# relative error of a result rounded once to the dtype, with fp32 math inside
RTOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """max(|got - want| / bound); inf where got is not finite but want is."""
    g, w = got.double(), want.double()
    if g.shape != w.shape:
        raise ValueError(f"shape {tuple(g.shape)} != expected {tuple(w.shape)}")
    if g.numel() == 0:
        return 0.0
    bad = ~torch.isfinite(g) & torch.isfinite(w)
    if bool(bad.any()):
        return float("inf")
    err = (g - w).abs()
    r = err / bound.double().clamp_min(1e-300)
    r = torch.where(err == 0, torch.zeros_like(r), r)
    return float(r.max())


def dense_bound(
    want: torch.Tensor, dtype: torch.dtype, atol_rel: float = 1e-3, rtol: float | None = None
) -> torch.Tensor:
    w = want.double().abs()
    m = float(w.max()) if w.numel() else 0.0
    rt = RTOL.get(dtype, 2**-7) if rtol is None else rtol
    return rt * w + atol_rel * m + 1e-30


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def entry_bound(fmt_name: str, want: torch.Tensor) -> torch.Tensor:
    """Per-element error bound of a decoded cache entry of format ``fmt_name`` vs its exact value.

    ``want`` [N, dim] float64 (the oracle's value before quantization)."""
    w = want.double()
    a = w.abs()
    if fmt_name == "fp32":
        return 1e-5 * a + 1e-6 * (float(a.max()) if a.numel() else 0.0) + 1e-30
    # fp32 math before the bf16 rounding: error relative to the row, not to the value itself
    fp32_slack = 2**-20 * a.amax(-1, keepdim=True) if a.numel() else a
    if fmt_name == "bf16":
        return 2**-7 * a + fp32_slack + 1e-30
    if fmt_name in ("fp8", "fp8_ds_mla"):
        nope, rope = a[..., :448], a[..., 448:]
        amax = _blocks(nope, 64).amax(-1, keepdim=True).clamp_min(1e-4)
        s = 2 * amax / 448
        b_nope = (2**-3 * _blocks(nope, 64) + 2**-9 * s).reshape(nope.shape)
        return torch.cat([b_nope, 2**-7 * rope + fp32_slack + 1e-30], dim=-1)
    if fmt_name in ("fp8_indexer",):
        amax = a.amax(-1, keepdim=True).clamp_min(1e-4)
        return 2**-3 * a + 2**-9 * (2 * amax / 448)
    if fmt_name == "mxfp4":
        amax = _blocks(a, 32).amax(-1, keepdim=True)
        s = 2 * amax / 6
        return (2 * s + 2**-7 * _blocks(a, 32)).reshape(a.shape) + 1e-30
    raise ValueError(f"no error budget for cache format {fmt_name!r}")
