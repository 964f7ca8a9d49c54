"""Compile units and the records `doit plan` reads: the code digest, the files a patch touches, the staged tree
file by file, and every record reader's checks (NaN, 1e20, 1e999, fields of other types: no record)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tasks.cli.plan import diff_inputs, nearest
from tasks.core.digest import canonical_json
from tasks.engine.forecast import PackageWork, UnitForecast, package_work, simulate
from tasks.stages import units
from tasks.stages.patch import Patch
from tasks.stages.units import TreeView, code_digest, touched
from tasks.store import history
from tasks.store.cache import Cache
from tasks.store.remote import read_history

# --------------------------------------------------------------------------- the code digest


def test_a_comment_changed_in_place_keeps_the_digest_and_code_does_not() -> None:
    base = b"#pragma once\n/* Returns 0. */\nint f(int); // the answer\n"
    assert code_digest(base) == code_digest(b"#pragma once\n/* Returns zero. */\nint f(int); // an answer\n")
    assert code_digest(base) != code_digest(b"#pragma once\n/* Returns 0. */\nint f(long); // the answer\n")
    # A comment that gains a line moves what follows it: the preprocessor's line markers move too.
    assert code_digest(base) != code_digest(b"#pragma once\n/* Returns\n 0. */\nint f(int); // the answer\n")
    # A line comment continued by a backslash goes on to the next line.
    assert code_digest(b"int a; // x \\\nint b;\n") == code_digest(b"int a; // y \\\nint c;\n")


def test_what_looks_like_a_comment_inside_a_literal_is_code() -> None:
    assert code_digest(b'const char* s = "/* not a comment */";\n') != code_digest(b'const char* s = "/* other */";\n')
    assert code_digest(b'const char* u = "http://a";\n') != code_digest(b'const char* u = "http://b";\n')
    assert code_digest(b"char c = '/'; int x; /* a */\n") == code_digest(b"char c = '/'; int x; /* b */\n")
    raw = b'auto r = R"x(/* kept */)x"; /* dropped */\n'
    assert code_digest(raw) != code_digest(b'auto r = R"x(/* other */)x"; /* dropped */\n')
    assert code_digest(raw) == code_digest(b'auto r = R"x(/* kept */)x"; /* gone */\n')
    # A digit separator is no character literal: the comment after it is still one.
    assert code_digest(b"int n = 1'000; // a\n") == code_digest(b"int n = 1'000; // b\n")


# --------------------------------------------------------------------------- the staged tree


def test_the_files_a_patch_touches_by_its_strip_level(tmp_path: Path) -> None:
    patch = tmp_path / "p.patch"
    patch.write_text(
        "diff --git a/src/x.cu b/src/x.cu\n--- a/src/x.cu\n+++ b/src/x.cu\n@@ -1 +1 @@\n-a\n+b\n"
        "--- /dev/null\n+++ b/include/new.h\n@@ -0,0 +1 @@\n+c\n"
        "diff --git a/old.h b/renamed.h\nsimilarity index 100%\nrename from old.h\nrename to renamed.h\n"
    )
    assert touched(Patch("p", patch)) == ["src/x.cu", "include/new.h", "old.h", "renamed.h"]
    assert touched(Patch("p", patch, strip=2)) == ["x.cu", "new.h", "old.h", "renamed.h"]  # (renames: whole paths)


def test_the_tree_view_takes_overlays_first_and_patched_files_from_the_scratch(tmp_path: Path) -> None:
    main, overlay, patched = tmp_path / "main", tmp_path / "overlay", tmp_path / "patched"
    for root, rel in ((main, "a.h"), (main, "third_party/x/b.h"), (overlay, "b.h"), (patched, "a.h")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(str(root))
    view = TreeView([("third_party/x", overlay), (".", main)], patched=patched, touched=frozenset({"a.h", "gone.h"}))
    assert view.path("third_party/x/b.h") == overlay / "b.h"
    assert view.path("a.h") == patched / "a.h"
    assert view.path("gone.h") is None  # a patch deleted it
    assert view.path("c.h") == main / "c.h"


# --------------------------------------------------------------------------- the record readers


HOSTILE = ["NaN", "1e999", "-1", "1e20", '"12"', "[1]", "{}", "true", "null", "1" + "0" * 400]


@pytest.mark.parametrize("value", HOSTILE)
def test_unit_times_and_memory_that_are_no_number_are_no_record(tmp_path: Path, value: str) -> None:
    times = tmp_path / "t.json"
    times.write_text(f'{{"a.o": {value}, "b.o": 12.5}}')
    assert history.load_times(times) == {"b.o": 12.5}
    memory = tmp_path / "m.json"
    memory.write_text(
        f'{{"a.o": {{"peak_mb": {value}, "seconds": {value}, "peak_from_s": {value}, "peak_in": "cicc"}}, '
        f'"b.o": {value}, "c.o": {{"peak_mb": 900, "peak_from_s": 2.5, "peak_for_s": 1}}}}'
    )
    empty = {"b.o": {}} if value == "{}" else {}  # (an entry without figures: the broker's default)
    timed = {"c.o": {"peak_mb": 900, "peak_from_s": 2.5, "peak_for_s": 1}}  # (a timed peak's figures kept, as written)
    assert history.load_memory(memory) == {"a.o": {"peak_in": "cicc"}, **empty, **timed}


@pytest.mark.parametrize(
    "field", ["wall_s", "wait_s", "compile_s", "cpu_s", "units_cpu_s", "slots", "time", "ninja_units"]
)
@pytest.mark.parametrize("value", ["NaN", "1e999", '"12"', "1e20", "[[1]]"])
def test_a_build_record_with_a_field_of_another_kind_is_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str
) -> None:
    history.record_build(tmp_path, "te", key="k" * 64, wall_s=100.0, wait_s=1.0, compile_s=80.0, slots=8,
                         cpu_s=300.0, units_cpu_s=260.04)  # fmt: skip
    assert history.read_build(tmp_path, "te")["wall_s"] == 100.0
    assert history.read_build(tmp_path, "te")["units_cpu_s"] == 260.0
    path = history.build_path(tmp_path, "te")
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc).replace(f'"{field}": {json.dumps(doc[field])}', f'"{field}": {value}'))
    if field == "time" and value == "1e20":
        pass  # (1e20 is past any date)
    assert history.read_build(tmp_path, "te") == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{field} is not" in err and "ignored" in err


def units_doc() -> dict[str, object]:
    return {
        "format": 1,
        "key": "a" * 64,
        "time": 1_700_000_000.0,
        "document": {"package": "te"},
        "root": "/tmp/reprostack-build/te",
        "ccache": "4.14.2",
        "files": [["csrc/x.cu", "b" * 64, "c" * 64], ["/usr/include/stdio.h", "d" * 64, "e" * 64]],
        "compilers": {"/usr/bin/nvcc": "f" * 64},
        "units": [
            {"name": "x.o", "object": "build/x.o", "command": "nvcc -c csrc/x.cu -o build/x.o",
             "compiler": "/usr/bin/nvcc", "manifest": "1" * 40, "result": "2" * 40, "inputs": [0, 1],
             "outcome": "compiled", "why": "", "seconds": 3.5, "preprocess_s": 0.5, "compile_s": 3.0, "hit_s": None}
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("time", math.nan), ("time", 1e20), ("time", "yesterday"),
        ("key", 12), ("files", {"a": 1}), ("compilers", []), ("units", "x.o"), ("format", 2),
        ("units.0.seconds", math.inf), ("units.0.seconds", -1), ("units.0.hit_s", "fast"),
        ("units.0.inputs", [0, 7]), ("units.0.inputs", [True]), ("units.0.outcome", "maybe"),
        ("units.0.name", ["x"]), ("files.0", ["csrc/x.cu", "not a sha", "c" * 64]),
    ],
)  # fmt: skip
def test_unit_records_with_a_value_of_another_kind_are_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, value: object
) -> None:
    path = history.units_path(tmp_path, "te")
    path.parent.mkdir(parents=True)
    doc = units_doc()
    path.write_text(json.dumps(doc))
    found = history.read_units(tmp_path, "te")
    assert found is not None and found.units[0].inputs == (0, 1) and found.units[0].compile_s == 3.0
    node: object = doc
    *parents, last = where.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value  # type: ignore[index]
    path.write_text(json.dumps(doc))  # (json writes NaN and Infinity as Python reads them back)
    assert history.read_units(tmp_path, "te") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the record is ignored" in err


def test_the_remote_history_drops_entries_dated_nan_or_1e20_and_documents_of_other_shapes() -> None:
    from tasks.core.digest import action_key

    def entry(document: object, time: object) -> dict[str, object]:
        return {"key": action_key(document), "time": time, "key_document": document}  # type: ignore[arg-type]

    odd = {"sources": "not a map", "patches": [1, "x", {"name": 2}], "toolchain": [], "recipe": {"env": 7}}
    good = entry({"package": "te", "toolchain": {"torch": "2"}}, 1_700_000_000)
    raw = json.dumps(
        {"package": "te", "history": [entry({"a": 1}, math.nan), entry({"b": 1}, 1e20), entry(odd, 5.0), good]}
    ).encode()
    found = read_history(raw, "te")
    assert [e["time"] for e in found] == [5.0, 1_700_000_000]
    # A document of other types is compared, not trusted: the diff names what differs, in words.
    assert diff_inputs(odd, {"package": "te", "toolchain": {"torch": "2"}, "sources": {".": "a" * 64}})
    assert nearest({"package": "te"}, []) is None
    deep = b"[" * 100_000 + b"]" * 100_000
    assert read_history(deep, "te") == []
    surrogate = b'{"package": "te", "history": [{"key": "x", "time": 1, "key_document": {"a": "\\ud800"}}]}'
    assert read_history(surrogate, "te") == []
    assert read_history(canonical_json({"package": "te", "history": "x"}), "te") == []


def test_wheel_cache_entries_the_build_would_discard_are_named_and_kept(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK-not-really")
    key = "a" * 64
    entry = cache.put_wheel(key, wheel, {"package": "pkg"})
    assert cache.check_wheel(key) == entry
    meta = cache.wheel_dir(key) / "entry.json"
    good = meta.read_text()
    for text in ("not json", "[]", '{"filename": "../../x.whl", "sha256": "' + "0" * 64 + '"}',
                 '{"filename": "pkg-1.0-py3-none-any.whl", "sha256": 7}', "[" * 100_000):  # fmt: skip
        meta.write_text(text)
        found = cache.check_wheel(key)
        assert isinstance(found, str) and "unreadable wheel cache entry" in found, (text[:20], found)
        assert meta.is_file()  # checking discards nothing
    meta.write_text(good)
    entry.path.unlink()
    found = cache.check_wheel(key)
    assert isinstance(found, str) and "is gone" in found
    assert cache.get_wheel(key) is None and not cache.wheel_dir(key).exists()  # the build discards it


def test_the_forecast_runs_the_predicted_units_and_takes_the_serial_part_from_the_last_build(tmp_path: Path) -> None:
    from tasks.lock.lockfile import Package

    history.record_build(tmp_path, "te", key="k" * 64, wall_s=100.0, wait_s=0.0, compile_s=None, slots=2)
    history.record_times(tmp_path, "te", {"a.o": 40.0, "b.o": 40.0})
    pkg = Package(name="te", source="te")
    # Its last build: two units of 40 s on two slots, 40 s of them; 60 s were the rest (pip, the link).
    predicted = UnitForecast(next=(("a.o", 40.0, "a.o"), ("b.o", 0.05, "")), last=(("a.o", 40.0), ("b.o", 40.0)))
    work, origin, _ = package_work(tmp_path, tmp_path / "patches", pkg, slots=2, predicted=predicted)
    assert origin == "cache" and work.serial_s == 60.0
    assert [(u.name, u.seconds) for u in work.units] == [("a.o", 40.0), ("b.o", 0.05)]
    assert simulate([work], slots=2).wall_s == 100.0
    alone = simulate([PackageWork("te", work.units[1:], serial_s=60.0)], slots=2).wall_s
    assert alone == pytest.approx(60.05)


def test_a_compiler_named_through_the_masquerade_is_the_real_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ccache's masquerade (a run's ccache-bin-PID/nvcc, PYTORCH_NVCC) is keyed as the nvcc it runs: found by name
    on PATH outside it, also once the run has removed it."""
    real = tmp_path / "cuda" / "bin"
    real.mkdir(parents=True)
    (real / "nvcc").write_text("#!/bin/sh\n")
    (real / "nvcc").chmod(0o755)
    masquerade = tmp_path / "objcache" / "ccache-bin-4242"
    masquerade.mkdir(parents=True)
    (masquerade / "nvcc").symlink_to("/usr/bin/true")
    monkeypatch.setenv("PATH", f"{masquerade}:{real}:/usr/bin")
    assert units.real_compiler(str(masquerade / "nvcc")) == str(real / "nvcc")
    (masquerade / "nvcc").unlink()
    masquerade.rmdir()  # the run ended
    assert units.real_compiler(str(masquerade / "nvcc")) == str(real / "nvcc")
    assert units.real_compiler(str(real / "nvcc")) == str(real / "nvcc")  # a compiler of its own stays
    assert units.real_compiler("") == ""
