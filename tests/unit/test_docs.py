"""The documented exit statuses are the ones the code uses."""

from __future__ import annotations

import re
from pathlib import Path

from tasks import errors

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"


def documented_statuses() -> dict[str, int]:
    """error class name -> status, from the table under "## Exit statuses" in docs/tasks.md."""
    text = DOCS.read_text()
    section = text[text.index("## Exit statuses") :]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.M)
    return {name: int(status) for status, name in rows}


def test_exit_status_table_matches_the_errors() -> None:
    classes = [errors.ReproError, *errors.ReproError.__subclasses__()]
    code = {cls.__name__: cls.exit_code for cls in classes}
    assert documented_statuses() == code
    assert len(set(code.values())) == len(code), "two errors share a status"
    assert min(code.values()) > 3, "statuses 1 to 3 are doit's own"
