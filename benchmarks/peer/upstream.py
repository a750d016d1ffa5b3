# SPDX-License-Identifier: Apache-2.0
"""Upstream vLLM's DeepSeek V4 Triton kernels, imported from the installed vLLM as they ship.

Each entry is imported on first use; a failure is recorded as the row's reason (one line) instead of
stopping the table, since vLLM's tree changes between releases.
"""

from __future__ import annotations

import functools
import importlib

# name -> (module, attribute)
KERNELS = {
    "quantize_and_insert_k_cache": (
        "vllm.models.deepseek_v4.common.ops.cache_utils",
        "quantize_and_insert_k_cache",
    ),
    "dequantize_and_gather_k_cache": (
        "vllm.models.deepseek_v4.common.ops.cache_utils",
        "dequantize_and_gather_k_cache",
    ),
    "fused_inv_rope_fp8_quant": (
        "vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant",
        "fused_inv_rope_fp8_quant",
    ),
    "fused_indexer_q_rope_quant": (
        "vllm.models.deepseek_v4.common.ops.fused_indexer_q",
        "fused_indexer_q_rope_quant",
    ),
    "qnorm_rope_kv_fp8_insert": (
        "vllm.models.deepseek_v4.xpu.xpu_qnorm_rope_kv_fp8_insert",
        "xpu_qnorm_rope_kv_fp8_insert",
    ),
    "sparse_decode_fp8": (
        "vllm.models.deepseek_v4.xpu.xpu_sparse_decode_fp8",
        "xpu_sparse_decode_fp8",
    ),
    "bf16_mla_sparse": ("vllm.v1.attention.ops.xpu_mla_sparse", "triton_bf16_mla_sparse_interface"),
}


class Unavailable(Exception):
    """An upstream kernel that cannot be imported or run here (the reason is the message)."""


def _interpreter_shim() -> None:
    """CPU smoke runs only (TRITON_INTERPRET=1, no GPU): vLLM's CPU build hands its modules a
    placeholder ``triton`` (``vllm.triton_utils.HAS_TRITON`` is False without a GPU driver), so its
    kernels would not run at all; give them the real (interpreting) Triton instead. On a GPU
    machine vLLM's own import logic is left alone."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    if not tu.HAS_TRITON:
        tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True


def kernel(name: str):
    mod_name, attr = KERNELS[name]
    try:
        _interpreter_shim()
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # vLLM absent, or a module that needs a compiled extension
        raise Unavailable(f"import {mod_name}: {type(exc).__name__}: {' '.join(str(exc).split())}")
    fn = getattr(mod, attr, None)
    if fn is None:
        raise Unavailable(f"{mod_name} has no {attr} (another vLLM version?)")
    return functools.wraps(fn)(functools.partial(_call, name, fn))


def _call(name: str, fn, *args, **kwargs):
    """``fn``, with a compiled op this vLLM build lacks turned into :class:`Unavailable` (e.g. a
    CPU wheel whose ``torch.ops._C`` has no op for the path upstream takes on this platform)."""
    try:
        return fn(*args, **kwargs)
    except (AttributeError, NotImplementedError) as exc:
        if "_OpNamespace" not in str(exc):
            raise
        raise Unavailable(f"{name}: {' '.join(str(exc).split())} in this vLLM build") from exc


def version() -> str:
    try:
        import vllm

        return f"{getattr(vllm, '__version__', '?')} ({vllm.__file__.rsplit('/vllm/', 1)[0]})"
    except Exception as exc:
        return f"not importable: {type(exc).__name__}"
