"""Triton kernels (issue 4)."""
