# SPDX-License-Identifier: Apache-2.0
"""A peer row (times, errors, verdict) and the timing both sides share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmarks.gpu import timing


def _timed(fn, device) -> tuple[float, str]:
    before = dict(timing.MODES)
    ms = timing.time_ms(fn, device)
    mode = next((m for m, c in timing.MODES.items() if c != before.get(m, 0)), "host")
    return ms * 1e3, mode


@dataclass
class Row:
    op: str
    case: str
    ours_us: float | None = None
    upstream_us: float | None = None
    ours_mode: str = ""
    upstream_mode: str = ""
    parts: list = field(default_factory=list)  # (what, ours err, upstream err, tolerance)
    note: str = ""
    upstream_reason: str = ""  # why upstream has no figure on this row

    def time(self, run_ours, run_up, device) -> None:
        from benchmarks.peer.upstream import Unavailable

        self.ours_us, self.ours_mode = _timed(run_ours, device)
        if run_up is not None:
            try:
                self.upstream_us, self.upstream_mode = _timed(run_up, device)
            except Unavailable as exc:  # ours still timed and judged; the reason in the table
                self.upstream_reason = str(exc)

    def errors(self, what: str, ours: float, up: float | None, tol: float) -> None:
        self.parts.append((what, ours, up, tol))

    @property
    def ratio(self) -> float | None:
        if self.ours_us and self.upstream_us:
            return self.upstream_us / self.ours_us
        return None

    def correct(self, side: int) -> bool | None:
        errs = [(p[side], p[3]) for p in self.parts if p[side] is not None]
        if not errs:
            return None
        return all(e <= tol and not math.isnan(e) for e, tol in errs)

    def as_dict(self) -> dict:
        return dict(
            op=self.op,
            case=self.case,
            ours_us=self.ours_us,
            upstream_us=self.upstream_us,
            ratio=self.ratio,
            ours_mode=self.ours_mode,
            upstream_mode=self.upstream_mode,
            errors=[dict(what=w, ours=o, upstream=u, tol=t) for w, o, u, t in self.parts],
            ours_correct=self.correct(1),
            upstream_correct=self.correct(2),
            note=self.note,
            upstream_reason=self.upstream_reason,
        )


def _err_cell(row: Row, side: int) -> str:
    parts = [p for p in row.parts if p[side] is not None]
    if not parts:
        return "-"
    worst = max(parts, key=lambda p: p[side] / p[3])
    verdict = "ok" if row.correct(side) else "WRONG"
    return f"{verdict} {worst[side]:.1e} ({worst[0]})"


def markdown(rows: list[Row]) -> str:
    head = (
        "| op | case | ours us | upstream us | ratio | ours vs oracle | upstream vs oracle "
        "| note |\n|---|---|---:|---:|---:|---|---|---|"
    )
    lines = [head]
    for r in rows:
        up = f"{r.upstream_us:.1f}" if r.upstream_us else (r.upstream_reason or "-")
        ratio = f"{r.ratio:.2f}" if r.ratio else "ours only"
        ours = f"{r.ours_us:.1f}" if r.ours_us else "-"
        modes = (
            ""
            if {r.ours_mode, r.upstream_mode} <= {"graph", ""}
            else f" (timing: ours {r.ours_mode}, upstream {r.upstream_mode})"
        )
        lines.append(
            f"| {r.op} | {r.case} | {ours} | {up} | {ratio} | {_err_cell(r, 1)} | "
            f"{_err_cell(r, 2)} | {r.note}{modes} |"
        )
    return "\n".join(lines)
