# SPDX-License-Identifier: Apache-2.0
"""The entry-format contract shared by every cache kind.

A paged cache is a uint8 tensor ``[num_pages, page_bytes]``. Inside a page of E entries the data
parts of all entries come first (``[E, data_bytes]``), then their scale parts (``[E, scale_bytes]``),
then padding up to ``page_bytes`` (a page may be padded to its page-size bucket). A slot is
``page * E + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EntryFormat:
    name: str = "abstract"
    dim: int = 0  # logical vector length (512 main, 128 indexer)
    data_bytes: int = 0
    scale_bytes: int = 0
    entries_per_page: int = 64

    def _init_geometry(self, data_bytes: int, dim_multiple: int = 1) -> None:
        """Validate ``dim`` / ``entries_per_page`` and set the derived ``data_bytes`` (the
        dataclasses are frozen, so subclasses call this from ``__post_init__``)."""
        if self.dim <= 0 or self.dim % dim_multiple:
            what = "> 0" if dim_multiple == 1 else f"a positive multiple of {dim_multiple}"
            raise ValueError(f"{self.name}: dim must be {what}, got {self.dim}")
        if self.entries_per_page <= 0:
            raise ValueError(
                f"{self.name}: entries_per_page must be > 0, got {self.entries_per_page}"
            )
        object.__setattr__(self, "data_bytes", data_bytes)

    @property
    def entry_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def min_page_bytes(self) -> int:
        return self.entries_per_page * self.entry_bytes

    # -- per-entry codec (subclasses) ---------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] (any float dtype) -> (data [N, data_bytes] u8, scales [N, scale_bytes] u8)."""
        raise NotImplementedError

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of quantize -> [N, dim] float32."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Entry-contiguous bytes [N, entry_bytes] (data then scales): the format's byte layout."""
        data, scales = self.quantize(x)
        return torch.cat([data, scales], dim=-1)

    def decode(self, entry: torch.Tensor) -> torch.Tensor:
        return self.dequantize(entry[..., : self.data_bytes], entry[..., self.data_bytes :])

    # -- paged layout ---------------------------------------------------------------------------
    def new_cache(
        self, num_pages: int, device: torch.device | str = "cpu", page_bytes: int | None = None
    ) -> torch.Tensor:
        page_bytes = self.min_page_bytes if page_bytes is None else page_bytes
        if page_bytes < self.min_page_bytes:
            raise ValueError(
                f"{self.name}: page of {page_bytes} B cannot hold {self.entries_per_page} entries "
                f"of {self.entry_bytes} B"
            )
        return torch.zeros(num_pages, page_bytes, dtype=torch.uint8, device=device)

    def page_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(data [P, E, data_bytes], scales [P, E, scale_bytes]) views into ``cache``."""
        if cache.dtype != torch.uint8 or cache.dim() != 2:
            raise ValueError(
                f"{self.name}: cache must be uint8 [num_pages, page_bytes], got "
                f"{cache.dtype} {tuple(cache.shape)}"
            )
        if cache.shape[1] < self.min_page_bytes:
            raise ValueError(f"{self.name}: page of {cache.shape[1]} B < {self.min_page_bytes} B")
        e = self.entries_per_page
        data = cache[:, : e * self.data_bytes].view(cache.shape[0], e, self.data_bytes)
        start = e * self.data_bytes
        scales = cache[:, start : start + e * self.scale_bytes].view(
            cache.shape[0], e, self.scale_bytes
        )
        return data, scales


# -- input checks every format's codec runs ---------------------------------------------------
def check_rows(fmt: EntryFormat, x: torch.Tensor) -> torch.Tensor:
    """Validate ``x [..., fmt.dim]`` (floating) and return it as float32."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fmt.name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{fmt.name}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != fmt.dim:
        raise ValueError(
            f"{fmt.name}: x must be [N, {fmt.dim}] (last dim = format dim {fmt.dim}), "
            f"got shape {tuple(x.shape)}"
        )
    return x.float()


def check_parts(fmt: EntryFormat, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Validate ``data [..., data_bytes]`` and ``scales [..., scale_bytes]`` (uint8)."""
    for what, t, width in (("data", data, fmt.data_bytes), ("scales", scales, fmt.scale_bytes)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fmt.name}: {what} must be a uint8 tensor, got {got}")
        if t.dim() < 1 or t.shape[-1] != width:
            raise ValueError(f"{fmt.name}: {what} must be [N, {width}], got shape {tuple(t.shape)}")
    if data.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"{fmt.name}: data {tuple(data.shape)} and scales {tuple(scales.shape)} disagree on rows"
        )
