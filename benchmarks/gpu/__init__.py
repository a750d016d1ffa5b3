# SPDX-License-Identifier: Apache-2.0
"""Benchmarks (benchmarks/gpu: scripts the lead runs on the lent GPU)."""
