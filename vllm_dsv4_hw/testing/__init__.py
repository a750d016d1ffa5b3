"""Test aids that must live in the package (they run inside vLLM's worker processes)."""
