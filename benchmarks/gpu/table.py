"""The plain-text table every GPU benchmark module prints (one column per key seen in the rows)."""

from __future__ import annotations

import sys


def fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict], file=sys.stdout) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(wd) for k, wd in zip(keys, widths)), file=file)
    for c in cells:
        print("  ".join(v.ljust(wd) for v, wd in zip(c, widths)), file=file)
