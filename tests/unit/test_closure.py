"""tasks/env/closure.py's pure parts and its store: requirements met by a closure, a stored wheel checked again."""

from __future__ import annotations

from pathlib import Path

import pytest
from make_fixtures import write_wheel

from tasks.core.errors import VerificationError
from tasks.core.treehash import file_sha256
from tasks.env.closure import Pin, Target, fetch, provided_needs, unmet

TARGET = Target("3.11")


def test_unmet_names_each_requirement_with_what_the_closure_has() -> None:
    available = {"repro-colors": "1.1.0", "repro-shapes": "0.2.0", "torch": "", "repro-round": "0.1.0", "odd": "x!"}
    requires = [
        "repro-colors>=2.0",  # the closure has another version
        "repro-shapes[round]>=0.2",  # met
        "torch>=99",  # provided without a version: whatever the target has
        "repro-round==0.1.*",  # met
        "repro-legacy; python_version < '3'",  # not for this target
        "repro-missing>=1",
        "odd>=1",  # a version PEP 440 cannot read meets nothing
    ]
    assert unmet(requires, available, TARGET) == [
        "repro-colors>=2.0 (the closure has 1.1.0)",
        "repro-missing>=1 (not in the closure)",
        "odd>=1 (the closure has x!)",
    ]


def test_each_wheel_needs_what_it_requires_of_the_provided_set_and_what_that_requires() -> None:
    """What preflight.json records per wheel: the provided distributions its requirements name, followed through
    their own (the base capture's), with the extras asked for and the markers of the target, each with the
    version specifiers of the requirements that reached it; nothing else of the base (uv), and nothing a marker
    leaves out."""
    base = {
        "torch": ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13", 'triton==3.6.0; platform_system == "Linux"',
                  'optree>=0.13.0; extra == "optree"', 'pywin; platform_system == "Windows"'],
        "sympy": ["mpmath<1.4,>=1.1.0"],
        "mpmath": [], "filelock": [], "typing-extensions": [], "triton": [], "optree": ["typing_extensions"],
        "uv": [], "pywin": [],
    }  # fmt: skip
    requires = {
        "te.whl": ["torch==2.11.0", "pydantic", "einops"],  # pydantic, einops: the closure's, not provided
        "pydantic.whl": ["typing_extensions>=4.14", "annotated-types"],
        "opt.whl": ["torch[optree]>=2"],
        "legacy.whl": ["sympy; python_version < '3'"],
        "none.whl": [],
    }
    assert provided_needs(requires, base, TARGET) == {
        "te.whl": ["filelock", "mpmath<1.4,>=1.1.0", "sympy>=1.13", "torch==2.11.0", "triton==3.6.0",
                   "typing-extensions>=4.10.0"],
        "pydantic.whl": ["typing-extensions>=4.14"],
        "opt.whl": ["filelock", "mpmath<1.4,>=1.1.0", "optree>=0.13.0", "sympy>=1.13", "torch>=2", "triton==3.6.0",
                    "typing-extensions>=4.10.0"],
        "legacy.whl": [],
        "none.whl": [],
    }  # fmt: skip


def test_a_stored_closure_wheel_is_checked_again_and_a_changed_one_fetched_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mirror = tmp_path / "mirror"
    name, sha = write_wheel(mirror / "wheels", "repro-colors", "1.1.0", (), "COLOR = 'blue'\n")
    pin = Pin("repro-colors", "1.1.0", (sha,))
    store = tmp_path / "store"
    store.mkdir()  # as Cache.fetched makes it
    first = fetch(pin, store, mirror=mirror, indexes=[], target=TARGET)
    assert first == store / sha / name and file_sha256(first) == sha
    first.write_bytes(first.read_bytes() + b"\0")  # changed in the cache after it was stored
    again = fetch(pin, store, mirror=mirror, indexes=[], target=TARGET)
    assert again == first and file_sha256(again) == sha
    assert (
        f"corrupted fetched wheel {first}: its sha256 changed; discarded, it is fetched again"
        in capsys.readouterr().err
    )
    # Changed, and the mirror's copy changed too: refused, and neither is left in the store.
    again.write_bytes(b"changed")
    (mirror / "wheels" / name).write_bytes(b"changed too")
    with pytest.raises(VerificationError, match="which the lock does not pin"):
        fetch(pin, store, mirror=mirror, indexes=[], target=TARGET)
    assert list(store.iterdir()) == []


def test_a_pin_whose_sha256_is_another_wheel_is_refused_from_the_store_and_the_mirror(tmp_path: Path) -> None:
    """A pin's sha256 names the file: one that is another project's wheel, or another version's, by its file name
    or its own METADATA, is refused wherever it comes from (issue 26: a warm cache took any stored file)."""
    store = tmp_path / "store"
    older, older_sha = write_wheel(tmp_path / "older", "repro-colors", "1.0.0", (), "COLOR = 'red'\n")
    (store / older_sha).mkdir(parents=True)  # the cache holds 1.0.0, fetched for an earlier lock
    (tmp_path / "older" / older).rename(store / older_sha / older)
    with pytest.raises(VerificationError) as err:
        fetch(Pin("repro-colors", "1.1.0", (older_sha,)), store, mirror=None, indexes=[], target=TARGET)
    assert str(err.value).startswith(
        f"[runtime] repro-colors==1.1.0: the file of its pinned sha256 {older_sha[:12]}… (cached as {older}) is not "
        f"a wheel of repro-colors 1.1.0: its file name {older} is of version 1.0.0, not 1.1.0"
    )
    assert (store / older_sha / older).is_file()  # a good wheel of its own pin: kept
    # A mirror's file named as repro-colors 1.1.0 that is repro-round's wheel (its METADATA says so).
    mirror = tmp_path / "mirror"
    name, sha = write_wheel(mirror / "wheels", "repro-round", "0.1.0", (), "PI = 3\n")
    posing = mirror / "wheels" / "repro_colors-1.1.0-py3-none-any.whl"
    (mirror / "wheels" / name).rename(posing)
    with pytest.raises(VerificationError, match=r"names the project 'repro-round', not 'repro-colors'"):
        fetch(Pin("repro-colors", "1.1.0", (sha,)), store, mirror=mirror, indexes=[], target=TARGET)
    assert sorted(p.name for p in store.iterdir()) == [older_sha]  # nothing of it kept
    # The same file already in the store under that name (as an earlier version of this tool kept it): refused too.
    (store / sha).mkdir()
    posing.rename(store / sha / posing.name)
    with pytest.raises(VerificationError, match=r"\(cached as repro_colors-1.1.0-py3-none-any.whl\) .* names the"):
        fetch(Pin("repro-colors", "1.1.0", (sha,)), store, mirror=None, indexes=[], target=TARGET)
