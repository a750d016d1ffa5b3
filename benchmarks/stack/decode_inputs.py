# SPDX-License-Identifier: Apache-2.0
"""The decode step's one per-step input and the product's graph-safe metadata derived from it.

``seq_lens`` [B] (tokens cached after the step, int64) lives at a stable address and is advanced in
place between graph replays; every metadata tensor is derived from it on the device by
``attention.decode_metadata.decode_step_metadata`` (the code vLLM's decode steps run), over the
benchmark pools' static block tables.
"""

from __future__ import annotations

import torch

from vllm_dsv4_hw.attention.decode_metadata import decode_layout, decode_step_metadata
from vllm_dsv4_hw.attention.metadata import StepMetadata


class DecodeInputs:
    def __init__(self, caches, device: torch.device) -> None:
        self.caches = caches
        self.batch = caches.batch
        self.seq_lens = torch.ones(self.batch, dtype=torch.int64, device=device)
        window = caches.cfg.sliding_window
        self.layouts = {
            r: decode_layout(r, lay.geometry, window, caches.model_len)
            for r, lay in caches.layouts.items()
        }

    def set_position(self, pos: int) -> None:
        """Every sequence decodes position ``pos`` next."""
        self.seq_lens.fill_(pos + 1)

    def advance(self) -> None:
        self.seq_lens.add_(1)

    def derive(self) -> dict[int, StepMetadata]:
        return {
            r: decode_step_metadata(
                self.seq_lens, self.caches.tables[r], self.caches.layouts[r].geometry, layout
            )
            for r, layout in self.layouts.items()
        }
