# SPDX-License-Identifier: Apache-2.0
"""The decode floor: bytes a step must move over the HBM bandwidth (4.3 TB/s measured on the H200).

Per step of B sequences at context n (issue 6):

* weights, read once per step (FP8 values + block scales, bf16 / fp32 parameters);
* the indexer keys of every c4a layer: B x floor(n / 4) keys;
* the selected entries: c4a B x min(index_topk, n / 4), c128a B x floor(n / 128) (every visible
  entry is a candidate) main entries;
* the window: B x min(n, 128) main entries per layer.

Compressor-state reads, cache writes and activations are left out (a few KB per sequence).
"""

from __future__ import annotations

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR, kind_of
from vllm_dsv4_hw.kv_cache.specs import INDEXER_ENTRY_BYTES, MAIN_ENTRY_BYTES, normalize_main_format

HBM_BYTES_PER_S = 4.3e12


def kv_bytes_per_layer(
    cfg: DSV4Config,
    ratio: int,
    batch: int,
    context: int,
    main_format: str = "fp8",
    indexer_format: str = "mxfp4",
) -> dict[str, int]:
    main_b = MAIN_ENTRY_BYTES[normalize_main_format(main_format)]
    idx_b = INDEXER_ENTRY_BYTES[indexer_format]
    kind = kind_of(ratio)
    out = {"window": batch * min(context, cfg.sliding_window) * main_b}
    if kind.has_indexer:
        visible = context // INDEXER_COMPRESSOR.ratio
        out["indexer_keys"] = batch * visible * idx_b
        out["selected"] = batch * min(cfg.index_topk, visible) * main_b
    elif kind.attends_all_entries:
        out["selected"] = batch * (context // ratio) * main_b
    return out


def floor_for(
    cfg: DSV4Config,
    weight_bytes_by_kind: dict[str, int],
    batch: int,
    context: int,
    main_format: str = "fp8",
    indexer_format: str = "mxfp4",
) -> dict:
    """Floor of one decode step and of one layer of each kind."""
    per_kind = {}
    totals = {"weights": 0, "indexer_keys": 0, "selected": 0, "window": 0}
    for r in sorted(set(cfg.compress_ratios)):
        k = kind_of(r).name
        n = cfg.layers_with_ratio(r)
        kv = kv_bytes_per_layer(cfg, r, batch, context, main_format, indexer_format)
        w = weight_bytes_by_kind[k]
        layer_bytes = w + sum(kv.values())
        per_kind[k] = {
            "layers": n,
            "weight_bytes": w,
            "kv_bytes": kv,
            "bytes": layer_bytes,
            "floor_ms": layer_bytes / HBM_BYTES_PER_S * 1e3,
        }
        totals["weights"] += n * w
        for key, v in kv.items():
            totals[key] += n * v
    total = sum(totals.values())
    return {
        "bytes": totals,
        "total_bytes": total,
        "floor_ms": total / HBM_BYTES_PER_S * 1e3,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "per_layer": per_kind,
    }
