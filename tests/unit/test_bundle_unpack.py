"""Unbundling checks every member before writing and each file's bytes while streaming (tasks/image/bundle.py)."""

from __future__ import annotations

import ast
import hashlib
import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tasks.core.errors import BundleError
from tasks.core.treehash import file_sha256
from tasks.image import bundle
from tasks.outside import unbundle


def _bundle(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "manifest.json").write_text("{}\n")
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    out, _digest = bundle.write_bundle(tmp_path / "b.tar", wheels=wheels, info={"lock_sha256": "x", "profile": "p"})
    out.with_name(out.name + ".sha256").unlink()  # as if carried without it: the members are all there is
    return out


def _rewrite(src: Path, dest: Path, extra: tarfile.TarInfo, data: bytes = b"") -> Path:
    """``src`` with ``extra`` inserted before its last member (SHA256SUMS)."""
    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.GNU_FORMAT) as tout:
        infos = tin.getmembers()
        for info in infos[:-1]:
            tout.addfile(info, tin.extractfile(info) if info.isreg() else None)
        tout.addfile(extra, io.BytesIO(data) if data else None)
        tout.addfile(infos[-1], tin.extractfile(infos[-1]))
    return dest


def test_good_bundle_unpacks(tmp_path: Path) -> None:
    doc = bundle.unpack(_bundle(tmp_path), tmp_path / "dest")
    assert doc["verified_files"] == 4  # manifest.json, the wheel, BUNDLE.json, unbundle.py
    assert (tmp_path / "dest" / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"


def test_symlink_member_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = tarfile.TarInfo(f"{bundle.TOP}/wheels/evil")
    link.type, link.linkname = tarfile.SYMTYPE, str(outside)
    bad = _rewrite(_bundle(tmp_path), tmp_path / "bad.tar", link)
    with pytest.raises(BundleError, match="a symbolic link; only files and directories"):
        bundle.unpack(bad, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() and not list(outside.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dest.")]


def test_changed_bytes_stop_the_unpacking(tmp_path: Path) -> None:
    good = _bundle(tmp_path)
    with tarfile.open(good) as tin, tarfile.open(tmp_path / "bad.tar", "w", format=tarfile.GNU_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]
            if info.name.endswith(".whl"):
                data = b"WHEEL BYTES"  # same size, other bytes
            tout.addfile(info, io.BytesIO(data) if data is not None else None)
    with pytest.raises(BundleError, match=r"sha256 differs: wheels/a-1\.0-py3-none-any\.whl"):
        bundle.unpack(tmp_path / "bad.tar", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_sums_inside_the_bundle_do_not_protect_it_only_its_sha256_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle whose file and SHA256SUMS were both rewritten passes its own sums: without its `.sha256` it is
    unpacked with a warning giving its digest; with the `.sha256` of the original it is refused."""
    good = _bundle(tmp_path)
    original = file_sha256(good)
    evil = tmp_path / "evil.tar"
    with tarfile.open(good) as tin, tarfile.open(evil, "w", format=tarfile.GNU_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]
            if info.name.endswith(".whl"):
                data = b"something else"
            elif info.name.endswith(f"/{bundle.SUMS}"):
                digest = hashlib.sha256(b"something else").hexdigest()
                lines = [f"{digest}  {rel}" if rel.endswith(".whl") else line
                         for line in data.decode().splitlines() for rel in [line.split("  ", 1)[1]]]  # fmt: skip
                data = ("\n".join(lines) + "\n").encode()
            if data is not None:
                info.size = len(data)
            tout.addfile(info, io.BytesIO(data) if data is not None else None)
    bundle.unpack(evil, tmp_path / "dest")
    assert (tmp_path / "dest" / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"something else"
    err = capsys.readouterr().err
    warning = (
        f"WARNING: no evil.tar.sha256 beside {evil}: its files are checked only against the SHA256SUMS it carries, "
        f"which whoever altered it could have rewritten. Its sha256 is {file_sha256(evil)}"
    )
    assert warning in err, err
    (tmp_path / "evil.tar.sha256").write_text(f"{original}  b.tar\n")  # the digest `doit bundle` gave, out of band
    with pytest.raises(BundleError, match=f"differs from evil.tar.sha256 \\({original}\\); refusing it"):
        bundle.unpack(evil, tmp_path / "dest2")
    assert not (tmp_path / "dest2").exists()


UNPACKER = Path(unbundle.__file__)


def test_the_unpacker_imports_only_the_standard_library_and_parses_as_python_3_8() -> None:
    """It runs on the air-gapped host: python3 (3.8 or newer) and nothing installed (tasks/outside/unbundle.py)."""
    tree = ast.parse(UNPACKER.read_text(), feature_version=(3, 8))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, ast.dump(node)
            imported.add(node.module.split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - sys.stdlib_module_names


def _instruction_argv(python: str, bundle_file: Path, dest: Path) -> list[str]:
    """The printed instruction (tasks/bundle_unpack.instruction) as argv, run with ``python``."""
    words = shlex.split(unbundle.instruction(str(bundle_file), str(dest)))
    assert words[0] == "python3" and words[1] == "-c", words
    return [python, *words[1:]]


def _stdlib_only_run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C.UTF-8"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_bundle_carries_its_unpacker_and_the_printed_instruction_works_with_python_alone(tmp_path: Path) -> None:
    """The instruction `doit bundle` prints, run by an interpreter that sees only the standard library
    (``-I -S``: no site-packages, no checkout on its path, from a directory holding only the bundle)."""
    (tmp_path / "here").mkdir()
    made = _bundle(tmp_path / "here")
    site = tmp_path / "airgap"
    site.mkdir()
    carried = site / made.name
    carried.write_bytes(made.read_bytes())
    with tarfile.open(carried) as tar:
        assert tar.extractfile(f"{bundle.TOP}/{unbundle.NAME}").read() == UNPACKER.read_bytes()  # type: ignore[union-attr]
    argv = _instruction_argv(sys.executable, Path(made.name), Path("stack"))
    res = _stdlib_only_run([argv[0], "-I", "-S", *argv[1:]], site)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified 4 files" in res.stdout and "WARNING: no b.tar.sha256" in res.stderr, res.stdout + res.stderr
    assert (site / "stack" / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"

    # Altered: refused with BundleError's exit status, nothing written.
    with tarfile.open(carried) as tin, tarfile.open(site / "bad.tar", "w", format=tarfile.GNU_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]
            if info.name.endswith(".whl"):
                data = b"WHEEL BYTES"
            tout.addfile(info, io.BytesIO(data) if data is not None else None)
    res = _stdlib_only_run([sys.executable, "-I", "-S", *_instruction_argv("", Path("bad.tar"), Path("x"))[1:]], site)
    assert res.returncode == BundleError.exit_code == unbundle.REFUSED, res.stdout + res.stderr
    assert "sha256 differs: wheels/a-1.0-py3-none-any.whl" in res.stderr and not (site / "x").exists()


def test_the_unpacker_runs_on_python_3_8(tmp_path: Path) -> None:
    """The oldest python3 the air-gapped host may have, where one is installed here (pyenv, deadsnakes)."""
    candidates = [shutil.which("python3.8"), *map(str, sorted(Path.home().glob(".pyenv/versions/3.8*/bin/python3.8")))]
    working = [p for p in candidates if p and subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0]
    if not working:
        pytest.skip("no python3.8 here (PATH, pyenv) to run the unpacker with")
    python38 = working[0]
    made = _bundle(tmp_path)
    res = _stdlib_only_run([python38, "-I", "-S", *_instruction_argv("", made, tmp_path / "stack")[1:]], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "stack" / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"
