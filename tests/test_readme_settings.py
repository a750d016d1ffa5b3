# SPDX-License-Identifier: Apache-2.0
"""The README's settings tables are the ones ``envs.py`` generates (every setting, once)."""

from pathlib import Path

import pytest

from vllm_dsv4_hw import envs
from vllm_dsv4_hw.tools import settings_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_settings_are_generated_from_envs():
    text = README.read_text()
    assert settings_table.rewrite(text) == text, (
        "README.md's settings tables are stale: python -m vllm_dsv4_hw.tools.settings_table "
        "--write README.md"
    )
    for v in envs.ALL_VARS:
        assert text.count(f"`{v.name}`") >= 1, v.name


def test_rewrite_replaces_only_the_section():
    doc = f"intro\n{settings_table.BEGIN}\nold\n{settings_table.END}\noutro\n"
    new = settings_table.rewrite(doc)
    assert new.startswith("intro\n") and new.endswith("\noutro\n") and "old" not in new
    assert all(f"`{v.name}`" in new for v in envs.ALL_VARS)
    with pytest.raises(ValueError, match="settings:begin"):
        settings_table.rewrite("no markers")
