"""Vectorized PyTorch reference implementations: every op, every device, any float dtype."""

from vllm_dsv4_hw.ops.reference import (  # noqa: F401  (each module registers its ops)
    compressor,
    decode_metadata,
    dense_linear,
    fp8_linear,
    fused,
    indexer,
    kv_cache_ops,
    moe,
    rms_norm,
    rope,
    sparse_attention,
)
