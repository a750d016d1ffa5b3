# SPDX-License-Identifier: Apache-2.0
"""Which op makes the decode step differ from run to run: the GPU tier's determinism case
(``benchmarks.stack.decode_case``, checked by ``tests/gpu/test_determinism.py``) stepped twice with each op in turn on the reference backend
(``VLLM_DSV4_HW_OP_BACKENDS``); prints the max |logit difference| per setting.

    bash benchmarks/with_vllm.sh python3 -m benchmarks.determinism
"""

from __future__ import annotations

import json
import os

import torch

OPS = (
    "",
    "indexer_topk",
    "sparse_attention",
    "moe_experts",
    "compressor_store",
    "fp8_block_linear",
    "qnorm_rope_kv_insert",
    "decode_metadata",
)


def main() -> int:
    from benchmarks.stack.decode_case import build_decode_case, decode_step
    from benchmarks.vllm_state import single_rank
    from vllm_dsv4_hw.ops.registry import REGISTRY

    single_rank()
    case = build_decode_case(torch.device("cuda"))
    rows = {}
    for op in OPS:
        os.environ["VLLM_DSV4_HW_OP_BACKENDS"] = f"{op}=reference" if op else ""
        REGISTRY.clear_cache()
        for streams in (True, False):
            a, b = decode_step(case, streams), decode_step(case, streams)
            rows[f"{op or 'all triton'} streams={'on' if streams else 'off'}"] = float(
                (a - b).abs().max()
            )
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
