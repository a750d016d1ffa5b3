"""Argument checks shared by every backend of an op, so each reports bad input the same way."""

from __future__ import annotations

import torch


def check_sparse_attention_args(q: torch.Tensor, window_slots: torch.Tensor,
                                comp_cache: torch.Tensor | None, comp_slots: torch.Tensor | None,
                                fmt, sink: torch.Tensor, comp_fmt) -> tuple[int, int, int, bool]:
    """Validate ``sparse_attention`` inputs; returns (T, H, D, whether compressed candidates exist)."""
    if q.dim() != 3:
        raise ValueError(f"sparse_attention: q must be [T, H, D], got {tuple(q.shape)}")
    t, h, d = q.shape
    for f, what in ((fmt, "window"), (comp_fmt, "compressed")):
        if f.dim != d:
            raise ValueError(f"sparse_attention: {what} cache format {f.name} holds "
                             f"{f.dim}-vectors, q has D={d}")
    if window_slots.dim() != 2 or window_slots.shape[0] != t:
        raise ValueError(f"sparse_attention: window_slots must be [T={t}, W], "
                         f"got {tuple(window_slots.shape)}")
    if sink.shape != (h,):
        raise ValueError(f"sparse_attention: sink must be [H={h}], got {tuple(sink.shape)}")
    use_comp = comp_cache is not None and comp_slots is not None and comp_slots.shape[-1] > 0
    if use_comp and (comp_slots.dim() != 2 or comp_slots.shape[0] != t):
        raise ValueError(f"sparse_attention: comp_slots must be [T={t}, K], "
                         f"got {tuple(comp_slots.shape)}")
    return t, h, d, use_comp
