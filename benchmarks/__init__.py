# SPDX-License-Identifier: Apache-2.0
"""Benchmarks (benchmarks/gpu: scripts the lead runs on the lent GPU).

A kernel that cannot compile on the GPU at hand must fail a benchmark or a GPU check rather than be
replaced by its reference implementation (ops/fallback.py), which would be timed or compared in its
place: every benchmark process runs with ``VLLM_DSV4_HW_KERNEL_FAILURES=raise`` unless told
otherwise.
"""

import os

os.environ.setdefault("VLLM_DSV4_HW_KERNEL_FAILURES", "raise")
