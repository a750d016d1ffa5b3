# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/gpuserve_entry_points.py``: gpuserve's driver gets this checkout's plugin entry
points (vLLM loads the plugin by them), and nothing else in it changes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpuserve_entry_points import entry_points, rewrite

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """cat > "$TREE/vllm-0.32.0.dist-info/entry_points.txt" <<'EOF'
[vllm.general_plugins]
lora_filesystem_resolver = vllm.plugins.lora_resolvers.filesystem_resolver:register
EOF
cat > "$TREE/vllm_dsv4_hw-0.1.0.dist-info/entry_points.txt" <<'EOF'
[console_scripts]
vllm-dsv4-hw = vllm_dsv4_hw.cli.main:main

[vllm.general_plugins]
dsv4_hw = vllm_dsv4_hw.vllm_plugin:register

[vllm.platform_plugins]
dsv4_hw = vllm_dsv4_hw.vllm_plugin:platform_plugin
EOF
"""


def test_the_plugin_entry_points_are_this_checkouts():
    eps = entry_points(ROOT / "pyproject.toml")
    got = rewrite(DRIVER, eps)
    general = eps["vllm.general_plugins"]["dsv4_hw"]
    platform = eps["vllm.platform_plugins"]["dsv4_hw"]
    assert "vllm_plugin" not in got
    assert f"dsv4_hw = {general}\n" in got and f"dsv4_hw = {platform}\n" in got
    want = DRIVER.replace("vllm_dsv4_hw.vllm_plugin:register", general).replace(
        "vllm_dsv4_hw.vllm_plugin:platform_plugin", platform
    )
    assert got == want  # vLLM's own lines and the console script untouched
    module = general.split(":")[0].replace(".", "/") + ".py"
    assert (ROOT / module).is_file(), module
