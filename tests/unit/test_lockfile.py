"""Lock validation: every problem at once, each naming file, entry and fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.core.errors import LockError
from tasks.lock.lockfile import WheelPin, arch_env, expand_env, load_lock, parse_lock

SHA1 = "a" * 40
SHA256 = "b" * 64


def good_doc() -> dict[str, Any]:
    return {
        "format": 1,
        "toolchain": {"python": ">=3.11", "torch": ">=2.4", "cuda": ">=12.8", "archs": ["sm_90a"]},
        "sources": {
            "repo": {
                "kind": "git",
                "url": "https://example.invalid/r.git",
                "commit": SHA1,
                "tree_sha256": SHA256,
                "submodules": {"third_party/x": {"url": "https://example.invalid/x.git", "commit": SHA1}},
            },
            "arch": {"kind": "url", "url": "https://example.invalid/a.tar", "sha256": SHA256, "tree_sha256": SHA256},
            "sdist": {
                "kind": "pypi",
                "project": "flash-attn",
                "version": "2.7.4.post1",
                "filename": "flash_attn-2.7.4.post1.tar.gz",
                "sha256": SHA256,
                "tree_sha256": SHA256,
            },
        },
        "packages": {
            "fa3": {
                "source": "repo",
                "subdir": "hopper",
                "env": {"ARCHS": "{torch_arch_list}"},
                "build_requires": ["setuptools>=61"],
                "cuda": True,
            },
            "fa2": {"source": "sdist"},
        },
        "profiles": {"minimal": {"packages": {"fa3": {"env": {"FLASH_ATTENTION_DISABLE_FP8": "TRUE"}}}}},
    }


def parse(doc: dict[str, Any], **kw: Any) -> Any:
    return parse_lock(doc, path=Path("sources.lock"), check_files=False, **kw)


def test_good_lock_parses_into_frozen_dataclasses() -> None:
    lock = parse(good_doc())
    assert lock.sources["repo"].submodules[0].path == "third_party/x"
    assert lock.packages["fa3"].subdir == "hopper"
    with pytest.raises(AttributeError):
        lock.packages["fa3"].subdir = "x"  # type: ignore[misc]


def test_every_problem_is_reported_at_once_with_suggestions() -> None:
    doc = good_doc()
    doc["sources"]["repo"]["comit"] = SHA1
    doc["sources"]["arch"]["sha256"] = "XYZ"
    doc["packages"]["fa3"]["patchs"] = []
    del doc["packages"]["fa2"]["source"]
    with pytest.raises(LockError) as err:
        parse(doc)
    msg = str(err.value)
    assert "4 problems" in msg
    assert "[sources.repo] unknown key 'comit' (perhaps you meant 'commit'?)" in msg
    assert "[sources.arch] sha256 must be a 64-character lowercase hex sha256, got 'XYZ'" in msg
    assert "[packages.fa3] unknown key 'patchs' (perhaps you meant 'patches'?)" in msg
    assert "[packages.fa2] missing required key 'source'" in msg
    assert all(line.strip().startswith("- sources.lock: [") for line in msg.splitlines()[1:])


def test_short_commit_and_bad_arch_and_unknown_references() -> None:
    doc = good_doc()
    doc["sources"]["repo"]["commit"] = "3cd6870"
    doc["toolchain"]["archs"] = ["sm90a"]
    doc["packages"]["fa3"]["source"] = "rep"
    doc["packages"]["fa3"]["env"] = {"X": "{torch_arch}"}
    doc["profiles"]["minimal"]["packages"]["fa33"] = {}
    with pytest.raises(LockError) as err:
        parse(doc)
    msg = str(err.value)
    assert "full 40-character lowercase hex commit, got '3cd6870'" in msg
    assert "invalid architectures ['sm90a']" in msg
    assert "source 'rep' is not defined under [sources] (perhaps you meant 'repo'?)" in msg
    assert "unknown placeholder {torch_arch} (perhaps you meant 'torch_arch_list'?)" in msg
    assert "[profiles.minimal.packages.fa33] overrides unknown package 'fa33' (perhaps you meant 'fa3'?)" in msg


def test_archs_are_required_only_where_a_package_needs_them() -> None:
    """A lock of pure-Python or C++ packages names no GPU: no [toolchain] archs (and no [toolchain]) needed.
    A CUDA package (cuda = true) or an arch placeholder in a package's env still needs them."""
    doc = good_doc()
    del doc["toolchain"]["archs"]
    with pytest.raises(LockError, match=r"\[toolchain\] archs is required: fa3 compile CUDA"):
        parse(doc)
    del doc["packages"]["fa3"]["cuda"]  # its env still says {torch_arch_list}
    with pytest.raises(LockError, match=r"archs is required: fa3"):
        parse(doc)
    del doc["packages"]["fa3"], doc["profiles"]
    lock = parse(doc)
    assert lock.toolchain.archs == () and set(lock.packages) == {"fa2"}
    del doc["toolchain"]
    assert parse(doc).toolchain.archs == ()
    assert parse({"format": 1, "sources": {}, "packages": {}}).packages == {}


def test_missing_pins_are_errors_except_while_locking() -> None:
    doc = good_doc()
    del doc["sources"]["repo"]["commit"]
    doc["sources"]["repo"]["ref"] = "v1"
    del doc["sources"]["arch"]["tree_sha256"]
    with pytest.raises(LockError, match="run `doit lock` to resolve ref 'v1'"):
        parse(doc)
    lock = parse(doc, require_pins=False)
    assert len(lock.unpinned) == 2


def test_profile_overrides_merge_env_and_unknown_profile_is_an_error() -> None:
    lock = parse(good_doc())
    base = {p.name: p for p in lock.resolve("default")}
    minimal = {p.name: p for p in lock.resolve("minimal")}
    assert dict(base["fa3"].env) == {"ARCHS": "{torch_arch_list}"}
    assert dict(minimal["fa3"].env) == {"ARCHS": "{torch_arch_list}", "FLASH_ATTENTION_DISABLE_FP8": "TRUE"}
    with pytest.raises(LockError, match="unknown profile 'minimla' \\(perhaps you meant 'minimal'\\?\\)"):
        lock.resolve("minimla")


def test_profile_can_disable_a_package() -> None:
    doc = good_doc()
    doc["profiles"]["minimal"]["packages"]["fa2"] = {"enabled": False}
    assert [p.name for p in parse(doc).resolve("minimal")] == ["fa3"]


def test_missing_patch_file_is_reported(tmp_path: Path) -> None:
    doc = good_doc()
    doc["packages"]["fa3"]["patches"] = ["0001-fix.patch"]
    with pytest.raises(LockError, match=r"patch '0001-fix\.patch' not found"):
        parse_lock(doc, path=tmp_path / "sources.lock")
    (tmp_path / "patches" / "fa3").mkdir(parents=True)
    (tmp_path / "patches" / "fa3" / "0001-fix.patch").write_text("")
    assert parse_lock(doc, path=tmp_path / "sources.lock").packages["fa3"].patches == ("0001-fix.patch",)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.lock"
    bad.write_text("format = = 1\n")
    with pytest.raises(LockError, match="not valid TOML"):
        load_lock(bad)
    with pytest.raises(LockError, match="lock file not found"):
        load_lock(tmp_path / "nope.lock")


def test_arch_spellings() -> None:
    env = arch_env(("sm_80", "sm_90a"))
    assert env["torch_arch_list"] == "8.0;9.0a"
    assert env["cmake_archs"] == "80;90a"
    assert env["cuda_gencode"] == "-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
    assert expand_env({"A": "x{cmake_archs}y"}, env) == {"A": "x80;90ay"}


def test_top_level_lock_validates() -> None:
    root = Path(__file__).resolve().parents[2]
    lock = load_lock(root / "sources.lock")
    assert {"transformer_engine", "flash_attn_3", "flash_attn", "apex", "grouped_gemm"} <= set(lock.packages)
    assert lock.toolchain.archs == ("sm_90a",)


def test_licenses_are_spdx_ids_or_expressions() -> None:
    doc = good_doc()
    doc["sources"]["repo"]["license"] = "Apache-2.0"
    doc["sources"]["repo"]["submodules"]["third_party/x"]["license"] = "MIT"
    doc["sources"]["sdist"]["license"] = "BSD-3-Clause AND MIT"
    lock = parse(doc)
    assert lock.sources["repo"].license == "Apache-2.0"
    assert lock.sources["repo"].submodules[0].license == "MIT"
    assert lock.sources["sdist"].license == "BSD-3-Clause AND MIT"
    assert lock.sources["arch"].license == ""  # optional
    doc["sources"]["repo"]["submodules"]["third_party/x"]["license"] = "The MIT License"
    doc["sources"]["sdist"]["license"] = "apache-2.0"
    doc["sources"]["arch"]["license"] = "BSD-3-Clause AND"
    with pytest.raises(LockError) as err:
        parse(doc)
    msg = str(err.value)
    assert "3 problems" in msg
    assert "[sources.sdist] license has 'apache-2.0', not SPDX license ids (perhaps you meant 'Apache-2.0'?)" in msg
    assert "[sources.arch] license is not a valid SPDX license expression: 'BSD-3-Clause AND'" in msg
    assert "[sources.repo.submodules.third_party/x] license has 'The', 'License', not SPDX license ids" in msg


def test_real_and_example_locks_declare_every_license() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in (root / "sources.lock", root / "examples" / "example.lock", root / "examples" / "hermetic.lock"):
        for src in load_lock(path).sources.values():
            assert src.license, f"{path}: source {src.name} has no license"
            assert all(sub.license for sub in src.submodules), f"{path}: a submodule of {src.name} has no license"


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("(MIT OR Apache-2.0) AND BSD-3-Clause", True),
        ("GPL-2.0-only WITH Classpath-exception-2.0", True),
        ("(MIT", False),
        ("MIT)", False),
        ("MIT Apache-2.0", False),
        ("MIT WITH", False),
        ("AND", False),
    ],
)
def test_license_expression_syntax(value: str, ok: bool) -> None:
    doc = good_doc()
    doc["sources"]["arch"]["license"] = value
    if ok:
        assert parse(doc).sources["arch"].license == value
    else:
        with pytest.raises(LockError, match="is not a valid SPDX license expression"):
            parse(doc)


def test_hermetic_toolchain_pins_exact_versions_with_hashes() -> None:
    doc = good_doc()
    other = "c" * 64
    doc["toolchain"]["hermetic"] = {
        "requirements": [
            f"nvidia-cuda-nvcc==13.0.88 --hash=sha256:{SHA256}",
            f"Nvidia_NVVM==13.0.88 --hash=sha256:{other} --hash=sha256:{SHA256}",
        ]
    }
    pins = parse(doc).toolchain.hermetic
    assert [(p.name, p.version, p.hashes) for p in pins] == [
        ("nvidia-cuda-nvcc", "13.0.88", (SHA256,)),
        ("nvidia-nvvm", "13.0.88", (SHA256, other)),
    ]
    assert pins[1].requirement() == f"nvidia-nvvm==13.0.88 --hash=sha256:{SHA256} --hash=sha256:{other}"
    assert parse(good_doc()).toolchain.hermetic == ()  # off unless the lock has the table


def test_hermetic_pin_without_hashes_is_left_for_doit_lock() -> None:
    doc = good_doc()
    doc["toolchain"]["hermetic"] = {"requirements": ["nvidia-cuda-nvcc==13.0.88"]}
    lock = parse(doc, require_pins=False)
    assert lock.toolchain.hermetic == (WheelPin(name="nvidia-cuda-nvcc", version="13.0.88", hashes=()),)
    assert any("run `doit lock` to fill in the sha256 of its wheels" in u for u in lock.unpinned)
    with pytest.raises(LockError, match=r"'nvidia-cuda-nvcc==13.0.88' has no --hash=sha256:\.\.\. \(run `doit lock`"):
        parse(doc)


def test_hermetic_toolchain_problems_are_all_reported() -> None:
    doc = good_doc()
    doc["toolchain"]["hermetic"] = {
        "requirement": [],
    }
    with pytest.raises(LockError) as err:
        parse(doc)
    assert "[toolchain.hermetic] unknown key 'requirement' (perhaps you meant 'requirements'?)" in str(err.value)
    doc["toolchain"]["hermetic"] = {
        "requirements": [
            "nvidia-cuda-nvcc>=13.0",
            f"nvidia-nvvm==13.0.* --hash=sha256:{SHA256}",
            "nvidia-cuda-crt==13.0.88 --hash=sha256:abc",
            f"nvidia-cuda-cccl==13.0.85 --hashes=sha256:{SHA256}",
            f"nvidia-cuda-cccl==13.0.85 --hash=sha256:{SHA256}",
            f"nvidia-cuda-cccl==13.0.86 --hash=sha256:{SHA256}",
            "not a requirement",
        ]
    }
    with pytest.raises(LockError) as err:
        parse(doc)
    msg = str(err.value)
    assert "6 problems" in msg
    assert (
        "'nvidia-cuda-nvcc>=13.0' needs one exact version, 'nvidia-cuda-nvcc==<version>' "
        "(only == pins are hashed and installed); has no --hash" in msg
    )
    assert "'nvidia-nvvm==13.0.* --hash" in msg
    assert "hash 'sha256:abc' must be 'sha256:' and 64 lowercase hex digits" in msg
    assert "has unknown option '--hashes' (perhaps you meant '--hash'?)" in msg
    assert "pins nvidia-cuda-cccl a second time" in msg
    assert "'not a requirement' is not valid" in msg


def test_budget_counts_only_the_packages_named_by_build_targets() -> None:
    from tasks.stages.context import requested_builds

    names = {"grouped_gemm", "flash_attn_3"}
    assert requested_builds(["build:grouped_gemm", "lock=x.lock", "mirror=/m"], names) == {"grouped_gemm"}
    assert requested_builds(["-n", "2", "-f", "dodo.py", "build:grouped_gemm", "build:flash_attn_3"], names) == names
    assert requested_builds(["run", "--verbosity", "2", "build:grouped_gemm"], names) == {"grouped_gemm"}
    # Anything else asks for everything: another task, the whole build group, an unknown package, nothing.
    assert requested_builds(["wheels", "build:grouped_gemm"], names) is None
    assert requested_builds(["build"], names) is None
    assert requested_builds(["build:apex"], names) is None
    assert requested_builds(["lock=x.lock"], names) is None
    assert requested_builds([], names) is None


def test_a_profile_has_its_own_runtime_and_checks_of_the_environment() -> None:
    doc = good_doc()
    doc["runtime"] = {"requirements": ["einops"], "provided": ["torch==2.11.0"], "python": "3.12",
                      "verify": {"imports": ["einops"], "smoke": "torch_env"}}  # fmt: skip
    doc["profiles"]["minimal"]["runtime"] = {"requirements": ["tqdm"], "provided": ["torch"], "python": "3.12"}
    lock = parse(doc, require_pins=False)
    assert lock.runtime_for("default") is lock.runtime
    assert lock.runtime is not None and lock.runtime.verify.imports == ("einops",)
    assert lock.runtime.verify.smoke == "torch_env"
    own = lock.runtime_for("minimal")
    assert own is not None and own.requirements == ("tqdm",) and own.provided == (("torch", ""),)
    # Each section is its own pin: both open, each named where it is.
    assert sorted(w for w in lock.unpinned_where if "runtime" in w) == ["profiles.minimal.runtime", "runtime"]
    assert len(lock.unpinned_for("minimal")) == 1 and "[profiles.minimal.runtime]" in lock.unpinned_for("minimal")[0]
    assert len(lock.unpinned_for("default")) == 1 and "[runtime]" in lock.unpinned_for("default")[0]
    doc["profiles"]["minimal"]["runtime"]["python"] = "3"
    doc["runtime"]["verify"] = {"import": ["x"]}
    with pytest.raises(LockError) as err:
        parse(doc, require_pins=False)
    assert "[profiles.minimal.runtime] python must be the target's CPython as '3.Y'" in str(err.value)
    assert "[runtime.verify] unknown key 'import' (perhaps you meant 'imports'?)" in str(err.value)


def test_open_pins_stop_only_the_profiles_that_need_them() -> None:
    doc = good_doc()
    del doc["sources"]["sdist"]["sha256"]  # fa2's source
    doc["profiles"]["no-fa2"] = {"packages": {"fa2": {"enabled": False}}}
    lock = parse(doc, require_pins=False)
    assert lock.sources_for("default") == ("repo", "sdist")
    assert lock.sources_for("no-fa2") == ("repo",)
    assert len(lock.unpinned_for("default")) == 1 and "[sources.sdist]" in lock.unpinned_for("default")[0]
    assert lock.unpinned_for("no-fa2") == ()


def test_deps_false_on_a_built_package() -> None:
    doc = good_doc()
    doc["packages"]["fa2"]["deps"] = False
    lock = parse(doc)
    assert lock.packages["fa2"].deps is False and lock.packages["fa3"].deps is True


@pytest.mark.parametrize("patch", ["../../../tmp/x.patch", "../../../etc/passwd", "/etc/passwd", "a/../../x.patch", ""])
def test_a_patch_path_out_of_its_folder_is_refused_like_a_source_patch_path(tmp_path: Path, patch: str) -> None:
    """A plain patch entry stays in patches/<package>/, as a { source, path } entry stays in its source (issue 26)."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "x.patch").write_text("")
    doc = good_doc()
    doc["packages"]["fa3"]["patches"] = [patch]
    for check_files in (True, False):
        with pytest.raises(LockError) as err:
            parse_lock(doc, path=tmp_path / "a" / "b" / "sources.lock", check_files=check_files)
        assert str(err.value).endswith(
            f"[packages.fa3] patch {patch!r} must be a path inside patches/fa3/ (relative, without '..'), as a "
            "{ source, path } patch's must be inside its source"
        )
    doc["packages"]["fa3"]["patches"] = [{"source": "repo", "path": patch}]
    with pytest.raises(LockError, match=r"must be relative and inside its source"):
        parse(doc)


def test_a_patch_that_is_a_link_out_of_its_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "patches" / "fa3"
    folder.mkdir(parents=True)
    (tmp_path / "secret").write_text("host file\n")
    (folder / "0001-fix.patch").symlink_to(tmp_path / "secret")
    (folder / "real.patch").write_text("")
    (folder / "0002-alias.patch").symlink_to("real.patch")  # a link inside the folder is a patch of the folder
    doc = good_doc()
    doc["packages"]["fa3"]["patches"] = ["0002-alias.patch", "0001-fix.patch"]
    with pytest.raises(LockError) as err:
        parse_lock(doc, path=tmp_path / "sources.lock")
    assert str(err.value).splitlines()[1:] == [
        f"  - {tmp_path / 'sources.lock'}: [packages.fa3] patch '0001-fix.patch' at {folder / '0001-fix.patch'} is a "
        f"symbolic link out of {folder}, to {tmp_path / 'secret'}; a patch lies in its package's folder (copy it there)"
    ]
    doc["packages"]["fa3"]["patches"] = ["0002-alias.patch"]
    assert parse_lock(doc, path=tmp_path / "sources.lock").packages["fa3"].patches == ("0002-alias.patch",)


@pytest.mark.parametrize(
    "value",
    ["[" * 50_000 + "]" * 50_000, "[" * 600 + "]" * 600, "{a = " * 50_000 + "1" + "}" * 50_000],
    ids=["arrays-50000", "arrays-600", "tables-50000"],
)
def test_a_value_nested_too_deeply_is_one_lock_error(tmp_path: Path, value: str) -> None:
    """tomllib recurses once per level: 50 000 nested arrays were a RecursionError traceback (issue 26)."""
    lock = tmp_path / "sources.lock"
    lock.write_text(f'format = 1\n[packages.fa3]\nsource = "repo"\npip_args = {value}\n')
    with pytest.raises(LockError) as err:
        load_lock(lock)
    assert str(err.value) == f"{lock}: not a lock this tool reads: a value is nested too deeply"


def test_one_sha256_under_two_pins_is_refused(tmp_path: Path) -> None:
    """A closure pin repointed at another pin's wheel (issue 26): one file cannot be two projects' wheels."""
    doc = good_doc()
    doc["runtime"] = {"python": "3.11", "resolved": [f"repro-round==0.1.0 --hash=sha256:{SHA256}",
                                                      f"repro-colors==1.1.0 --hash=sha256:{SHA256}"]}  # fmt: skip
    with pytest.raises(LockError) as err:
        parse(doc, require_pins=False)
    assert (
        f"[runtime.resolved] repro-round==0.1.0 has the sha256 {SHA256[:12]}… of the pin of repro-colors (one file "
        "is one wheel): re-pin with `doit lock update=runtime`" in str(err.value)
    )


def test_a_package_building_against_torch_pins_it_unless_the_lock_says_why_not() -> None:
    doc = good_doc()
    doc["packages"]["fa3"]["build_requires"] = ["setuptools>=61", "torch"]
    lock = parse(doc)
    assert lock.packages["fa3"].pins_torch and not lock.packages["fa2"].pins_torch  # fa2 does not build against torch
    doc["packages"]["fa3"]["torch_unpinned"] = "loads libtorch through its own stable C ABI"
    assert not parse(doc).packages["fa3"].pins_torch
    doc["packages"]["fa3"]["torch_unpinned"] = "ok"
    doc["packages"]["fa2"]["torch_unpinned"] = "no torch here, but say it anyway"
    with pytest.raises(LockError) as err:
        parse(doc)
    text = str(err.value)
    doc["packages"]["fa2"]["torch_unpined"] = "x"
    with pytest.raises(LockError) as err:
        parse(doc)
    text += str(err.value)
    assert "[packages.fa3] torch_unpinned must say why the wheel may go beside another torch" in text
    assert "[packages.fa2] torch_unpinned applies only to a package whose build_requires name torch" in text
    assert "unknown key 'torch_unpined' (perhaps you meant 'torch_unpinned'?)" in text


def test_a_runtime_without_python_or_requirements_is_left_for_doit_lock() -> None:
    """[runtime] python is written by `doit lock` where missing; a section without requirements is resolved too
    (the wheels' requirements), and base_python names the base's interpreter."""
    doc = good_doc()
    doc["runtime"] = {"requirements": [], "base_python": "python3"}
    with pytest.raises(LockError):
        parse(doc)
    lock = parse(doc, require_pins=False)
    assert lock.runtime is not None and lock.runtime.base_python == "python3"
    assert any("python (the target's CPython) is not set yet" in u for u in lock.unpinned)
    doc["runtime"]["python"] = "3.12"
    assert any("the closure is not resolved" in u for u in parse(doc, require_pins=False).unpinned)
    doc["runtime"]["resolved_from"] = parse(doc, require_pins=False).runtime.digest()
    assert parse(doc).runtime.resolved == ()


def test_a_build_closure_answers_only_for_the_build_requires_it_was_resolved_from() -> None:
    from tasks.lock.lockfile import build_digest

    doc = good_doc()
    lock = parse(doc)
    fa3 = lock.packages["fa3"]
    pin = f"setuptools==80.10.2 --hash=sha256:{SHA256}"
    doc["build"] = {"fa3": {"resolved": [pin, f"pip==26.3 --hash=sha256:{'c' * 64}"],
                            "resolved_from": build_digest(fa3, lock.toolchain.python)}}  # fmt: skip
    closure = parse(doc).build_closure(fa3)
    assert closure is not None and [p.name for p in closure.resolved] == ["pip", "setuptools"]
    assert parse(doc).build_closure(lock.packages["fa2"]) is None  # none resolved for it
    doc["packages"]["fa3"]["build_requires"] = ["setuptools>=70"]  # edited since: refused until `doit lock`
    edited = parse(doc)
    assert edited.build_closure(edited.packages["fa3"]) is None
    doc["toolchain"]["python"] = ">=3.12"  # another Python range is another resolution
    doc["packages"]["fa3"]["build_requires"] = ["setuptools>=61"]
    other = parse(doc)
    assert other.build_closure(other.packages["fa3"]) is None


def test_build_closure_problems_are_lock_errors() -> None:
    doc = good_doc()
    doc["build"] = {
        "fa4": {"resolved": [], "resolved_from": SHA256},
        "fa3": {"resolved": ["setuptools>=61"], "resolved_from": SHA256, "extra": 1},
    }
    with pytest.raises(LockError) as err:
        parse(doc)
    text = str(err.value)
    assert "[build.fa4] names no package of the lock" in text
    assert "[build.fa3]" in text and "extra" in text
    doc["build"] = {"fa3": {"resolved": ["setuptools>=61"], "resolved_from": SHA256}}
    with pytest.raises(LockError, match=r"needs one exact version"):
        parse(doc)
