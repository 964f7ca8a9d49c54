"""Reordering a ninja manifest's build edges, longest first (tasks/outside/ninjaorder.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.outside import ninjaorder
from tasks.store import history

MANIFEST = """\
ninja_required_version = 1.3
cflags = -O2

rule compile
  command = cc $cflags -c $in -o $out

build /b/a.o: compile /s/a.cu
build /b/b$ x.o: compile /s/b x.cu
  cflags = -O3
build /b/c.o | /b/c.d: compile /s/c.cu

build /b/d.o: compile /s/d.cu
# the link
build lib.so: link /b/a.o /b/b$ x.o /b/c.o /b/d.o

default lib.so
"""


def _builds(text: str) -> list[str]:
    return [line.split(":")[0] for line in text.splitlines() if line.startswith("build ")]


def test_builds_sorted_longest_first_rest_untouched() -> None:
    out = ninjaorder.reorder_text(MANIFEST, {"c.o": 30.0, "b x.o": 700.0, "lib.so": 1.0, "zz.o": 5})
    assert _builds(out) == ["build /b/b$ x.o", "build /b/c.o | /b/c.d", "build /b/a.o", "build /b/d.o", "build lib.so"]
    # The indented variable moves with its edge; everything else stays where it was.
    assert "build /b/b$ x.o: compile /s/b x.cu\n  cflags = -O3\n" in out
    assert out.splitlines()[:6] == MANIFEST.splitlines()[:6]
    assert out.endswith("# the link\nbuild lib.so: link /b/a.o /b/b$ x.o /b/c.o /b/d.o\n\ndefault lib.so\n")
    assert sorted(out.splitlines()) == sorted(MANIFEST.splitlines())


def test_no_times_no_change() -> None:
    assert ninjaorder.reorder_text(MANIFEST, {}) == MANIFEST
    assert ninjaorder.reorder_text(MANIFEST, {"unknown.o": 3}) == MANIFEST


def test_manifest_path_follows_ninja_arguments() -> None:
    assert ninjaorder.manifest_path([]) == Path("build.ninja")
    assert ninjaorder.manifest_path(["-C", "/x", "-v"]) == Path("/x/build.ninja")
    assert ninjaorder.manifest_path(["-C/x", "-f", "other.ninja"]) == Path("/x/other.ninja")
    assert ninjaorder.manifest_path(["-frules.ninja", "target"]) == Path("rules.ninja")


def test_times_recorded_in_the_cache_override_the_hints(tmp_path: Path) -> None:
    hints = tmp_path / "unit-times.json"
    hints.write_text(json.dumps({"a.o": 10, "b.o": 20}))
    assert history.known_times(tmp_path / "cache", hints, "pkg") == {"a.o": 10.0, "b.o": 20.0}
    history.record_times(tmp_path / "cache", "pkg", {"b.o": 5.04, "c.o": 1})
    history.record_times(tmp_path / "cache", "pkg", {"c.o": 2})
    assert history.known_times(tmp_path / "cache", hints, "pkg") == {"a.o": 10.0, "b.o": 5.0, "c.o": 2.0}
    assert history.known_times(tmp_path / "cache", None, "other") == {}
    hints.write_text('["not", "a", "table"]')
    assert history.known_times(tmp_path / "none", hints, "pkg") == {}


def test_a_units_record_goes_to_the_cache_as_it_ends(tmp_path: Path) -> None:
    """The broker's journal (history.record_unit): a finished unit's memory and seconds join the package's
    records one by one; a unit that failed (``exit``) keeps its memory but gives no time."""
    cache = tmp_path / "cache"
    history.record_unit(cache, "pkg", "a.o", {"peak_mb": 300.0, "peak_in": "cicc", "seconds": 12.34})
    history.record_unit(cache, "pkg", "b.o", {"peak_mb": 100.0, "seconds": 2.0, "exit": 1})
    history.record_unit(cache, "pkg", "a.o", {"peak_mb": 310.0, "seconds": 13.0})
    memory = history.load_memory(history.memory_path(cache, "pkg"))
    assert memory == {"a.o": {"peak_mb": 310, "seconds": 13.0}, "b.o": {"peak_mb": 100, "seconds": 2.0, "exit": 1}}
    assert history.load_times(history.times_path(cache, "pkg")) == {"a.o": 13.0}
