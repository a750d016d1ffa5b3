# SPDX-License-Identifier: Apache-2.0
"""Pieces of ``benchmarks/decode_stack.py``: FP8 weights, the FP8 attention stack, bucket page pools,
graph-safe decode metadata, the floor model. Importable without vLLM (the H200 has none)."""
