# SPDX-License-Identifier: Apache-2.0
"""The tensor / expert-parallel split (``vllm_dsv4_hw.parallel``): which sizes a checkpoint allows,
the one-line refusals, and what each rank holds (the split model itself, across two real ranks:
``tests/serve/test_tensor_parallel.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_dsv4_hw.config import V4_FLASH, V4_PRO, validate_hf_config
from vllm_dsv4_hw.parallel import ParallelLayout, SplitError, check_split, working_sizes
from vllm_dsv4_hw.quant.scheme import WeightScheme, shipped
from vllm_dsv4_hw.tools.checkpoint_layout import hf_config


def test_real_models_split_where_the_blocks_allow():
    # V4-Pro: 3072 / 16 = 192 cuts the 128-wide FP8 block of the shared expert (the split that
    # fails upstream); 8 ranks keep whole blocks.
    with pytest.raises(SplitError) as exc:
        check_split(shipped(V4_PRO), 16)
    msg = str(exc.value)
    assert msg.startswith(
        "--tensor-parallel-size 16: shared expert intermediate per rank "
        "3072/16 = 192 cuts the 128-wide FP8 block"
    ), msg
    assert msg.endswith("sizes that split this checkpoint: 1, 2, 4, 8"), msg
    assert "\n" not in msg
    check_split(shipped(V4_PRO), 8)
    check_split(shipped(V4_FLASH), 8, expert_parallel=True)
    assert working_sizes(shipped(V4_FLASH), False) == [1, 2, 4, 8]
    # bf16 weights have no blocks: only heads, groups and FP4-free experts bound the split
    assert 16 in working_sizes(V4_PRO, False)


@pytest.mark.parametrize(
    "tp,ep,needle",
    [
        (3, False, "num_attention_heads 4 is not divisible by 3"),
        (4, False, "o_groups 2 is not divisible by 4"),
        (2, True, "n_routed_experts 9 is not divisible by 2 (expert parallelism"),
    ],
)
def test_bad_splits_name_the_dimension_and_the_sizes_that_work(tp, ep, needle):
    raw = hf_config("tiny-flash", "fp8")
    raw["n_routed_experts"] = 9
    cfg = validate_hf_config(raw)
    with pytest.raises(SplitError) as exc:
        check_split(cfg, tp, expert_parallel=ep)
    assert needle in str(exc.value) and "sizes that split this checkpoint: 1" in str(exc.value)


def test_fp4_scale_block_bounds_expert_tensor_parallelism():
    raw = hf_config("tiny-flash", "bf16")
    raw["moe_intermediate_size"] = 64  # 64 / 4 = 16 rows per rank: half an FP4 block
    raw.update(num_attention_heads=4, o_groups=4)
    cfg = dataclasses.replace(validate_hf_config(raw), weights=WeightScheme(experts="fp4"))
    with pytest.raises(SplitError, match="64/4 = 16 cuts the 32-wide FP4 scale block"):
        check_split(cfg, 4)
    check_split(cfg, 4, expert_parallel=True)  # whole experts per rank: no cut


def test_layout_shares():
    cfg = V4_FLASH
    for rank in range(4):
        tp = ParallelLayout(4, rank)
        assert tp.local_heads(cfg) == 16 and tp.local_groups(cfg) == 2
        assert tp.local_experts(cfg) == range(256)
        assert tp.expert_inter_slice(cfg) == slice(512 * rank, 512 * (rank + 1))
        ep = ParallelLayout(4, rank, expert_parallel=True)
        assert ep.local_experts(cfg) == range(64 * rank, 64 * (rank + 1))
        assert ep.expert_inter_slice(cfg) == slice(0, 2048)
    one = ParallelLayout()
    assert not one.sharded and one.local_experts(cfg) == range(256)
