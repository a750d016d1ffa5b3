"""Benchmarks (benchmarks/gpu: scripts the lead runs on the lent GPU)."""
