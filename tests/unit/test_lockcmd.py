"""`doit lock` writes into the lock's TOML document in place (tasks/cli/lockcmd.py)."""

from __future__ import annotations

import tomlkit

from tasks.cli.lockcmd import set_key

LOCK = """[sources.a]
kind = "git"
commit = "0123"

[sources.a.submodules]
"sub" = {url = "https://example.invalid/sub.git", commit = "4567"}

# What b is: this comment introduces [sources.b], though tomlkit keeps it at the end of [sources.a].
[sources.b]
kind = "pypi"

# What the profile is.
[profiles.p]
x = 1
"""


def test_a_new_key_goes_after_the_tables_last_key_not_under_the_next_tables_comment() -> None:
    doc = tomlkit.parse(LOCK)
    set_key(doc["sources"]["a"], "tree_sha256", "ab")
    set_key(doc["sources"]["b"], "sha256", "cd")
    set_key(doc["sources"]["b"], "kind", "url")  # an existing key keeps its place
    text = tomlkit.dumps(doc)
    assert 'commit = "0123"\ntree_sha256 = "ab"\n\n[sources.a.submodules]' in text, text
    assert 'kind = "url"\nsha256 = "cd"\n\n# What the profile is.\n[profiles.p]' in text, text
    parsed = tomlkit.parse(text)
    assert parsed["sources"]["a"]["tree_sha256"] == "ab" and "tree_sha256" not in parsed["sources"]["a"]["submodules"]
