# SPDX-License-Identifier: Apache-2.0
"""Copy gpuserve's driver (``.gpuserve/run_on_device.sh``) with the plugin's entry points taken
from this checkout's ``pyproject.toml``: the driver writes the distribution metadata vLLM's plugin
discovery reads, and names the entry points of an older layout of the package.

    python3 benchmarks/gpuserve_entry_points.py SRC DST
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

GROUPS = ("vllm.general_plugins", "vllm.platform_plugins")


def entry_points(pyproject: Path) -> dict[str, dict[str, str]]:
    """``{group: {name: "module:function"}}`` of pyproject's ``[project.entry-points."<group>"]``
    tables (read line by line: ``tomllib`` is Python 3.11's, the package supports 3.10)."""
    eps: dict[str, dict[str, str]] = {}
    group = None
    for line in pyproject.read_text().splitlines():
        head = re.match(r'\[project\.entry-points\."([^"]+)"\]\s*$', line)
        if head or line.startswith("["):
            group = head.group(1) if head else None
            continue
        m = re.match(r'\s*([\w-]+)\s*=\s*"([\w.]+:\w+)"\s*$', line)
        if m and group in GROUPS:
            eps.setdefault(group, {})[m.group(1)] = m.group(2)
    return eps


def rewrite(driver: str, eps: dict[str, dict[str, str]]) -> str:
    """The driver with each ``<name> = vllm_dsv4_hw...`` line of our groups set to ours."""
    out, group = [], None
    for line in driver.splitlines(keepends=True):
        head = re.match(r"\[(.+)\]\s*$", line)
        if head:
            group = head.group(1)
        m = re.match(r"(\w+) = vllm_dsv4_hw[\w.]*:\w+\s*$", line)
        if m and group in eps and m.group(1) in eps[group]:
            line = f"{m.group(1)} = {eps[group][m.group(1)]}\n"
        out.append(line)
    return "".join(out)


def main(argv: list[str]) -> int:
    src, dst = Path(argv[0]), Path(argv[1])
    root = Path(__file__).resolve().parents[1]
    dst.write_text(rewrite(src.read_text(), entry_points(root / "pyproject.toml")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
