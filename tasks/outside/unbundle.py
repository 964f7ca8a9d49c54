"""Check and unpack a reprostack bundle: runs on the air-gapped host, with nothing but python3.

This file travels inside every bundle (``reprostack-bundle/unbundle.py``, written by tasks/image/bundle.py)
and is the code `doit unbundle` runs too. The host it is for has a python3 (3.8 or newer) and the
bundle file, no checkout and no reprostack: so it imports only the standard library and keeps to
Python 3.8's grammar and library (tests/unit/test_bundle_unpack.py enforces both). There, without
anything installed::

    python3 -c "import sys,tarfile;exec(tarfile.open(sys.argv[1]).extractfile(\\
    'reprostack-bundle/unbundle.py').read())" BUNDLE DEST

(:func:`instruction`; `doit bundle` prints it). The unpacker read out of the bundle is the bundle's
own: check the bundle's sha256 against the one `doit bundle` printed, obtained apart from the bundle,
before running it (``sha256sum -c BUNDLE.sha256`` with a ``.sha256`` carried apart).

What it checks before anything is written: the bundle's ``.sha256`` beside it, when there is one; every
member (only regular files and directories, all under ``reprostack-bundle/``, relative names without
``..``, no setuid/setgid/sticky bits, no name twice); the file list against SHA256SUMS. Then each file
streams into a private temporary directory beside DEST while hashed, the first that differs stops it,
and only a complete, verified tree is renamed to DEST.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile

TOP = "reprostack-bundle"
SUMS = "SHA256SUMS"
#: The unpacker's own name inside the bundle.
NAME = "unbundle.py"
#: The exit status of a refused bundle (tasks/core/errors.py's BundleError has the same).
REFUSED = 20


class Refused(Exception):
    """The bundle must not be used; the message says why."""


def instruction(bundle: str, dest: str) -> str:
    """The command that checks and unpacks ``bundle`` into ``dest`` where only python3 is installed."""
    script = f"{TOP}/{NAME}"
    return (
        f"python3 -c \"import sys,tarfile;exec(tarfile.open(sys.argv[1]).extractfile('{script}').read())\" "
        f"{bundle} {dest}"
    )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_transfer(bundle: str, warn: object = None) -> str | None:
    """Compare the bundle with the ``.sha256`` file beside it, if there is one; the digest checked, or None.

    SHA256SUMS travels inside the bundle: whoever can alter the bundle can rewrite it to match, so it
    catches damage, not tampering. Only a digest obtained apart from the bundle protects the content.
    """
    side = bundle + ".sha256"
    name = os.path.basename(side)
    if not os.path.isfile(side):
        message = (
            f"no {name} beside {bundle}: its files are checked only against the SHA256SUMS it carries, "
            f"which whoever altered it could have rewritten. Its sha256 is {file_sha256(bundle)}: compare it "
            "with the one `doit bundle` printed, obtained apart from the bundle, before trusting what it holds"
        )
        if callable(warn):
            warn(message)
        else:
            print(f"WARNING: {message}", file=sys.stderr, flush=True)
        return None
    with open(side) as fh:
        words = fh.read().split()
    expected = words[0] if words else ""
    actual = file_sha256(bundle)
    if actual != expected:
        raise Refused(f"{bundle}: sha256 {actual} differs from {name} ({expected}); refusing it")
    return expected


def parse_sums(text: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel:
            raise Refused(f"{SUMS} line {number} is malformed: {line!r}")
        entries[rel] = digest
    return entries


def _clean(name: str) -> str:
    if "\0" in name:
        raise Refused(f"{name!r}: NUL in the name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise Refused(f"{name!r}: absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"{name!r}: '..' in the name")
    if not parts:
        raise Refused(f"{name!r}: empty name")
    return "/".join(parts)


def checked_files(infos: list[tarfile.TarInfo], bundle: str) -> list[tuple[tarfile.TarInfo, str]]:
    """(member, path under TOP) of every regular file, after checking every member; nothing is written."""
    seen: dict[str, bool] = {}
    files = []
    for info in infos:
        try:
            if info.issym():
                raise Refused(f"{info.name!r}: a symbolic link; only files and directories are allowed here")
            if not (info.isreg() or info.isdir()):
                raise Refused(f"{info.name!r}: a hard link or special file; only files and directories are allowed")
            name = _clean(info.name)
            if info.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
                raise Refused(f"{info.name!r}: setuid, setgid or sticky bit (mode {info.mode:o})")
            if name in seen and not (info.isdir() and seen[name]):
                raise Refused(f"{info.name!r}: appears twice")
        except Refused as exc:
            raise Refused(f"{bundle}: refused, nothing was unpacked: member {exc}") from None
        seen[name] = info.isdir()
        if name != TOP and not name.startswith(TOP + "/"):
            raise Refused(f"{bundle}: entries outside {TOP}/; refusing it")
        if info.isreg():
            files.append((info, name[len(TOP) + 1 :]))
    return files


def _refuse(problems: list[str]) -> Refused:
    shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
    return Refused(f"the bundle was altered or is incomplete; nothing was unpacked:\n  {shown}")


def list_problems(listed: dict[str, str], present: set[str]) -> list[str]:
    problems = [f"missing: {rel}" for rel in sorted(set(listed) - present)]
    return problems + [f"not listed in {SUMS}: {rel}" for rel in sorted(present - set(listed))]


def unpack(bundle: str, dest: str, warn: object = None) -> dict[str, object]:
    """Verify ``bundle`` and unpack it to ``dest`` (which must not exist); return its BUNDLE.json."""
    if not os.path.isfile(bundle):
        raise Refused(f"{bundle}: no such bundle file")
    if os.path.lexists(dest):
        raise Refused(f"{dest} exists; choose a new destination (unbundling never overwrites)")
    check_transfer(bundle, warn)
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dest))}.", dir=parent)
    try:
        try:
            with tarfile.open(bundle, "r:") as tar:
                files = checked_files(tar.getmembers(), bundle)
                sums_member = next((info for info, rel in files if rel == SUMS), None)
                if sums_member is None:
                    raise Refused(f"the bundle has no {TOP}/{SUMS}; refusing it")
                sums = tar.extractfile(sums_member)
                assert sums is not None
                listed = parse_sums(sums.read().decode("utf-8", "replace"))
                problems = list_problems(listed, {rel for _info, rel in files} - {SUMS})
                if problems:
                    raise _refuse(problems)
                for info, rel in files:
                    target = os.path.join(tmp, TOP, *rel.split("/"))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    source = tar.extractfile(info)
                    assert source is not None
                    digest = hashlib.sha256()
                    with source, open(target, "xb") as out:
                        for chunk in iter(lambda: source.read(1 << 20), b""):  # noqa: B023 (used at once)
                            digest.update(chunk)
                            out.write(chunk)
                    if rel != SUMS and digest.hexdigest() != listed[rel]:
                        raise _refuse([f"sha256 differs: {rel}"])
                    os.chmod(target, 0o755 if info.mode & 0o100 else 0o644)
            top = os.path.join(tmp, TOP)
            with open(os.path.join(top, "BUNDLE.json")) as fh:
                doc: dict[str, object] = json.load(fh)
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            raise Refused(f"{bundle}: not a readable bundle ({exc}); nothing was unpacked") from None
        doc["verified_files"] = len(listed)
        os.replace(top, dest)
        return doc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: {instruction('BUNDLE', 'DEST')}", file=sys.stderr)
        return 2
    bundle, dest = args
    try:
        doc = unpack(bundle, dest)
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return REFUSED
    parts = doc.get("parts") or []
    print(f"verified {doc['verified_files']} files of {bundle} and unpacked them to {dest} (parts: {', '.join(parts)})")  # type: ignore[arg-type]
    if "tool" in parts:  # type: ignore[operator]
        print(
            f"install the tool: python3 -m venv .venv && .venv/bin/pip install --no-index --find-links {dest}/tool "
            f"--require-hashes -r {dest}/tool/requirements.txt (the tool needs Python 3.11 or newer)"
        )
    if "wheels" in parts:  # type: ignore[operator]
        print(
            f"install the wheelhouse: pip install --no-index --find-links {dest}/wheels --require-hashes "
            f"-r {dest}/wheels/requirements.txt"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
