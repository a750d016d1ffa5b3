# SPDX-License-Identifier: Apache-2.0
"""The launch rules every platform gets (``engine/launch_rules.py``), on stand-in configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dsv4_hw.engine import launch_rules


def _cfg(block=16, user_block=False, disable_hybrid=None):
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block, user_specified_block_size=user_block),
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=disable_hybrid, max_num_batched_tokens=None
        ),
    )


@pytest.fixture(autouse=True)
def _no_checkpoint(monkeypatch):
    monkeypatch.setattr(
        launch_rules,
        "check_serve_settings",
        lambda c: SimpleNamespace(main_format="fp8", indexer_format="mxfp4"),
    )


def test_a_platform_without_hybrid_kv_cache_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(launch_rules, "_platform_name", lambda: ("VendorPlatform", False))
    with pytest.raises(launch_rules.LaunchConfigError) as err:
        launch_rules.settle_launch(_cfg())
    msg = str(err.value)
    assert "\n" not in msg and "VendorPlatform" in msg and "support_hybrid_kv_cache()" in msg


def test_block_size_set_once_and_user_values_refused(monkeypatch):
    monkeypatch.setattr(launch_rules, "_platform_name", lambda: ("VendorPlatform", True))
    cfg = _cfg()
    launch_rules.settle_launch(cfg)
    assert cfg.cache_config.block_size == launch_rules.BLOCK_SIZE
    cfg.cache_config.block_size, cfg.cache_config.user_specified_block_size = 64, True
    launch_rules.settle_launch(cfg)  # the engine's re-check after KV cache init: settled
    with pytest.raises(launch_rules.LaunchConfigError, match="--block-size 256"):
        launch_rules.settle_launch(_cfg(128, user_block=True))
    with pytest.raises(launch_rules.LaunchConfigError, match="disable-hybrid-kv-cache-manager"):
        launch_rules.settle_launch(_cfg(disable_hybrid=True))
