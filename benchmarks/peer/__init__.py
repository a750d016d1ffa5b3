# SPDX-License-Identifier: Apache-2.0
"""Peer table: upstream vLLM's own DeepSeek V4 Triton kernels beside the product's ops.

    bash benchmarks/with_vllm.sh python3 -m benchmarks.peer --out $OUT     # H200 (vLLM's tree)
    python -m benchmarks.peer --smoke                                       # CPU, interpreter

Upstream's kernels are imported from the installed vLLM's source files as they ship
(``vllm.models.deepseek_v4.common.ops``, ``vllm.models.deepseek_v4.xpu``, ``vllm.v1.attention.ops``;
on the H200, where vLLM is not installed, ``benchmarks/with_vllm.sh`` puts vLLM 0.32's Python tree on
the path). Ours are the product's dispatched ops (``vllm_dsv4_hw.ops``), the calls the served model
makes. Both sides get the same inputs; the caches are shared byte for byte where the layouts agree
(our ``fp8_ds_mla`` page is upstream's: 448 e4m3 + 64 bf16 per entry, then 8 scale bytes per entry).

Every row has a correctness column: each side's max |got - oracle| / max |oracle| against a float64
oracle of the op's semantics (``benchmarks/peer/oracles.py``), so a fast wrong kernel shows. Times are
medians of ``triton.testing.do_bench`` over CUDA-graph replays (``benchmarks/gpu/timing.py``); a side
that cannot be captured is timed eagerly and its mode says so. ``ratio`` = upstream / ours (above 1 =
ours faster). Upstream's MXFP4 kernels need sm_100 (``cvt ... e2m1x2``): on an H200 those rows are
ours-only.
"""
