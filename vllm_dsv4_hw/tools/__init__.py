# SPDX-License-Identifier: Apache-2.0
"""Tools that generate, apart from the runtime packages: the checkpoint generator (with its
tokenizer). Nothing in the served path imports this package. Test aids live under ``tests/support``
(the compiled-op trap), vLLM's standalone parallel state in ``benchmarks/vllm_state.py``."""
