# SPDX-License-Identifier: Apache-2.0
"""Loading a platform the way vLLM loads a vendor's: a ``vllm.platform_plugins`` entry point.

``installed/<plugin>/`` holds a minimal installed-distribution record (``*.dist-info`` with
``METADATA`` and ``entry_points.txt``) naming one of the functions below. With that directory and
the repository root (for ``tests.foreign_platform``) on ``PYTHONPATH``, ``importlib.metadata``
lists the entry point in every vLLM process: nothing is pip-installed. One directory per plugin,
since vLLM refuses to start when two out-of-tree platform plugins activate.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PLUGINS = ("foreign", "stock_cpu")


def foreign_platform() -> str:
    return "tests.foreign_platform.vendor_platform.ForeignPlatform"


def stock_cpu_platform() -> str:
    """vLLM's own CPU platform, handed out by another package's plugin."""
    return "vllm.platforms.cpu.CpuPlatform"


def server_env(plugin: str) -> dict[str, str]:
    """Environment of a ``vllm serve`` under ``plugin``'s platform, this plugin's platform off."""
    if plugin not in PLUGINS:
        raise ValueError(f"unknown test platform plugin {plugin!r}; use one of {PLUGINS}")
    return {
        "PYTHONPATH": f"{HERE / 'installed' / plugin}:{REPO_ROOT}",
        "VLLM_DSV4_HW_PLATFORM": "off",
    }
