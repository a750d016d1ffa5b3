# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the vLLM-facing pieces that need no running server: specs, pool arithmetic,
metadata builder, the custom-op boundary, the platform and plugin hooks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_dsv4_hw.config import V4_FLASH, V4_PRO, DSV4Config
from vllm_dsv4_hw.engine.kv_pool import plan_vllm_pool
from vllm_dsv4_hw.engine.kv_specs import layer_kinds, vllm_spec
from vllm_dsv4_hw.kv_cache.buckets import bucket_page_bytes
from vllm_dsv4_hw.kv_cache.specs import INDEXER_ENTRY_BYTES, MAIN_ENTRY_BYTES

FORMATS = [(m, i) for m in MAIN_ENTRY_BYTES for i in INDEXER_ENTRY_BYTES]


@pytest.mark.parametrize("main,idx", FORMATS)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_vllm_specs_use_bucket_pages(main, idx, ratio):
    buckets = set(bucket_page_bytes(MAIN_ENTRY_BYTES[main], INDEXER_ENTRY_BYTES[idx]).values())
    for lk in layer_kinds(V4_FLASH, ratio, main, idx):
        spec = vllm_spec(lk)
        assert spec.page_size_bytes == lk.page_bytes, lk.kind
        assert lk.page_bytes in buckets, (lk.kind, lk.page_bytes, buckets)
        assert spec.block_size == lk.block_size
        if lk.is_state:
            # rows back to back, then padding; the block stride must keep whole rows
            assert spec.block_stride_alignment == lk.entry_stride
            assert lk.entries_per_page * lk.entry_stride <= lk.page_bytes
            assert spec.sliding_window == (8 if lk.kind in ("c4a_state", "indexer_state") else 128)
        elif lk.kind == "window_kv":
            assert (spec.sliding_window, spec.block_size) == (128, 64)
        else:
            assert spec.block_size == 256
            assert spec.num_states == lk.entries_per_page


def _tiny(ratios) -> DSV4Config:
    return V4_FLASH.with_layers(tuple(ratios))


@pytest.mark.parametrize(
    "cfg", [V4_FLASH, V4_PRO, _tiny((0, 0, 4, 128, 4))], ids=["flash", "pro", "tiny"]
)
@pytest.mark.parametrize("batched", [256, 2048, 8192])
def test_vllm_pool_plan_is_consistent(cfg, batched):
    p = plan_vllm_pool(cfg, "fp8", "mxfp4", 8 << 30, 65536, batched)
    # every layer cache is in exactly one group
    per_kind = {}
    for g in p.groups:
        for k in g.kinds:
            per_kind[k] = per_kind.get(k, 0) + (g.layers if len(g.kinds) == 1 else 0)
    assert per_kind.get("window_kv") == cfg.num_layers
    # a block holds the widest group; groups never exceed it
    assert all(g.packed_bytes <= p.bytes_per_block for g in p.groups)
    state_rows = [8192, 4096, 2048]
    assert p.bytes_per_block % math.lcm(*state_rows[:3]) == 0
    assert p.num_blocks == (8 << 30) // p.bytes_per_block
    assert p.tokens == int(p.num_blocks / p.blocks_per_request * 65536)
    # full group: one block per 256 positions, holding every compressed and indexer cache
    full = [g for g in p.groups if "c4a_kv" in g.kinds]
    assert len(full) == 1 and full[0].blocks_per_request == 65536 // 256
    assert full[0].layers == cfg.layers_with_ratio(4) * 2 + cfg.layers_with_ratio(128)


@pytest.mark.parametrize(
    "formats,batched,logged",
    [
        (("fp8", "mxfp4"), 2048, (12829, 6.26)),
        # bf16 + bf16: c4a and indexer states both hold 8 rows a page, so vLLM buckets them together
        (("bf16", "bf16"), 512, (86361, 42.17)),
    ],
)
def test_vllm_pool_matches_vllm_log_for_tiny_flash(formats, batched, logged):
    # What `vllm serve` of the tiny-flash checkpoint logged (VLLM_CPU_KVCACHE_SPACE=1,
    # --max-model-len 2048): "CPU KV cache size: N tokens, Maximum concurrency for 2,048 tokens
    # per request: Xx" (the serve suite re-checks this against live servers).
    p = plan_vllm_pool(_tiny((0, 0, 4, 128, 4)), *formats, 1 << 30, 2048, batched)
    assert (p.tokens, round(p.max_concurrency, 2)) == logged


def test_pool_rejects_nonsense():
    with pytest.raises(ValueError, match="positive"):
        plan_vllm_pool(V4_FLASH, "fp8", "mxfp4", 0, 2048, 2048)


# -- metadata builder ----------------------------------------------------------------------------
def test_builder_hands_over_vllms_buffers_and_marks_decode_steps(monkeypatch):
    """The builder copies nothing (its tensors are views of vLLM's persistent buffers, so a
    captured decode step reads the refreshed values on replay) and marks uniform decode steps;
    the null block stays vLLM's 0 (the layer's derivations treat pages <= 0 as absent)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_dsv4_hw.engine.attention_backend import DSV4CacheMetadataBuilder

    spec = vllm_spec(layer_kinds(V4_FLASH, 0, "fp8", "mxfp4")[0])
    b = DSV4CacheMetadataBuilder(spec, ["layers.0.attn.window_kv"], None, torch.device("cpu"))
    table = torch.tensor([[3, 0, 7, 9], [0, 0, 4, 2], [1, 1, 1, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([4, 200, 0], dtype=torch.int32)
    m = SimpleNamespace(
        num_reqs=2,
        num_actual_tokens=5,
        max_query_len=4,
        block_table_tensor=table,
        query_start_loc_cpu=torch.tensor([0, 4, 5, 5], dtype=torch.int32),
        seq_lens=seq_lens,
    )
    md = b.build(0, m)
    assert md.block_table.data_ptr() == table.data_ptr() and md.block_table.shape == (2, 4)
    assert md.seq_lens.data_ptr() == seq_lens.data_ptr() and md.null_page == 0
    starts, new = md.host_layout()
    assert starts.tolist() == [0, 199] and new.tolist() == [4, 1]
    assert (md.num_reqs, md.num_tokens, md.block_size, md.decode) == (2, 5, 64, False)
    decode_step = m.__dict__ | {"num_actual_tokens": 2, "max_query_len": 1}
    assert b.build(0, SimpleNamespace(**decode_step)).decode
    sup = DSV4CacheMetadataBuilder.get_cudagraph_support(None, spec)
    assert sup == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setenv("VLLM_DSV4_HW_CUDA_GRAPHS", "0")
    assert not b.build(0, SimpleNamespace(**decode_step)).decode
    assert DSV4CacheMetadataBuilder.get_cudagraph_support(None, spec) == AttentionCGSupport.NEVER


# -- custom-op boundary ----------------------------------------------------------------------------
def test_attention_custom_op_traces_opaquely():
    import vllm_dsv4_hw.engine.attention_layer as vl

    class Fake:
        def run(self, x):
            return x * 2 + 1

    vl._LAYERS["test.fake"] = Fake()
    try:

        def f(x):
            return torch.ops.dsv4_hw.attention(torch.sin(x), "test.fake") - 1

        x = torch.randn(3, 8)
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), torch.sin(x) * 2)
        # the fake implementation gives shapes without running the layer
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            out = torch.ops.dsv4_hw.attention(mode.from_tensor(x), "no.such.layer")
        assert out.shape == x.shape
    finally:
        vl._LAYERS.pop("test.fake", None)


# -- platform and plugin hooks ---------------------------------------------------------------------
def _vllm_config(block_size=256, user_block=False, disable_hybrid=False):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4")),
        cache_config=SimpleNamespace(block_size=block_size, user_specified_block_size=user_block),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hybrid),
    )


def test_platform_rejects_unworkable_settings(monkeypatch):
    from vllm_dsv4_hw.engine import launch_rules
    from vllm_dsv4_hw.engine.cpu_platform import DSV4HwCpuPlatform, PlatformConfigError

    # the launch checks have their own tests (tests/model/test_serve_checks.py)
    monkeypatch.setattr(launch_rules, "check_serve_settings", lambda vllm_config: None)
    with pytest.raises(PlatformConfigError, match="--block-size 256"):
        DSV4HwCpuPlatform.check_and_update_config(_vllm_config(128, user_block=True))
    with pytest.raises(PlatformConfigError, match="hybrid KV cache manager"):
        DSV4HwCpuPlatform.check_and_update_config(_vllm_config(disable_hybrid=True))


def test_platform_plugin_choice(monkeypatch):
    from vllm_dsv4_hw.engine import plugin as vllm_plugin

    monkeypatch.setenv("VLLM_DSV4_HW_PLATFORM", "off")
    assert vllm_plugin.platform_plugin() is None
    monkeypatch.setenv("VLLM_DSV4_HW_PLATFORM", "on")
    assert vllm_plugin.platform_plugin() == vllm_plugin.PLATFORM_CLASS
    monkeypatch.setenv("VLLM_DSV4_HW_PLATFORM", "auto")
    monkeypatch.setenv("VLLM_DSV4_HW_DEVICE", "cpu")
    assert vllm_plugin.platform_plugin() == vllm_plugin.PLATFORM_CLASS
    monkeypatch.setenv("VLLM_DSV4_HW_DEVICE", "cuda")
    assert vllm_plugin.platform_plugin() is None
    monkeypatch.setenv("VLLM_DSV4_HW_PLATFORM", "maybe")
    with pytest.raises(ValueError, match="VLLM_DSV4_HW_PLATFORM"):
        vllm_plugin.platform_plugin()


def test_entry_points_are_declared():
    from importlib.metadata import entry_points

    general = {e.value for e in entry_points(group="vllm.general_plugins")}
    platforms = {e.value for e in entry_points(group="vllm.platform_plugins")}
    assert "vllm_dsv4_hw.engine.plugin:register" in general
    assert "vllm_dsv4_hw.engine.plugin:platform_plugin" in platforms
