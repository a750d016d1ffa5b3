"""Triton kernels: the `triton` backend of the dispatch layer (NVIDIA GPUs; triton-ascend; the
Triton interpreter on CPU with TRITON_INTERPRET=1 for tests).

Kernel modules import `triton` at their top, so they are imported only when it is installed; whether
the backend can run on a given device is decided later by ops/backends.py.
"""

import importlib.util
import logging

logger = logging.getLogger(__name__)

if importlib.util.find_spec("triton") is not None:
    try:  # one module per op (or fused group of ops); each registers itself
        from vllm_dsv4_hw.ops.triton import indexer as _indexer  # noqa: F401
        from vllm_dsv4_hw.ops.triton import compressor as _compressor  # noqa: F401
        from vllm_dsv4_hw.ops.triton import sparse_attention as _sparse_attention  # noqa: F401
        from vllm_dsv4_hw.ops.triton import norm as _norm  # noqa: F401
        from vllm_dsv4_hw.ops.triton import rope as _rope  # noqa: F401
        from vllm_dsv4_hw.ops.triton import kv_insert as _kv_insert  # noqa: F401
        from vllm_dsv4_hw.ops.triton import fused_qkv as _fused_qkv  # noqa: F401
        from vllm_dsv4_hw.ops.triton import inv_rope_quant as _inv_rope_quant  # noqa: F401
        from vllm_dsv4_hw.ops.triton import fp8_linear as _fp8_linear  # noqa: F401
        from vllm_dsv4_hw.ops.triton import moe as _moe  # noqa: F401
        from vllm_dsv4_hw.ops.triton import decode_metadata as _decode_metadata  # noqa: F401
    except ImportError as exc:  # a broken triton install must not break the reference path
        logger.warning("dsv4-hw: Triton kernels unavailable (%s); using other backends", exc)
