# SPDX-License-Identifier: Apache-2.0
"""The README's settings tables, generated from ``envs.py`` (one source for every setting).

    python -m vllm_dsv4_hw.tools.settings_table --write README.md

rewrites the part of the file between the ``<!-- settings:begin -->`` and
``<!-- settings:end -->`` markers; without ``--write`` it prints the tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_dsv4_hw import envs

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _rows(variables) -> list[str]:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in variables:
        doc = " ".join(v.doc.split()).replace("|", "\\|")
        rows.append(f"| `{v.name}` | `{v.default or '(empty)'}` | {doc} |")
    return rows


def tables() -> str:
    """The user settings, then the developer-only switches, as markdown."""
    return "\n".join(
        [
            "What a user sets:",
            "",
            *_rows(envs.USER_VARS),
            "",
            "Developer-only switches (A/B and debugging levers whose defaults are what "
            "a user wants):",
            "",
            *_rows(envs.DEVELOPER_VARS),
        ]
    )


def rewrite(text: str) -> str:
    """``text`` with its settings section replaced by :func:`tables`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} section to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{tables()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="FILE", help="rewrite FILE's settings section")
    args = ap.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(rewrite(path.read_text()))
    else:
        sys.stdout.write(tables() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
