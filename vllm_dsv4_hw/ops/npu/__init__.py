# SPDX-License-Identifier: Apache-2.0
"""The ``npu`` backend: DeepSeek V4 ops on Huawei Ascend through torch_npu operators (issue 5).

Importing this package registers the implementations; it never imports ``torch_npu`` (each op does
on first use, see ``_vendor.py``), so it is safe on every machine. Whether the backend can run on a
device is decided by ``ops/backends.py`` (torch_npu imports, CANN is set up, an NPU is visible).

Registered here only where a torch_npu operator fits (docs/npu-ops.md has the table):

========================= ===========================================================
op                        served by
========================= ===========================================================
rms_norm, qkv_rms_norm    npu_rms_norm
rope                      npu_rotary_mul (interleave); vllm-ascend inplace_partial_rotary_mul
kv_insert                 format codec + npu_scatter_nd_update_ (data and scale parts);
                          vllm-ascend npu_scatter_nd_update_v2 where loaded
kv_gather                 reference gather (tensor ops; paired with kv_insert)
qnorm_rope_kv_insert      npu rms_norm + rope + kv_insert
compressor_store          dispatched compressor_pool + npu rms_norm + rope + kv_insert
sparse_attention          vllm-ascend npu_sparse_attn_sharedkv where loaded and the call fits
                          (sas.py); else npu_fused_infer_attention_score (+ sink from its lse)
indexer_topk              npu_lightning_indexer (bf16 keys)
inv_rope_fp8_quant        npu_rotary_mul + fp8 quant; requires fp8 (not A2/A3)
hc_pre, hc_seam, hc_post  vllm-ascend npu_hc_pre_v2 (+ npu rms_norm) / npu_hc_post where loaded
                          and the call fits (hc 4, D 4096 / 7168, bf16 streams); else the reference
========================= ===========================================================

``compressor_pool`` (and the weight / metadata ops) have no torch_npu operator: the dispatcher
serves them on an NPU with the next backends in its order (the Triton kernels through
triton-ascend where that is installed, else the PyTorch reference, whose tensor ops run on the NPU).

A vendor operator that raises at run time makes its op fall back to the reference for the rest of
the process with one warning, unless the npu backend was requested explicitly (then the error is
raised): ``_vendor.npu_op``.
"""

from vllm_dsv4_hw.ops.npu import compressor as _compressor  # noqa: F401  (each registers its ops)
from vllm_dsv4_hw.ops.npu import fused_prologue as _fused_prologue  # noqa: F401
from vllm_dsv4_hw.ops.npu import indexer as _indexer  # noqa: F401
from vllm_dsv4_hw.ops.npu import kv_cache as _kv_cache  # noqa: F401
from vllm_dsv4_hw.ops.npu import mhc as _mhc  # noqa: F401
from vllm_dsv4_hw.ops.npu import norm as _norm  # noqa: F401
from vllm_dsv4_hw.ops.npu import rope as _rope  # noqa: F401
from vllm_dsv4_hw.ops.npu import sparse_attention as _sparse_attention  # noqa: F401
from vllm_dsv4_hw.ops.npu._vendor import (  # noqa: F401
    NpuOpFailedError,
    NpuUnavailableError,
    VendorOpError,
    disabled_ops,
    reset_fallbacks,
)
