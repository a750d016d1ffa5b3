# SPDX-License-Identifier: Apache-2.0
"""Weights as the DeepSeek V4 checkpoints ship them: the formats (``formats``: FP8 e4m3 with ue8m0
block scales, FP4 e2m1 experts with per-32 ue8m0 scales) and vLLM's quantization extension points
that keep them resident in those formats (``config``: the quantization config and linear methods)."""
