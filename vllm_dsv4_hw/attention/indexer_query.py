# SPDX-License-Identifier: Apache-2.0
"""The indexer query's precision: e4m3 codes with a power-of-two scale per (token, head), or the
model dtype (``envs.INDEXER_Q``).

Why: the score pass is the c4a layer's heaviest kernel at large batch, compute-bound on bf16
dots (evidence: docs/tuning.md, Indexer query dtype). e4m3 q meets the keys on
FP8 dots (MXFP4 values are exact in e4m3), which run at twice the bf16 rate. Upstream vLLM's
DeepSeek V4 indexer quantizes q^I to FP8 with its scale folded into the head weights, as this does
(``ops.rope_fp8_quant``, then ``indexer_topk(..., q_scales=)``).

The FP8-dot pass is slower than the bf16 one at every shape measured, so the default is the model
dtype; e4m3 stays a setting until the kernel wins (evidence: docs/tuning.md, Indexer query dtype).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_dsv4_hw import envs

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _e4m3_query(device_type: str, setting: str) -> bool:
    from vllm_dsv4_hw.ops.backends import device_capabilities

    on = setting == "e4m3" or (setting == "auto" and device_capabilities(device_type).fp8_dot)
    logger.info(
        "indexer query on %s: %s (%s=%s)",
        device_type,
        "e4m3 codes, FP8 dots" if on else "model dtype",
        envs.INDEXER_Q.name,
        setting,
    )
    return on


def e4m3_query(device: torch.device) -> bool:
    """Whether the indexer scores an e4m3 q^I on ``device`` (auto: where it declares ``fp8_dot``)."""
    return _e4m3_query(device.type, envs.indexer_q())
