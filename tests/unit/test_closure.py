"""tasks/closure.py's pure parts and its store: requirements met by a closure, a stored wheel checked again."""

from __future__ import annotations

from pathlib import Path

import pytest
from make_fixtures import write_wheel

from tasks.closure import Pin, Target, fetch, unmet
from tasks.errors import VerificationError
from tasks.treehash import file_sha256

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
