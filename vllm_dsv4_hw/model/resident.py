# SPDX-License-Identifier: Apache-2.0
"""What the loaded model keeps resident, by weight format, against the checkpoint's tensor bytes.

Weights stay as shipped, so the resident parameter bytes should equal the checkpoint's (the MTP
layer excluded) up to dtype changes of small tensors (e.g. a bf16 router weight held in fp32); a
dequantized copy of the FP8 / FP4 weights would show as a ratio of 3 or more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ResidentSummary", "resident_summary"]

_LABELS = {
    torch.float8_e4m3fn: "fp8 e4m3",
    torch.float8_e8m0fnu: "ue8m0 scales",
    torch.uint8: "fp4 e2m1 (packed)",
}
MIB = 1 << 20


@dataclass
class ResidentSummary:
    resident_bytes: int
    checkpoint_bytes: int
    by_format: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.resident_bytes / self.checkpoint_bytes if self.checkpoint_bytes else 0.0

    def line(self) -> str:
        parts = ", ".join(
            f"{k} {v / MIB:.2f} MiB"
            for k, v in sorted(self.by_format.items(), key=lambda kv: -kv[1])
        )
        return (
            f"resident weights {self.resident_bytes / MIB:.2f} MiB for "
            f"{self.checkpoint_bytes / MIB:.2f} MiB of checkpoint tensors "
            f"({self.ratio:.3f}x): {parts}"
        )


def resident_summary(model: nn.Module, checkpoint_bytes: int) -> ResidentSummary:
    """Parameters and persistent buffers of ``model`` (what the checkpoint fills), by format."""
    seen: set[int] = set()
    by: dict[str, int] = {}
    tensors = list(model.named_parameters())
    persistent = model.state_dict(keep_vars=True)
    tensors += [(n, b) for n, b in model.named_buffers() if n in persistent]
    for _, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        label = _LABELS.get(t.dtype, str(t.dtype).replace("torch.", ""))
        by[label] = by.get(label, 0) + t.numel() * t.element_size()
    return ResidentSummary(sum(by.values()), checkpoint_bytes, by)
