# SPDX-License-Identifier: Apache-2.0
"""What the ``make-checkpoint`` tests know of their generated checkpoints: the seed (:data:`SEED`;
the ``ckpts`` fixture of ``conftest.py`` builds tiny-flash and tiny-pro in bf16 and fp8 once per
test module), the prompt the transformers checks generate from, and readers of the safetensors
shards (headers only, or every tensor).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SEED = 1234
PROMPT = (
    "The quick brown fox jumps over the lazy dog. A long context model reads a whole book "
    "before it answers a single question about chapter three, and then it writes a summary "
    "for the committee, which meets on Tuesday at 10:30 to discuss 42 new proposals."
)
NEW_TOKENS = 32


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _stored_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (safetensors dtype string, shape, shard file) over all shards, from the headers."""
    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        for name, meta in _read_header(shard).items():
            assert name not in out, f"{name} is stored twice"
            out[name] = (meta["dtype"], tuple(meta["shape"]), shard.name)
    return out


def _load_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        out.update(load_file(shard))
    return out
