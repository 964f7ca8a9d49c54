"""Hostile inputs and faults (issues 20 and 26), each as it happens: archives and git repositories served on
loopback, a server that stops sending, real signals to a real build, a full disk, a second run.

Every test here fails without the check it covers.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PURE_PROFILE, REPO, Workspace, make_workspace, small_tmpfs
from make_fixtures import write_wheel
from serve import FixtureServer

from tasks.core.treehash import file_sha256
from tasks.store.remote import history_key

pytestmark = pytest.mark.integration

ZERO = "0" * 64


def tiny_lock(root: Path, source: str) -> Path:
    """A lock of one source and one package; ``source`` is the [sources.evil] table's body."""
    lock = root / "evil.lock"
    root.mkdir(parents=True, exist_ok=True)
    lock.write_text(
        'format = 1\n[toolchain]\npython = ">=3.10"\narchs = ["sm_90a"]\n'
        f"[sources.evil]\n{source}\n"
        '[packages.evil]\nsource = "evil"\nbuild_requires = ["setuptools>=61"]\n'
    )
    return lock


def doit(
    root: Path, lock: Path, cache: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    return subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "-d", str(root), *args,
         f"lock={lock}", f"cache={cache}"],
        env={**base, "PIP_CONFIG_FILE": os.devnull, **(env or {})},
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def test_url_archive_that_writes_outside_is_refused_by_fetch_and_lock(tmp_path: Path) -> None:
    """A tar whose symlink leads outside, then a file through it: refused before anything is written,
    with the right sha256 pinned (`doit fetch`) and unpinned (`doit lock`)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    served = tmp_path / "served"
    served.mkdir()
    archive = served / "evil-1.0.tar"
    with tarfile.open(archive, "w") as tar:
        for name, kind, target, body in [
            ("evil-1.0/", tarfile.DIRTYPE, "", b""),
            ("evil-1.0/esc", tarfile.SYMTYPE, "../" * 12 + str(outside).lstrip("/"), b""),
            ("evil-1.0/esc/planted", tarfile.REGTYPE, "", b"planted"),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, target, len(body)
            tar.addfile(info, io.BytesIO(body) if body else None)
    with FixtureServer(served) as srv:
        url = f"{srv.url}/{archive.name}"
        ws = tmp_path / "ws"
        lock = tiny_lock(ws, f'kind = "url"\nurl = "{url}"\nsha256 = "{file_sha256(archive)}"\ntree_sha256 = "{ZERO}"')
        res = doit(ws, lock, tmp_path / "cache", "fetch:evil")
        assert res.returncode == 13, res.stdout + res.stderr  # VerificationError
        assert "refused, nothing of it was used" in res.stderr and "outside the tree" in res.stderr
        assert "Traceback" not in res.stderr
        before = tiny_lock(ws, f'kind = "url"\nurl = "{url}"').read_text()
        res = doit(ws, lock, tmp_path / "cache", "lock")
        assert res.returncode == 13, res.stdout + res.stderr
        assert lock.read_text() == before
    assert not list(outside.iterdir())


def test_git_symlink_to_a_host_file_is_refused(tmp_path: Path) -> None:
    """A repository whose file is a link to an absolute host path cannot put that file into a wheel."""
    served = tmp_path / "served"
    commit = git_commit(tmp_path / "evil", {"secret.txt": "/etc/hostname"})
    serve_bare(tmp_path / "evil", served)
    with FixtureServer(served) as srv:
        res = fetch_git(tmp_path, f"{srv.url}/evil.git", commit)
    assert res.returncode == 13, res.stdout + res.stderr
    assert "'secret.txt': symbolic link to '/etc/hostname', outside the tree" in res.stderr


def fetch_git(tmp_path: Path, url: str, commit: str, more: str = "") -> subprocess.CompletedProcess[str]:
    """`doit fetch:evil` of a lock whose one source is ``url`` at ``commit`` (``more``: more TOML for it)."""
    lock = tiny_lock(
        tmp_path / "ws", f'kind = "git"\nurl = "{url}"\ncommit = "{commit}"\ntree_sha256 = "{ZERO}"\n{more}'
    )
    return doit(tmp_path / "ws", lock, tmp_path / "cache", "fetch:evil")


GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


def git_commit(work: Path, links: dict[str, str], gitlinks: dict[str, str] | None = None) -> str:
    """A repository at ``work`` with a setup.py, the symbolic links ``links`` and submodule entries; its commit."""
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    (work / "setup.py").write_text("from setuptools import setup\nsetup(name='evil')\n")
    for name, target in links.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).symlink_to(target)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True, env=env)
    for path, commit in (gitlinks or {}).items():
        subprocess.run(["git", "-C", str(work), "update-index", "--add", "--cacheinfo", f"160000,{commit},{path}"],
                       check=True, env=env)  # fmt: skip
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "x"], check=True, env=env)
    return subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def serve_bare(work: Path, served: Path) -> None:
    """``work`` as ``served/<name>.git``, for git's dumb HTTP protocol."""
    bare = served / f"{work.name}.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True, env={**os.environ, **GIT_ENV})
    subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True, env={**os.environ, **GIT_ENV})


#: Normalises inside the tree, but each `deep/l` (a link to `..`) leads back to the top: the 30 `..` leave it.
CHAIN = "deep/l/" * 15 + "../" * 30 + "etc/hostname"


def test_git_link_chain_out_of_the_tree_is_refused(tmp_path: Path) -> None:
    """A link that climbs out through the tree's own links is refused, also when the chain spans a submodule."""
    served = tmp_path / "served"
    plain = git_commit(tmp_path / "plain", {"deep/l": "..", "secret.txt": CHAIN})
    serve_bare(tmp_path / "plain", served)
    # The submodule's link alone stays inside; it leaves only through the superproject's `deep/l`.
    sub = git_commit(tmp_path / "sub", {"secret.txt": "../" + CHAIN})
    serve_bare(tmp_path / "sub", served)
    sup = git_commit(tmp_path / "super", {"deep/l": ".."}, {"vendor": sub})
    serve_bare(tmp_path / "super", served)
    with FixtureServer(served) as srv:
        res = fetch_git(tmp_path, f"{srv.url}/plain.git", plain)
        assert res.returncode == 13, res.stdout + res.stderr
        assert "refused, nothing of it was used: member 'secret.txt': symbolic link to 'deep/l/deep/l/" in res.stderr
        assert "outside the tree once the tree's own symbolic links are followed" in res.stderr
        vendor = f'[sources.evil.submodules.vendor]\nurl = "{srv.url}/sub.git"\ncommit = "{sub}"'
        res = fetch_git(tmp_path, f"{srv.url}/super.git", sup, vendor)
        assert res.returncode == 13, res.stdout + res.stderr
        assert "member 'vendor/secret.txt': symbolic link to '../deep/l/" in res.stderr, res.stderr
    assert not (tmp_path / "cache" / "sources").exists() or not list((tmp_path / "cache" / "sources").iterdir())


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server on loopback that accepts connections and never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_git_server_that_stops_sending_fails_in_bounded_time(tmp_path: Path, silent_server: int) -> None:
    ws = tmp_path / "ws"
    lock = tiny_lock(ws, f'kind = "git"\nurl = "http://127.0.0.1:{silent_server}/x.git"\ncommit = "{"a" * 40}"\n'
                     f'tree_sha256 = "{ZERO}"')  # fmt: skip
    started = time.monotonic()
    res = doit(ws, lock, tmp_path / "cache", "fetch:evil", env={"REPRO_NET_TIMEOUT": "3"})
    took = time.monotonic() - started
    assert res.returncode == 12, res.stdout + res.stderr  # FetchError
    assert "the server stopped sending: no data for 3 s (REPRO_NET_TIMEOUT)" in res.stderr, res.stderr
    assert took < 120


@pytest.mark.parametrize("scheme", ["git", "ssh"])
def test_git_and_ssh_servers_that_stop_sending_fail_in_bounded_time(
    tmp_path: Path, silent_server: int, scheme: str
) -> None:
    """git:// and ssh:// have no low-speed limit of curl's: a server that accepts and never sends is cut off
    after REPRO_NET_TIMEOUT seconds without a byte read, and the error names the limit."""
    env = {"REPRO_NET_TIMEOUT": "3"}
    if scheme == "ssh":
        if not shutil.which("ssh"):
            pytest.skip("no ssh client here (git:// covers the same bound)")
        env["GIT_SSH_COMMAND"] = "ssh -F /dev/null -o BatchMode=yes"  # nothing of the user's ssh settings
    ws = tmp_path / "ws"
    url = f"{scheme}://127.0.0.1:{silent_server}/x.git"
    lock = tiny_lock(ws, f'kind = "git"\nurl = "{url}"\ncommit = "{"a" * 40}"\ntree_sha256 = "{ZERO}"')
    started = time.monotonic()
    res = doit(ws, lock, tmp_path / "cache", "fetch:evil", env=env, timeout=90)
    took = time.monotonic() - started
    assert res.returncode == 12, res.stdout + res.stderr  # FetchError
    assert f"git fetch {url}: the server stopped sending: no data for 3 s (REPRO_NET_TIMEOUT)" in res.stderr
    assert "Traceback" not in res.stderr
    assert took < 60, took


def test_changed_byte_in_the_cached_source_is_not_built(workspace: Workspace) -> None:
    """One byte changed in a cached source tree: the next build refetches it instead of building it."""
    ws = workspace
    ws.doit("build:repro_pure")
    (meta,) = [
        p
        for p in (ws.cache / "sources").glob("*/meta.json")
        if json.loads(p.read_text())["source"]["name"] == "repro-pure"
    ]
    victim = next(p for p in (meta.parent / "tree").rglob("*.py"))
    os.chmod(victim, 0o644)
    victim.write_text(victim.read_text() + "# changed\n")
    for entry in (ws.cache / "wheels").glob("*/*"):
        subprocess.run(["rm", "-rf", str(entry)], check=True)
    res = ws.doit("build:repro_pure")
    assert "discarded, fetching it again" in res.stderr, res.stdout + res.stderr
    assert "# changed" not in victim.read_text()


def test_duplicate_distributions_are_refused(workspace: Workspace) -> None:
    ws = workspace
    ws.edit_lock(
        "[packages.repro_pybind]",
        '[packages.again]\nsource = "repro-pure"\ndistribution = "repro-pure"\n\n[packages.repro_pybind]',
    )
    res = ws.doit("list", check=False)
    assert res.returncode == 11, res.stderr  # LockError, at load
    assert "[packages.again] builds the distribution 'repro-pure', as packages.repro_pure does" in res.stderr
    ws.edit_lock('[packages.again]\nsource = "repro-pure"\ndistribution = "repro-pure"\n\n', "")
    ws.edit_lock(
        '[packages.repro_pure]\nsource = "repro-pure"\n',
        '[packages.repro_pure]\nsource = "repro-pure"\ndistribution = "other"\n',
    )
    res = ws.doit("wheels", "profile=quick", check=False)
    assert res.returncode == 15, res.stdout + res.stderr  # BuildError, before wheels/ is written
    assert "a wheel of 'repro-pure', not of 'other'" in res.stderr
    assert not (ws.wheels / "manifest.json").exists()


@pytest.mark.needs_torch
def test_second_run_refuses_sighup_stops_sigkill_is_cleaned_up(workspace: Workspace) -> None:
    ws = workspace
    # objcache=off, and no ccache of the user's either (torch's cpp_extension may put one in front of c++)
    ws.env_extra["CCACHE_DISABLE"] = "1"

    def start() -> subprocess.Popen[str]:
        """The build, stopped while its compiler runs (the extension compiles in a few seconds)."""
        proc = ws.popen("build:repro_torchext", "objcache=off")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not compiling():
            time.sleep(0.05)
        assert proc.poll() is None, "the build finished before it could be interrupted"
        return proc

    def leftovers() -> list[int]:
        """Processes of the build: their environment names this workspace's cache (REPRO_WAIT_LOG)."""
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"REPRO_WAIT_LOG={ws.cache}".encode() in environ.read_bytes():
                    found.append(int(environ.parent.name))
            except OSError:
                continue
        return found

    def compiling() -> bool:
        for pid in leftovers():
            try:
                if b"cc1plus" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                continue
        return False

    first = start()
    second = ws.doit("wheels", check=False)  # one run per workspace: refused at once, naming the first
    assert second.returncode == 10, second.stdout + second.stderr
    assert f"is in use by another doit run (pid {first.pid}" in second.stderr
    assert "database is locked" not in second.stderr
    first.send_signal(signal.SIGHUP)  # a closed terminal
    first.communicate(timeout=120)
    assert first.returncode != 0
    time.sleep(1)
    assert not leftovers()
    assert not list((ws.root / "build" / "run").glob("*.json"))

    killed = start()
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert leftovers(), "SIGKILL leaves the build running: the next run must clean it up"
    res = ws.doit("build:repro_pure")
    assert f"cleaned up after an earlier run that ended without cleaning up (pid {killed.pid})" in res.stderr
    time.sleep(1)
    assert not leftovers()
    stage = ws.root / "build" / "stage"
    assert not [p for p in stage.iterdir() if p.name.startswith("repro_torchext")] if stage.exists() else True


def test_full_disk_is_one_clear_line(tmp_path: Path, server: object) -> None:
    """A cache on a full file system: one line naming it, no traceback, nothing partial."""
    with small_tmpfs(tmp_path / "small", "600k") as small:
        ws = make_workspace(tmp_path / "ws", small / "cache", server.url)  # type: ignore[attr-defined]
        res = ws.doit("wheels", "profile=quick", check=False)
        assert res.returncode in (10, 15), res.stdout + res.stderr  # where it struck: the cache, or the build
        assert "No space left on device" in res.stderr and "othing partial was kept" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        for entry in (small / "cache" / "wheels").glob("*/*/entry.json"):  # a wheel built before the disk filled up
            meta = json.loads(entry.read_text())
            assert file_sha256(entry.parent / meta["filename"]) == meta["sha256"], entry
        regular = tmp_path / "afile"
        regular.write_text("x")
        res = make_workspace(tmp_path / "ws2", regular, server.url).doit("wheels", "profile=quick", check=False)  # type: ignore[attr-defined]
        assert res.returncode == 10 and "Traceback" not in res.stderr, res.stderr
        assert "is a file" in res.stderr or "Not a directory" in res.stderr, res.stderr


def pure_only(ws: Workspace) -> None:
    """A profile of the example lock with only its pure-Python package (no compiler needed)."""
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)


def test_verify_names_extra_files_and_says_when_it_restored_a_wheel(workspace: Workspace) -> None:
    ws = workspace
    pure_only(ws)
    ws.doit("wheels", "profile=pure")
    (ws.wheels / "dropped-1.0-py3-none-any.whl").write_bytes(b"not ours")
    res = ws.doit("verify", "profile=pure", "gpu=off", check=False)
    assert res.returncode == 17, res.stdout + res.stderr  # VerifyFailed
    assert "not listed in manifest.json: dropped-1.0-py3-none-any.whl" in res.stdout + res.stderr
    (ws.wheels / "dropped-1.0-py3-none-any.whl").unlink()
    (wheel,) = ws.wheels.glob("repro_pure-*.whl")
    wheel.write_bytes(b"truncated")
    res = ws.doit("verify", "profile=pure", "gpu=off")
    assert f"restored {ws.wheels.relative_to(ws.root) / wheel.name} from the cache" in res.stdout, res.stdout


@pytest.mark.needs_headers  # profile 'two' builds the pybind fixture
def test_remote_record_pointing_at_another_packages_blob_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    """The remote maps a key to a blob; a record for repro_pybind naming repro_pure's (valid) wheel is refused."""
    store = tmp_path / "store"
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "cache_server.py"), str(store), "0"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(server.stdout.readline().split()[-1].rsplit(":", 1)[-1])  # type: ignore[union-attr]
        remote = f"http://127.0.0.1:{port}"
        ws = workspace
        ws.edit_lock("[profiles.quick]", "[profiles.two]\n[profiles.two.packages.repro_cuda]\nenabled = false\n"
                     "[profiles.two.packages.repro_torchext]\nenabled = false\n\n[profiles.quick]")  # fmt: skip
        ws.doit("wheels", "profile=two", f"remote={remote}", "remote_write=on")
        # The wheel records, not the packages' history records beside them under ac/ (doit plan's): a history
        # record last in the directory's order took a package's place here, and the forgery went unused.
        history = {history_key(name) for name in ("repro_pure", "repro_pybind")}
        records = {json.loads(p.read_text())["package"]: p for p in (store / "ac").iterdir() if p.name not in history}
        pure = json.loads(records["repro_pure"].read_text())
        forged = json.loads(records["repro_pybind"].read_text())
        forged.update(filename=pure["filename"], sha256=pure["sha256"], size=pure["size"])
        records["repro_pybind"].write_text(json.dumps(forged))
        fresh = make_workspace(tmp_path / "fresh", tmp_path / "fresh-cache", ws.index_url.rsplit("/simple", 1)[0])
        fresh.lock.write_text(ws.lock.read_text())
        res = fresh.doit("wheels", "profile=two", f"remote={remote}")
        assert (
            "rejected: its wheel repro_pure-" in res.stderr and "is of 'repro-pure', not 'repro-pybind'" in res.stderr
        )
        assert "built repro_pybind in" in res.stdout
    finally:
        server.terminate()
        server.wait()
        server.stdout.close()  # type: ignore[union-attr]


def link_patch(work: Path, name: str, target: str) -> str:
    """The diff git writes for adding ``name``, a symbolic link to ``target`` (`new file mode 120000`)."""
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    (work / name).parent.mkdir(parents=True, exist_ok=True)
    (work / name).symlink_to(target)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True, env=env)
    diff = subprocess.run(["git", "-C", str(work), "diff", "--cached"], check=True, env=env, capture_output=True,
                          text=True).stdout  # fmt: skip
    assert "new file mode 120000" in diff, diff
    return diff


def left_in_build(ws: Workspace, package: str) -> list[str]:
    """What a failed build of ``package`` left under the workspace's build/stage and the cache's wheels."""
    stage = ws.root / "build" / "stage"
    found = [p.name for p in stage.iterdir() if p.name.startswith(package)] if stage.is_dir() else []
    return found + [str(p) for p in (ws.cache / "wheels").glob("*/*")]


def test_a_patch_that_makes_a_link_to_a_host_file_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    """A patch may write a symbolic link anywhere (issue 26): the tree the build compiles is checked after each
    patch, so a host file never enters the wheel under a key that does not cover it."""
    ws = workspace
    pure_only(ws)
    host = tmp_path / "host" / "x.py"
    host.parent.mkdir()
    host.write_text("SECRET = 'host'\n")
    ws.edit_lock('patches = ["0001-patched-message.patch"]',
                 'patches = ["0001-patched-message.patch", "0002-link.patch"]')  # fmt: skip
    for i, target in enumerate([str(host), "../../.."]):
        (ws.root / "patches" / "repro_pure" / "0002-link.patch").write_text(
            link_patch(tmp_path / f"diff{i}", "repro_pure/host.py", target)
        )
        res = ws.doit("wheels", "profile=pure", check=False)
        assert res.returncode == 13, res.stdout + res.stderr  # VerificationError
        assert (
            f"patch 0002-link.patch makes repro_pure/host.py a symbolic link out of the tree: repro_pure/host.py -> "
            f"{target}; refusing to build from it, no patched tree was kept" in res.stderr
        ), res.stderr
        assert "Traceback" not in res.stderr
        assert not left_in_build(ws, "repro_pure")
        assert not (ws.wheels / "manifest.json").exists()
    ws.edit_lock(', "0002-link.patch"]', "]")
    ws.doit("wheels", "profile=pure")  # the next normal run builds


def test_a_patch_from_a_pinned_source_that_makes_a_link_out_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    """The same through a patch taken from a pinned upstream source ({ source, path }, InfiR2's sglang.patch)."""
    ws = workspace
    pure_only(ws)
    recipes = tmp_path / "recipes"
    (recipes / "docker" / "patch").mkdir(parents=True)
    (recipes / "docker" / "patch" / "pure.patch").write_text(link_patch(tmp_path / "diff", "repro_pure/up", "../../.."))
    commit = git_commit(recipes, {})
    served = tmp_path / "served"
    serve_bare(recipes, served)
    with FixtureServer(served) as srv:
        ws.edit_lock("[sources.repro-torchext]", f'[sources.recipes]\nkind = "git"\nurl = "{srv.url}/recipes.git"\n'
                     f'commit = "{commit}"\n\n[sources.repro-torchext]')  # fmt: skip
        ws.edit_lock('patches = ["0001-patched-message.patch"]',
                     'patches = [{ source = "recipes", path = "docker/patch/pure.patch" }]')  # fmt: skip
        ws.doit("lock")  # the recipes source's tree hash
        res = ws.doit("wheels", "profile=pure", check=False)
    assert res.returncode == 13, res.stdout + res.stderr
    assert (
        "patch recipes:docker/patch/pure.patch makes repro_pure/up a symbolic link out of the tree: repro_pure/up -> "
        "../../..; refusing to build from it" in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr
    assert not left_in_build(ws, "repro_pure")


def test_a_closure_pin_repointed_at_another_wheel_is_refused_warm_as_cold(
    workspace: Workspace, published: Path, tmp_path: Path
) -> None:
    """A [runtime] pin names its file by sha256: pointed at another wheel, it is refused at load (another pin's)
    or when its file is taken, from a warm cache as from a cold one (issue 26: the warm cache placed any stored
    file under the pin, so requirements.txt pinned repro-round twice and repro-colors not at all)."""
    ws = workspace
    pure_only(ws)
    sha = dict(re.findall(r'"(repro-[a-z]+)==\S+ --hash=sha256:([0-9a-f]{64})"', ws.lock.read_text()))
    older = file_sha256(published / "packages" / "repro_colors-1.0.0-py3-none-any.whl")
    # An earlier lock pinned repro-colors 1.0.0: the cache holds its wheel.
    ws.edit_lock(
        f"repro-colors==1.1.0 --hash=sha256:{sha['repro-colors']}", f"repro-colors==1.0.0 --hash=sha256:{older}"
    )
    ws.doit("wheels", "profile=pure")
    before = (ws.wheels / "manifest.json").read_bytes()
    # The pin of repro-colors pointed at repro-round's wheel, which the lock pins too: refused at load.
    ws.edit_lock(
        f"repro-colors==1.0.0 --hash=sha256:{older}", f"repro-colors==1.1.0 --hash=sha256:{sha['repro-round']}"
    )
    res = ws.doit("wheels", "profile=pure", check=False)
    assert res.returncode == 11, res.stdout + res.stderr  # LockError
    assert (
        f"[runtime.resolved] repro-round==0.1.0 has the sha256 {sha['repro-round'][:12]}… of the pin of repro-colors "
        "(one file is one wheel)" in res.stderr
    ), res.stderr
    # Pointed at the 1.0.0 wheel the cache holds: refused when its file is taken, nothing placed.
    ws.edit_lock(f"--hash=sha256:{sha['repro-round']}", f"--hash=sha256:{older}")
    for where in (ws, dataclasses.replace(ws, cache=tmp_path / "cold")):
        res = where.doit("wheels", "profile=pure", check=False)
        assert res.returncode == 13, res.stdout + res.stderr  # VerificationError
        assert "Traceback" not in res.stderr
        assert (ws.wheels / "manifest.json").read_bytes() == before
    warm = ws.doit("wheels", "profile=pure", check=False)
    assert (
        f"[runtime] repro-colors==1.1.0: the file of its pinned sha256 {older[:12]}… (cached as "
        "repro_colors-1.0.0-py3-none-any.whl) is not a wheel of repro-colors 1.1.0: its file name "
        "repro_colors-1.0.0-py3-none-any.whl is of version 1.0.0, not 1.1.0" in warm.stderr
    ), warm.stderr
    assert "[runtime] repro-colors==1.1.0: no file with a pinned sha256" in res.stderr  # cold: none on the index


@pytest.mark.parametrize(("project", "version"), [("repro-colors", "0.1.0"), ("repro-round", "0.2.0")])
def test_a_prebuilt_wheel_whose_metadata_is_another_project_or_version_is_refused(
    tmp_path: Path, project: str, version: str
) -> None:
    """A wheel's file name is anyone's word (issue 26: the prebuilt wheel was placed by its name alone): its own
    METADATA must name the pinned project at the pinned version before it enters wheels/."""
    served = tmp_path / "served"
    made, _ = write_wheel(served, project, version, (), "X = 1\n")
    posing = served / "repro_round-0.1.0-py3-none-any.whl"
    (served / made).rename(posing)
    ws = tmp_path / "ws"
    ws.mkdir()
    lock = ws / "prebuilt.lock"
    with FixtureServer(served) as srv:
        lock.write_text(
            'format = 1\n[toolchain]\npython = ">=3.10"\narchs = ["sm_90a"]\n'
            f'[sources.round-wheel]\nkind = "wheel"\nurl = "{srv.url}/{posing.name}"\n'
            '[packages.repro_round]\nsource = "round-wheel"\ndistribution = "repro-round"\n'
        )
        res = doit(ws, lock, tmp_path / "cache", "lock")
        assert res.returncode == 0, res.stdout + res.stderr
        res = doit(ws, lock, tmp_path / "cache", "wheels")
        url = f"{srv.url}/{posing.name}"
    assert res.returncode == 13, res.stdout + res.stderr  # VerificationError
    info = f"{project.replace('-', '_')}-{version}.dist-info/METADATA"
    problem = (
        f"its {info} names the project 'repro-colors', not 'repro-round'"
        if project != "repro-round"
        else f"its {info} says version 0.2.0, but its file name {posing.name} says 0.1.0"
    )
    assert (
        f"package repro_round: the prebuilt wheel of source round-wheel ({url}, sha256 "
        f"{file_sha256(posing)[:12]}…) is not a wheel of repro-round 0.1.0: {problem}; nothing was written to wheels/"
        in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr
    assert not (ws / "wheels").exists() or not list((ws / "wheels").iterdir())


def test_a_lock_nested_too_deeply_or_with_a_patch_out_of_its_folder_is_one_lock_error(tmp_path: Path) -> None:
    """Issue 26: 50 000 nested arrays were a RecursionError traceback (exit 3); a plain patch entry could name
    any file ("../../../x.patch" was applied, "../../../etc/passwd" read by git apply)."""
    ws = tmp_path / "ws"
    (tmp_path / "x.patch").write_text("")
    outside = tmp_path / "outside.patch"
    outside.write_text("")
    (ws / "patches" / "evil").mkdir(parents=True)
    (ws / "patches" / "evil" / "linked.patch").symlink_to(outside)
    source = f'kind = "url"\nurl = "http://127.0.0.1:9/evil.tar"\nsha256 = "{ZERO}"\ntree_sha256 = "{ZERO}"'
    for line, problem in [
        ("pip_args = " + "[" * 50_000 + "]" * 50_000, "not a lock this tool reads: a value is nested too deeply"),
        (
            'patches = ["../../../x.patch"]',
            "[packages.evil] patch '../../../x.patch' must be a path inside patches/evil/",
        ),
        ('patches = ["/etc/passwd"]', "[packages.evil] patch '/etc/passwd' must be a path inside patches/evil/"),
        ('patches = ["linked.patch"]', f"is a symbolic link out of {ws / 'patches' / 'evil'}, to {outside}"),
    ]:
        lock = tiny_lock(ws, source)
        lock.write_text(lock.read_text() + line + "\n")
        res = doit(ws, lock, tmp_path / "cache", "list")
        assert res.returncode == 11, res.stdout + res.stderr  # LockError
        assert problem in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr) < 1000, res.stderr
