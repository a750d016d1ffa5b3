# SPDX-License-Identifier: Apache-2.0
"""The conformance report: the printed pass/fail table, and JSON / markdown files."""

from __future__ import annotations

import json
from pathlib import Path

REPORT_SUFFIXES = {".json": "json", ".md": "markdown", ".markdown": "markdown"}


def report_kind(path: str) -> str:
    kind = REPORT_SUFFIXES.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(
            f"--report {path}: the file name must end in .json or .md (the suffix picks the format)"
        )
    return kind


def status(row: dict) -> str:
    return {True: "PASS", False: "FAIL", None: "SKIP"}[row["ok"]]


def _backend(row: dict) -> str:
    b = row.get("backend", "-")
    return f"{b}*" if row.get("selected") else b


def table_lines(report: dict, width: int | None = None) -> list[str]:
    rows = report["results"]
    head = ("result", "check", "backend", "case", "detail")
    cells = [head] + [
        (
            status(r),
            r["check"],
            _backend(r),
            r["case"],
            r["detail"] + (f" ({r['ms']:.1f} ms)" if r.get("ms") is not None else ""),
        )
        for r in rows
    ]
    w = [max(len(c[i]) for c in cells) for i in range(4)]
    out = []
    for c in cells:
        line = "  ".join(c[i].ljust(w[i]) for i in range(4)) + "  " + c[4]
        out.append((line if width is None else line[:width]).rstrip())
    return out


def header(report: dict) -> str:
    d = report["device"]
    f = report["formats"]
    return (
        f"vllm-dsv4-hw conformance: device {d['spec']} ({d['name']}), shapes "
        f"{report['shapes']}, backends {report['backends']}, formats main {f['main']} / "
        f"indexer {f['indexer']}, seed {report['seed']}"
    )


def summary_line(report: dict) -> str:
    s = report["summary"]
    verdict = "PASSED" if s["ok"] else "FAILED"
    return (
        f"{verdict}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped in "
        f"{report['seconds']:.1f} s (* = the backend the dispatcher selects)"
    )


def to_markdown(report: dict) -> str:
    d = report["device"]
    v = report["versions"]
    caps = ", ".join(f"{k}={val}" for k, val in d["capabilities"].items())
    lines = [
        f"# vllm-dsv4-hw conformance: {d['spec']} ({d['name']})",
        "",
        f"- result: **{summary_line(report)}**",
        f"- started {report['started']} on {report['host']}, seed {report['seed']} "
        f"(replay with `--seed {report['seed']}`)",
        f"- shapes: {report['shapes']}; backends: {report['backends']}; ops: {report['ops']}",
        f"- capabilities: {caps}; backend order: {', '.join(d['backend_order'])}",
        f"- cache formats: main {report['formats']['main']}, indexer "
        f"{report['formats']['indexer']} (held: main {', '.join(report['formats']['held_main'])};"
        f" indexer {', '.join(report['formats']['held_indexer'])})",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        "",
        "| result | check | backend | case | detail |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"]:
        detail = r["detail"] + (f" ({r['ms']:.1f} ms)" if r.get("ms") is not None else "")
        cells = [status(r), r["check"], _backend(r), r["case"], detail]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines.append("")
    lines.append(
        "`*` marks the backend the dispatcher selects on this device; the others are "
        "every other registered backend that can run here."
    )
    return "\n".join(lines) + "\n"


def write(report: dict, path: str) -> str:
    kind = report_kind(path)
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    if kind == "json":
        p.write_text(json.dumps(report, indent=2, default=str) + "\n")
    else:
        p.write_text(to_markdown(report))
    return kind
