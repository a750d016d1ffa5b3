# SPDX-License-Identifier: Apache-2.0
"""Argument checks shared by every backend of an op, so each reports bad input the same way."""

from __future__ import annotations

import torch


def check_sparse_attention_args(
    q: torch.Tensor,
    window_slots: torch.Tensor,
    comp_cache: torch.Tensor | None,
    comp_slots: torch.Tensor | None,
    fmt,
    sink: torch.Tensor,
    comp_fmt,
) -> tuple[int, int, int, bool]:
    """Validate ``sparse_attention`` inputs; returns (T, H, D, whether compressed candidates exist)."""
    if q.dim() != 3:
        raise ValueError(f"sparse_attention: q must be [T, H, D], got {tuple(q.shape)}")
    t, h, d = q.shape
    for f, what in ((fmt, "window"), (comp_fmt, "compressed")):
        if f.dim != d:
            raise ValueError(
                f"sparse_attention: {what} cache format {f.name} holds {f.dim}-vectors, q has D={d}"
            )
    if window_slots.dim() != 2 or window_slots.shape[0] != t:
        raise ValueError(
            f"sparse_attention: window_slots must be [T={t}, W], got {tuple(window_slots.shape)}"
        )
    if sink.shape != (h,):
        raise ValueError(f"sparse_attention: sink must be [H={h}], got {tuple(sink.shape)}")
    use_comp = comp_cache is not None and comp_slots is not None and comp_slots.shape[-1] > 0
    if use_comp and (comp_slots.dim() != 2 or comp_slots.shape[0] != t):
        raise ValueError(
            f"sparse_attention: comp_slots must be [T={t}, K], got {tuple(comp_slots.shape)}"
        )
    return t, h, d, use_comp


def check_rope_args(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Validate ``rope`` inputs: x [T, ..., D], positions [T], cos_sin [P, R] with R even <= D."""
    r = cos_sin.shape[-1]
    if cos_sin.dim() != 2 or r % 2:
        raise ValueError(f"rope: cos_sin must be [P, R] with R even, got {tuple(cos_sin.shape)}")
    if x.dim() < 2 or x.shape[-1] < r:
        raise ValueError(f"rope: x {tuple(x.shape)} must be [T, ..., D] with D >= R={r}")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"rope: positions {tuple(positions.shape)} must be [T={x.shape[0]}]")


def check_fused_rope_args(
    op: str, positions: torch.Tensor, cos_sin: torch.Tensor, t: int, d: int
) -> None:
    """The RoPE inputs of a fused op over T tokens of D dims: cos_sin [P, R] with R even <= D,
    positions [T]."""
    r = cos_sin.shape[-1]
    if cos_sin.dim() != 2 or r % 2 or r > d:
        raise ValueError(
            f"{op}: cos_sin must be [P, R] with R even <= D, got {tuple(cos_sin.shape)}"
        )
    if positions.shape != (t,):
        raise ValueError(f"{op}: positions {tuple(positions.shape)} must be [T={t}]")


def check_qnorm_rope_kv_insert_args(q: torch.Tensor, kv: torch.Tensor, fmt) -> None:
    """q [T, H, D] and kv [T, D], and a window format of D-vectors."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[0] != q.shape[0] or kv.shape[1] != q.shape[2]:
        raise ValueError(
            f"qnorm_rope_kv_insert: q {tuple(q.shape)} and kv {tuple(kv.shape)} must "
            f"be [T, H, D] and [T, D]"
        )
    if fmt.dim != kv.shape[1]:
        raise ValueError(
            f"qnorm_rope_kv_insert: format {fmt.name} holds {fmt.dim}-vectors, "
            f"kv has D={kv.shape[1]}"
        )


def check_inv_rope_fp8_quant_args(o: torch.Tensor, group: int) -> None:
    """o [T, H, D] with D a multiple of the quantization group."""
    if o.dim() != 3 or o.shape[-1] % group:
        raise ValueError(
            f"inv_rope_fp8_quant: o must be [T, H, D] with D a multiple of "
            f"{group}, got {tuple(o.shape)}"
        )


def check_qkv_rms_norm_args(q_r: torch.Tensor, kv: torch.Tensor) -> None:
    """q_r [T, q_lora] and kv [T, D] with the same T."""
    if q_r.dim() != 2 or kv.dim() != 2 or q_r.shape[0] != kv.shape[0]:
        raise ValueError(
            f"qkv_rms_norm: q_r {tuple(q_r.shape)} and kv {tuple(kv.shape)} must be "
            f"[T, q_lora] and [T, D] with the same T"
        )


def check_decode_metadata_tables(tables: dict, ratio: int):
    """The layer kind of ``ratio``, after checking that ``tables`` has every block table it needs."""
    from vllm_dsv4_hw.kinds import kind_of

    kind = kind_of(ratio)
    missing = [c for c in kind.caches if c not in tables]
    if missing:
        raise ValueError(f"decode_metadata: a {kind.name} layer needs the {missing} block tables")
    return kind


def check_hc_args(
    h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor
) -> tuple[int, int, int]:
    """Validate the mixes of an mHC pre; returns (T, hc, D)."""
    if h.dim() != 3:
        raise ValueError(f"hc_pre: streams must be [T, hc, D], got {tuple(h.shape)}")
    t, hc, d = h.shape
    n_mix = (2 + hc) * hc
    if tuple(fn.shape) != (n_mix, hc * d):
        raise ValueError(
            f"hc_pre: fn is {tuple(fn.shape)}; {hc} streams of {d} need ({n_mix}, {hc * d})"
        )
    if tuple(base.shape) != (n_mix,) or tuple(scale.shape) != (3,):
        raise ValueError(
            f"hc_pre: base must be [{n_mix}] and scale [3], got {tuple(base.shape)} / "
            f"{tuple(scale.shape)}"
        )
    if tuple(norm_w.shape) != (d,):
        raise ValueError(f"hc_pre: norm_w must be [{d}], got {tuple(norm_w.shape)}")
    return t, hc, d


def check_hc_post_args(
    y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[int, int, int]:
    """Validate an mHC post; returns (T, hc, D)."""
    if h.dim() != 3:
        raise ValueError(f"hc_post: streams must be [T, hc, D], got {tuple(h.shape)}")
    t, hc, d = h.shape
    if tuple(y.shape) != (t, d):
        raise ValueError(f"hc_post: y must be [{t}, {d}], got {tuple(y.shape)}")
    if tuple(post.shape) != (t, hc) or tuple(comb.shape) != (t, hc, hc):
        raise ValueError(
            f"hc_post: post must be [{t}, {hc}] and comb [{t}, {hc}, {hc}], got "
            f"{tuple(post.shape)} / {tuple(comb.shape)}"
        )
    return t, hc, d
