"""The remote cache's record checks, shard assignment, settings and URLs, and remotes that do not answer."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tasks.core.digest import action_key
from tasks.core.errors import ReproError
from tasks.core.settings import load_settings, parse_shard
from tasks.engine.admission import shard_packages
from tasks.env.objcache import shared_remote
from tasks.store.cache import Cache
from tasks.store.remote import Remote, S3Location, check_record, parse_s3_url

REPO = Path(__file__).resolve().parents[2]

DOC = {"package": "p", "recipe_format": 2}
KEY = action_key(DOC)
GOOD = {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 10, "key": KEY, "key_document": DOC}


def raw(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def test_good_record_is_accepted() -> None:
    assert check_record(raw(), KEY) == GOOD


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"filename": "../evil.whl"}, "not a wheel file name"),
        ({"filename": "p.tar.gz"}, "not a wheel file name"),
        ({"sha256": "A" * 64}, "not a sha256"),
        ({"size": 0}, "positive number"),
        ({"size": True}, "positive number"),
        ({"key": "b" * 64}, "record of key"),
        ({"key_document": {"package": "other"}}, "does not hash"),
    ],
)
def test_bad_records_are_rejected(changes: dict[str, object], problem: str) -> None:
    result = check_record(raw(**changes), KEY)
    assert isinstance(result, str) and problem in result


def test_garbage_record_is_rejected() -> None:
    assert "not JSON" in str(check_record(b"\x00garbage", KEY))
    assert "not a JSON object" in str(check_record(b"[1]", KEY))


def test_shards_partition_the_packages_stably() -> None:
    names = ["e", "a", "d", "c", "b"]
    shards = [shard_packages(names, (i, 3)) for i in (1, 2, 3)]
    assert shards == [["a", "d"], ["b", "e"], ["c"]]
    assert sorted(n for s in shards for n in s) == sorted(names)
    assert shard_packages(list(reversed(names)), (2, 3)) == ["b", "e"]


def test_shard_setting() -> None:
    assert parse_shard("") is None
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "2", "a/b", "2/0"):
        with pytest.raises(ReproError, match="shard="):
            parse_shard(bad)


def test_remote_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REPRO_REMOTE", "REPRO_REMOTE_WRITE", "REPRO_REMOTE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    s = load_settings({"remote": "http://cache:8080/", "remote_write": "on", "remote_timeout": "2.5"})
    assert (s.remote, s.remote_write, s.remote_timeout) == ("http://cache:8080", True, 2.5)
    assert load_settings({}).remote_write is False
    with pytest.raises(ReproError, match="http"):
        load_settings({"remote": "cache:8080"})
    with pytest.raises(ReproError, match="needs remote"):
        load_settings({"remote_write": "on"})
    with pytest.raises(ReproError, match="remote_timeout"):
        load_settings({"remote": "http://x", "remote_timeout": "0"})


def test_unreachable_remote_is_a_warning_and_given_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    remote = Remote(f"http://127.0.0.1:{port}", write=True, timeout=1)
    started = time.monotonic()
    assert remote.restore(Cache(tmp_path / "cache"), "p", KEY) is None
    assert remote.restore(Cache(tmp_path / "cache"), "q", KEY) is None  # not asked again
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert err.count("WARNING: remote cache") == 1 and "not consulted again" in err


def test_s3_urls() -> None:
    assert parse_s3_url("s3://wheels") == S3Location("wheels", "")
    loc = parse_s3_url("s3://my.team-wheels/ci/stack/")
    assert loc == S3Location("my.team-wheels", "ci/stack")
    assert (
        isinstance(loc, S3Location)
        and loc.key("ac/k") == "ci/stack/ac/k"
        and str(loc) == "s3://my.team-wheels/ci/stack"
    )
    assert S3Location("wheels", "").key("cas/x") == "cas/x"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3://Wheels", "not an S3 bucket name"),
        ("s3://my_wheels", "not an S3 bucket name"),
        ("s3://ab", "not an S3 bucket name"),
        ("s3://-wheels", "not an S3 bucket name"),
        ("s3://wheels/a//b", "plain path segments"),
        ("s3://wheels/../b", "plain path segments"),
        ("s3://wheels/a?versionId=1", "plain path segments"),
    ],
)
def test_bad_s3_urls_are_refused_by_the_settings(url: str, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPRO_REMOTE_WRITE", raising=False)
    assert problem in str(parse_s3_url(url))
    with pytest.raises(ReproError, match=re.escape(f"remote={url!r}")) as exc:
        load_settings({"remote": url})
    assert problem in str(exc.value)


def test_s3_remote_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REPRO_REMOTE", "REPRO_REMOTE_WRITE", "REPRO_REMOTE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    s = load_settings({"remote": "s3://wheels/ci/", "remote_write": "on"})
    assert (s.remote, s.remote_write) == ("s3://wheels/ci", True)
    with pytest.raises(ReproError, match=r"s3://bucket/prefix"):
        load_settings({"remote": "ftp://cache"})
    with pytest.raises(ReproError, match="http"):
        load_settings({"remote": "http://"})
    # ccache's remote storage is HTTP only: an S3 remote shares wheels, not objects.
    assert shared_remote("s3://wheels/ci") == ""
    assert shared_remote("http://cache:8080") == "http://cache:8080"


def _s3_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    for name, value in {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)


def test_unreachable_s3_remote_is_a_warning_and_given_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    _s3_env(monkeypatch, f"http://127.0.0.1:{port}")
    remote = Remote("s3://wheels/ci", write=True, timeout=1)
    started = time.monotonic()
    assert remote.restore(Cache(tmp_path / "cache"), "p", KEY) is None
    assert remote.restore(Cache(tmp_path / "cache"), "q", KEY) is None  # not asked again
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert err.count("WARNING: remote cache s3://wheels/ci unavailable") == 1 and "not consulted again" in err


def test_unresponsive_s3_remote_costs_bounded_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as hang:  # accepts connections (backlog) and never answers
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)
        _s3_env(monkeypatch, f"http://127.0.0.1:{hang.getsockname()[1]}")
        remote = Remote("s3://wheels", write=False, timeout=0.5)
        started = time.monotonic()
        assert remote.restore(Cache(tmp_path / "cache"), "p", KEY) is None
        elapsed = time.monotonic() - started
    # botocore: 3 attempts of 0.5 s to read, with its backoff (at most a few seconds) between them.
    assert elapsed < 30, elapsed
    assert "timeout" in capsys.readouterr().err.lower()


@pytest.mark.parametrize(("name", "value"), [("AWS_PROFILE", "no-such-profile"), ("AWS_ENDPOINT_URL_S3", "not a url")])
def test_broken_s3_client_settings_are_a_warning_not_a_failure(
    name: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _s3_env(monkeypatch, "http://127.0.0.1:9")
    monkeypatch.setenv(name, value)
    assert Remote("s3://wheels", write=False, timeout=1).restore(Cache(tmp_path / "cache"), "p", KEY) is None
    err = capsys.readouterr().err
    assert "WARNING: remote cache s3://wheels unavailable" in err, err


def test_shards_balance_by_weight_heaviest_first() -> None:
    names = ["apex", "flash_attn", "flash_attn_3", "grouped_gemm", "mbridge", "transformer_engine"]
    weights = {"flash_attn": 26000.0, "transformer_engine": 2800.0, "apex": 1800.0, "grouped_gemm": 350.0}
    shards = [shard_packages(names, (i, 2), weights) for i in (1, 2)]
    # FA2 outweighs everything else together: it gets a machine of its own.
    assert shards == [["flash_attn"], ["apex", "flash_attn_3", "grouped_gemm", "mbridge", "transformer_engine"]]
    three = [shard_packages(names, (i, 3), weights) for i in (1, 2, 3)]
    assert three == [["flash_attn"], ["transformer_engine"], ["apex", "flash_attn_3", "grouped_gemm", "mbridge"]]
    assert sorted(n for s in three for n in s) == sorted(names)
    # Unweighted packages spread by count, so no shard is left empty while another has two.
    assert shard_packages(names, (1, 2), {}) == shard_packages(names, (1, 2))


def _wheel(path: Path, name: str) -> Path:
    """A small, valid wheel of project ``name``."""
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n\nA long description.\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_record_with_the_right_name_pointing_at_another_projects_blob_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server maps keys to blobs: a record for `p` that keeps p's file name but names the sha256 and size of
    another project's valid wheel passes every record check; the wheel's own METADATA gives it away."""
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "cache_server.py"), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split()[-1]
        writer = Remote(url, write=True, timeout=5)
        built = Cache(tmp_path / "built")
        other_doc = {"package": "other", "recipe_format": 2}
        for key, doc, name in ((KEY, DOC, "p"), (action_key(other_doc), other_doc, "other")):
            wheel = _wheel(tmp_path / f"{name}-1.0-py3-none-any.whl", name)
            writer.upload(built.put_wheel(key, wheel, {"package": name}), name, doc)
        record_file = tmp_path / "store" / "ac" / KEY
        honest = record_file.read_bytes()
        theirs = json.loads((tmp_path / "store" / "ac" / action_key(other_doc)).read_text())
        forged = {**json.loads(honest), "sha256": theirs["sha256"], "size": theirs["size"]}
        record_file.write_text(json.dumps(forged))
        assert check_record(record_file.read_bytes(), KEY) == forged  # a well-formed record of this key

        reader = Remote(url, write=False, timeout=5)
        assert reader.restore(Cache(tmp_path / "fresh"), "p", KEY, distribution="p") is None
        err = capsys.readouterr().err
        assert f"remote blob {url}/cas/{theirs['sha256']} for p rejected: its other-1.0.dist-info/METADATA names the " \
            "project 'other', not 'p'; it is not used, the package builds locally" in err, err  # fmt: skip
        assert not list((tmp_path / "fresh").glob("wheels/*/*/*.whl"))

        record_file.write_bytes(honest)  # the honest record restores
        entry = reader.restore(Cache(tmp_path / "fresh"), "p", KEY, distribution="p")
        assert entry is not None and entry.path.name == "p-1.0-py3-none-any.whl"
    finally:
        server.terminate()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
