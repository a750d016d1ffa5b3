# SPDX-License-Identifier: Apache-2.0
"""The indexer query's precision (``attention.indexer_query``, ``DSV4Indexer.query``): the
setting picks e4m3 codes or the model dtype per device; with codes, the layer hands the indexer
``rope_fp8_quant``'s codes and per-(token, head) scales, and its top-k is the top-k of float64
scores of exactly codes * scales (sets), within e4m3 rounding of the model-dtype query."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_layer import CFG, LENS, _case, _layer_from
from vllm_dsv4_hw import ops
from vllm_dsv4_hw.attention import indexer_query
from vllm_dsv4_hw.attention.caches import allocate_layer_caches, page_geometry, static_block_tables
from vllm_dsv4_hw.attention.metadata import build_step_metadata

pytestmark = pytest.mark.usefixtures("vllm_single_rank")


@pytest.mark.parametrize(
    "setting, on_cpu", [("auto", False), ("e4m3", True), ("model", False), (None, False)]
)
def test_setting_per_device(monkeypatch, setting, on_cpu):
    """auto follows the device's ``fp8_dot`` (the CPU has none); e4m3 / model force it; the
    default is the model dtype."""
    if setting is None:  # the default: the model dtype
        monkeypatch.delenv("VLLM_DSV4_HW_INDEXER_Q", raising=False)
    else:
        monkeypatch.setenv("VLLM_DSV4_HW_INDEXER_Q", setting)
    assert indexer_query.e4m3_query(torch.device("cpu")) is on_cpu


def test_bad_setting_is_one_line(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_INDEXER_Q", "fp4")
    with pytest.raises(ValueError, match="VLLM_DSV4_HW_INDEXER_Q"):
        indexer_query.e4m3_query(torch.device("cpu"))


def test_layer_scores_the_e4m3_query(monkeypatch, gen):
    """q_e4m3 on: the indexer receives float8 codes and [T, Hi] scales, codes * scales is the
    model-dtype RoPE'd q^I within e4m3 rounding (2^-4 relative per head), and the layer's top-k is
    the reference top-k of that exact query (as sets); off: the model-dtype q^I, no scales."""
    params, xs, _ = _case(4)
    layer = _layer_from(params, 4, torch.float32)
    geom, _ = page_geometry(CFG, 4, "fp32", "fp32")
    tables, counts = static_block_tables(geom, 4, LENS)
    caches = allocate_layer_caches(CFG, 4, counts, "fp32", "fp32", block_tables=tables)
    meta = build_step_metadata([0] * len(LENS), list(LENS), 4, tables, caches.geometry)
    x = torch.cat(xs).float()
    seen = []
    topk = ops.indexer_topk

    def spy(*a, **kw):
        out = topk(*a, **kw)
        seen.append((a, kw, out))
        return out

    monkeypatch.setattr(ops, "indexer_topk", spy)
    for on in (True, False):
        layer.indexer.q_e4m3 = on
        with torch.no_grad():
            layer(x, meta, caches)
    (a8, kw8, top8), (am, kwm, _) = seen
    codes, scales = a8[0], kw8["q_scales"]
    t, hi = codes.shape[:2]
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (t, hi)
    assert am[0].dtype == torch.float32 and kwm["q_scales"] is None
    values = codes.double() * scales.double()[..., None]
    ref = am[0].double()
    head_err = (values - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    assert float(head_err.max()) <= 2**-4
    want = topk(values, *a8[1:])  # float64 query, reference scoring (the CPU's backend)
    for row in range(t):
        got_set = set(top8[row][top8[row] >= 0].tolist())
        assert got_set == set(want[row][want[row] >= 0].tolist()), row
