"""The docs say what the code does: exit statuses, the lock example, placeholder values, the variables."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from tasks.cli.main import variable_docs
from tasks.core import errors
from tasks.core.settings import VARIABLES
from tasks.lock.lockfile import ENV_PLACEHOLDERS, arch_env

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


def test_the_annotated_lock_example_is_toml() -> None:
    """docs/lock.md's annotated example parses once its elisions (``, ...]``) are closed: copied, it loads."""
    text = (DOCS.parent / "lock.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0].replace(", ...]", "]")
    doc = tomllib.loads(example)
    assert "requirements" in doc["toolchain"]["hermetic"] and "wheels" in doc["toolchain"]["hermetic"]


def test_the_placeholder_values_in_the_guide_are_the_codes() -> None:
    """docs/your-package.md's placeholder table shows what tasks/lockfile.arch_env gives for its archs."""
    text = (DOCS.parent / "your-package.md").read_text()
    rows = dict(re.findall(r"^\| `\{(\w+)\}` \| `([^`]+)` \|", text, flags=re.M))
    values = arch_env(("sm_90a", "sm_100a"))
    assert rows and rows == {k: v for k, v in values.items() if k in rows}
    assert set(rows) == set(values), set(values) ^ set(rows)
    assert set(ENV_PLACEHOLDERS) <= set(re.findall(r"^\| `\{(\w+)\}`", text, flags=re.M))


def test_help_lists_every_variable_with_its_meaning() -> None:
    """`doit help` / `reprostack help` print each variable's meaning from tasks/core/settings.py's table."""
    docs = variable_docs()
    assert set(docs) == set(VARIABLES), set(docs) ^ set(VARIABLES)
    assert all(docs.values()) and "``" not in "".join(docs.values())


def _docs_walk() -> ModuleType:
    path = DOCS.parents[1] / "scripts" / "docs_walk.py"
    spec = importlib.util.spec_from_file_location("docs_walk", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_walk"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_walked_pages_say_where_each_shell_block_runs() -> None:
    """Each bash block of the pages scripts/docs_walk.py walks says its host (or no-walk), and each page has walked
    blocks; the variables they name are set with a default where they are first needed."""
    walk = _docs_walk()
    root = DOCS.parents[1]
    roles = {}
    for page in walk.PAGES:
        blocks = walk.parse_page(root / page, page)  # raises for a bash block without its mark
        roles[page] = {b.role for b in blocks if b.role}
        walked = "".join(b.text for b in blocks if b.role)
        used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", walked)) - {"HOME", "PATH", "PWD"}
        assert used <= set(walk.variables(blocks)), (page, used - set(walk.variables(blocks)))
    assert roles == {
        "docs/real-stack.md": {"both", "mirror", "node"},
        "docs/offline.md": {"node"},
        "docs/your-package.md": {"mirror"},
    }, roles
