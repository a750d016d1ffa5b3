# SPDX-License-Identifier: Apache-2.0
"""VLLM_DSV4_HW_MODEL_OWNER decides whose DeepseekV4ForCausalLM serves beside vllm-ascend.

A fake ``vllm_ascend`` general plugin (what vllm-ascend's ``ascend_model`` and quantization
registrations do: ``register_model`` of its DeepseekV4ForCausalLM and MTP classes, a
``deepseek_v4_fp8`` config) runs before and after ours on fresh vLLM registries
(``_ModelRegistry``, a copy of ``MODELS_CONFIG_MAP``, a list of quantization names), so no global
vLLM state changes.
"""

from __future__ import annotations

import logging

import pytest
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.registry import _ModelRegistry

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.engine.registration import ARCHITECTURE, MODEL_CLASS, describe, install

ASCEND_MODEL = "vllm_ascend.models.deepseek_v4.model:AscendDeepseekV4ForCausalLM"
ASCEND_MTP = ("DeepSeekV4MTPModel", "vllm_ascend.models.deepseek_v4.mtp:DeepSeekV4MTP")


class World:
    def __init__(self) -> None:
        self.registry = _ModelRegistry({})
        self.config_map = dict(MODELS_CONFIG_MAP)
        self.quant: dict[str, str] = {}

    def fake_vllm_ascend(self) -> None:
        self.registry.register_model(ARCHITECTURE, ASCEND_MODEL)
        self.registry.register_model(*ASCEND_MTP)
        self.quant["deepseek_v4_fp8"] = "AscendDeepseekV4FP8Config"

    def ours(self, owner: str) -> str:
        return install(
            owner,
            self.registry,
            self.config_map if owner == "ours" else None,
            lambda: self.quant.__setitem__("dsv4_hw_fp8", "DSV4HwQuantConfig"),
        )

    def served(self) -> str:
        return describe(self.registry.models[ARCHITECTURE])

    def load(self, owner: str, vendor_first: bool) -> str:
        """Both plugins registered in the given order; our registration's log line."""
        if vendor_first:
            self.fake_vllm_ascend()
            return self.ours(owner)
        line = self.ours(owner)
        self.fake_vllm_ascend()
        return line


@pytest.mark.parametrize("vendor_first", [True, False])
def test_ours_wins_in_either_load_order(vendor_first, caplog):
    w = World()
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_hw"):
        line = w.load("ours", vendor_first)
    assert w.served() == MODEL_CLASS
    assert describe(w.registry.models[ASCEND_MTP[0]]) == ASCEND_MTP[1]  # its other models stay
    assert w.quant == {
        "deepseek_v4_fp8": "AscendDeepseekV4FP8Config",
        "dsv4_hw_fp8": "DSV4HwQuantConfig",
    }
    assert w.config_map[ARCHITECTURE].__name__ == "DSV4HwLaunchRules"
    # vLLM's own hook (FP8 checkpoints -> deepseek_v4_fp8) still runs under ours
    assert issubclass(w.config_map[ARCHITECTURE], MODELS_CONFIG_MAP[ARCHITECTURE])
    assert "served by vllm_dsv4_hw" in line and "VLLM_DSV4_HW_MODEL_OWNER=ours" in line
    assert line in caplog.text
    if not vendor_first:
        assert f"{ASCEND_MODEL} registered after ours; not taken" in caplog.text


@pytest.mark.parametrize("vendor_first", [True, False])
def test_vendor_leaves_its_registrations_intact(vendor_first, caplog):
    w = World()
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_hw"):
        line = w.load("vendor", vendor_first)
    assert w.served() == ASCEND_MODEL
    assert w.quant == {"deepseek_v4_fp8": "AscendDeepseekV4FP8Config"}  # no dsv4_hw_fp8
    assert w.config_map[ARCHITECTURE] is MODELS_CONFIG_MAP[ARCHITECTURE]  # vLLM's hook, untouched
    assert "left to the vendor's registration" in line and line in caplog.text


def test_ours_twice_keeps_one_hook():
    w = World()
    w.ours("ours")
    hook = w.config_map[ARCHITECTURE]
    w.ours("ours")
    assert w.config_map[ARCHITECTURE] is hook and w.served() == MODEL_CLASS


def test_bad_owner_is_one_line(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_HW_MODEL_OWNER", "ascend")
    with pytest.raises(envs.SettingError) as err:
        envs.model_owner()
    msg = str(err.value)
    assert "\n" not in msg and "VLLM_DSV4_HW_MODEL_OWNER='ascend'" in msg and "ours, vendor" in msg
    monkeypatch.delenv("VLLM_DSV4_HW_MODEL_OWNER")
    assert envs.model_owner() == "ours"


def test_our_cpu_platform_leaves_a_vendor_model_alone(monkeypatch):
    """With vendor, the plugin's CPU platform is vLLM's CPU platform: no DeepSeek V4 rules (a
    --block-size 128 that ours refuses goes through to vLLM's hook)."""
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    from vllm_dsv4_hw.engine.cpu_platform import DSV4HwCpuPlatform, PlatformConfigError

    seen = []
    monkeypatch.setattr(
        CpuPlatform, "check_and_update_config", classmethod(lambda cls, cfg: seen.append(cfg))
    )
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4")),
        cache_config=SimpleNamespace(block_size=128, user_specified_block_size=True),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )
    monkeypatch.setattr("vllm_dsv4_hw.engine.launch_rules.check_serve_settings", lambda c: None)
    with pytest.raises(PlatformConfigError, match="--block-size 256"):
        DSV4HwCpuPlatform.check_and_update_config(cfg)
    monkeypatch.setenv("VLLM_DSV4_HW_MODEL_OWNER", "vendor")
    DSV4HwCpuPlatform.check_and_update_config(cfg)
    assert seen == [cfg] and cfg.cache_config.block_size == 128
