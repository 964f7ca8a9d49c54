"""The verification report: one :class:`Row` per check of a package, a :class:`Report` of a run.

Written by tasks/verify/checks.py as ``report.json`` and ``report.txt`` in its work directory, and read back
by ``doit verify_image`` (tasks/verify/image.py) from the container's. Standard library only: it is
imported inside the runtime image with tasks/verify/checks.py (tasks/verify/incontainer.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["PASS", "FAIL", "SKIP"]
DETAIL_WIDTH = 96


@dataclass(frozen=True, kw_only=True)
class Row:
    """One check of one package."""

    package: str
    check: str
    status: Status
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Report:
    """All rows of one verification run."""

    rows: tuple[Row, ...]
    wheel_dir: str = ""
    archs: tuple[str, ...] = ()

    @property
    def passed(self) -> int:
        return sum(row.status == "PASS" for row in self.rows)

    @property
    def failed(self) -> int:
        return sum(row.status == "FAIL" for row in self.rows)

    @property
    def skipped(self) -> int:
        return sum(row.status == "SKIP" for row in self.rows)

    @property
    def ok(self) -> bool:
        """True when no row failed (skips do not fail a run)."""
        return self.failed == 0

    def failures(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.status == "FAIL")

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"

    def render(self, detail_width: int = DETAIL_WIDTH) -> str:
        """A fixed-width table, one line per row, and the summary line."""
        header = ("package", "check", "status", "detail")
        cells = [header] + [
            (row.package, row.check, row.status, one_line(row.detail, detail_width)) for row in self.rows
        ]
        widths = [max(len(cell[i]) for cell in cells) for i in range(3)]
        lines = []
        for i, cell in enumerate(cells):
            line = "  ".join(cell[j].ljust(widths[j]) for j in range(3)) + "  " + cell[3]
            lines.append(line.rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len("detail"))
        lines.append("")
        lines.append(self.summary())
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": 1,
            "ok": self.ok,
            "summary": {"passed": self.passed, "failed": self.failed, "skipped": self.skipped},
            "wheel_dir": self.wheel_dir,
            "archs": list(self.archs),
            "rows": [asdict(row) for row in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        return cls(
            rows=tuple(Row(**row) for row in data["rows"]),
            wheel_dir=str(data.get("wheel_dir", "")),
            archs=tuple(data.get("archs", ())),
        )


def one_line(text: str, width: int) -> str:
    flat = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    if len(flat) <= width:
        return flat
    return flat[: max(width - 3, 0)] + "..."
