"""tasks/lock/git.py's reading of git's answers, through the ``runner`` seam: the runner answers as git does
(the real one is tasks/core/proc.py ``query``; tests/integration runs real git over HTTP)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tasks.core.errors import FetchError, LockError
from tasks.lock import git

A, B, C = "a" * 40, "b" * 40, "c" * 40


def answering(answers: Mapping[str, bytes], asked: list[list[str]] | None = None) -> Callable[..., Any]:
    """A runner that answers a git command by its subcommand (the first word after the options)."""

    def runner(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        if asked is not None:
            asked.append(list(cmd))
        word = next(w for w in cmd[1:] if not w.startswith("-") and "/" not in w)
        if word not in answers:
            error = kwargs.get("error")
            if error is not None:
                raise error(f"{kwargs.get('what') or word} failed (exit status 128): fatal")
            return subprocess.CompletedProcess(cmd, 128, b"", b"fatal")
        return subprocess.CompletedProcess(cmd, 0, answers[word], b"")

    return runner


def test_an_annotated_tag_resolves_to_its_commit_not_the_tag_object() -> None:
    out = f"{A}\trefs/tags/v2.4\n{B}\trefs/tags/v2.4^{{}}\n".encode()
    asked: list[list[str]] = []
    assert git.resolve_ref("https://h/r.git", "v2.4", runner=answering({"ls-remote": out}, asked)) == B
    assert asked == [["git", "ls-remote", "https://h/r.git", "v2.4", "v2.4^{}"]]


def test_a_branch_resolves_and_a_missing_or_ambiguous_ref_is_a_lock_error() -> None:
    assert git.resolve_ref("u", "main", runner=answering({"ls-remote": f"{C}\trefs/heads/main\n".encode()})) == C
    with pytest.raises(LockError, match="ref 'nope' not found"):
        git.resolve_ref("u", "nope", runner=answering({"ls-remote": b""}))
    two = f"{A}\trefs/heads/x/dev\n{B}\trefs/remotes/y/dev\n".encode()
    with pytest.raises(LockError, match="not found"):
        git.resolve_ref("u", "dev", runner=answering({"ls-remote": two}))


def test_list_tree_reads_nul_separated_records_with_any_path() -> None:
    records = [f"100644 blob {A}\tsetup.py", f"160000 commit {B}\tcsrc/cutlass", f"100755 blob {C}\tdir/a b\n.sh"]
    out = "".join(f"{r}\x00" for r in records).encode()
    items = git.list_tree(Path("/r.git"), A, runner=answering({"ls-tree": out}))
    assert [(i.type, i.path) for i in items] == [
        ("blob", "setup.py"),
        ("commit", "csrc/cutlass"),
        ("blob", "dir/a b\n.sh"),
    ]


def test_submodule_urls_join_relative_urls_to_the_superprojects() -> None:
    config = (
        b"submodule.cutlass.path csrc/cutlass\nsubmodule.cutlass.url ../cutlass.git\n"
        b"submodule.fe.path 3rdparty/fe\nsubmodule.fe.url https://github.com/NVIDIA/fe.git\n"
    )
    runner = answering({"show": b"[submodule]...", "config": config})
    urls = git.submodule_urls(Path("/r.git"), A, "https://github.com/Dao-AILab/flash-attention.git", runner=runner)
    assert urls == {
        "csrc/cutlass": "https://github.com/Dao-AILab/cutlass.git",
        "3rdparty/fe": "https://github.com/NVIDIA/fe.git",
    }
    local = git.submodule_urls(Path("/r.git"), A, "/srv/git/fa", runner=runner)
    assert local["csrc/cutlass"] == "/srv/git/cutlass.git"


def test_a_commit_without_gitmodules_has_no_submodules_and_a_failing_git_is_a_fetch_error() -> None:
    assert git.submodule_urls(Path("/r.git"), A, "u", runner=answering({})) == {}
    with pytest.raises(FetchError, match="git ls-tree"):
        git.list_tree(Path("/r.git"), A, runner=answering({}))
