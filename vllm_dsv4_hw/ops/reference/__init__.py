# SPDX-License-Identifier: Apache-2.0
"""Vectorized PyTorch reference implementations: every op, every device, any float dtype. One module
per op family; each registers its ops."""

from vllm_dsv4_hw.ops.reference import compressor as _compressor  # noqa: F401
from vllm_dsv4_hw.ops.reference import decode_metadata as _decode_metadata  # noqa: F401
from vllm_dsv4_hw.ops.reference import fused_prologue as _fused_prologue  # noqa: F401
from vllm_dsv4_hw.ops.reference import indexer as _indexer  # noqa: F401
from vllm_dsv4_hw.ops.reference import kv_cache as _kv_cache  # noqa: F401
from vllm_dsv4_hw.ops.reference import linear as _linear  # noqa: F401
from vllm_dsv4_hw.ops.reference import mhc as _mhc  # noqa: F401
from vllm_dsv4_hw.ops.reference import moe as _moe  # noqa: F401
from vllm_dsv4_hw.ops.reference import norm as _norm  # noqa: F401
from vllm_dsv4_hw.ops.reference import rope as _rope  # noqa: F401
from vllm_dsv4_hw.ops.reference import sparse_attention as _sparse_attention  # noqa: F401
