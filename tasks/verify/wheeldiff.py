"""How two builds of one wheel differ, member by member, in words a reader can act on.

Pure: reads the two zip files only. For each member present in both with
different bytes it gives the sizes and sha256s; text members get a short
unified diff; ELF members (shared objects) get the sections whose contents
differ, and the strings found only in one side's version of those sections
(a temporary file name, a build path, a timestamp are usually recognisable
there).
"""

from __future__ import annotations

import difflib
import hashlib
import io
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

#: Printable runs this long or longer count as strings (as in ``strings -n 6``).
MIN_STRING = 6
MAX_LINES = 12


@dataclass(frozen=True, kw_only=True)
class MemberDiff:
    """One wheel member that is not the same in both wheels."""

    name: str
    status: str  # "differs", "only in built", "only in rebuilt"
    size: tuple[int, int] = (0, 0)
    sha256: tuple[str, str] = ("", "")
    details: tuple[str, ...] = ()

    def render(self) -> list[str]:
        if self.status != "differs":
            return [f"{self.name}: {self.status}"]
        head = (
            f"{self.name}: size {self.size[0]} -> {self.size[1]}, "
            f"sha256 {self.sha256[0][:16]}… -> {self.sha256[1][:16]}…"
        )
        return [head, *(f"    {line}" for line in self.details)]


@dataclass(frozen=True, kw_only=True)
class WheelDiff:
    """Every difference between the wheel that was built and its rebuild."""

    members: tuple[MemberDiff, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def render(self) -> str:
        lines = [*self.notes]
        for member in self.members:
            lines.extend(member.render())
        return "\n".join(lines)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _strings(data: bytes) -> set[str]:
    return {m.decode("ascii") for m in re.findall(rb"[\x20-\x7e]{%d,}" % MIN_STRING, data)}


def _text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _clip(items: list[str], limit: int = MAX_LINES) -> list[str]:
    if len(items) <= limit:
        return items
    return [*items[:limit], f"... ({len(items) - limit} more)"]


def _sections(data: bytes) -> dict[str, bytes] | None:
    """Section name -> contents (NOBITS sections empty), or None when not ELF."""
    if not data.startswith(b"\x7fELF"):
        return None
    try:
        elf = ELFFile(io.BytesIO(data))
        out: dict[str, bytes] = {}
        for index, section in enumerate(elf.iter_sections()):
            name = section.name or f"#{index}"
            if name in out:
                name = f"{name}#{index}"
            out[name] = b"" if section["sh_type"] == "SHT_NOBITS" else section.data()
        return out
    except (ELFError, ValueError):
        return None


def elf_details(a: bytes, b: bytes) -> list[str] | None:
    """Which sections of two ELF files differ and the strings only one side has; None if not ELF."""
    sa, sb = _sections(a), _sections(b)
    if sa is None or sb is None:
        return None
    lines = []
    if list(sa) != list(sb):
        only_a = [n for n in sa if n not in sb]
        only_b = [n for n in sb if n not in sa]
        lines.append(f"section list differs: only in built {only_a or '-'}, only in rebuilt {only_b or '-'}")
    differ = [n for n in sa if n in sb and sa[n] != sb[n]]
    if not differ:
        lines.append("every section is identical: the ELF headers, section order or padding differ")
        return lines
    lines.append(
        "sections that differ: "
        + ", ".join(f"{n} ({len(sa[n])} -> {len(sb[n])} bytes)" if len(sa[n]) != len(sb[n]) else n for n in differ)
    )
    strings_a = set().union(*(_strings(sa[n]) for n in differ))
    strings_b = set().union(*(_strings(sb[n]) for n in differ))
    if strings_a - strings_b:
        lines.append("strings only in built:")
        lines.extend(f"  {s!r}" for s in _clip(sorted(strings_a - strings_b), 6))
    if strings_b - strings_a:
        lines.append("strings only in rebuilt:")
        lines.extend(f"  {s!r}" for s in _clip(sorted(strings_b - strings_a), 6))
    return lines


def text_details(a: str, b: str) -> list[str]:
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "built", "rebuilt", n=0, lineterm="")
    return _clip([line for line in diff if not line.startswith("@@")][2:] or ["whitespace or line endings differ"])


def _members(zf: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    return {i.filename: i for i in zf.infolist() if not i.is_dir()}


def _member_diffs(za: zipfile.ZipFile, zb: zipfile.ZipFile) -> Iterator[MemberDiff]:
    ma, mb = _members(za), _members(zb)
    for name in sorted(ma.keys() | mb.keys()):
        if name not in mb:
            yield MemberDiff(name=name, status="only in built")
            continue
        if name not in ma:
            yield MemberDiff(name=name, status="only in rebuilt")
            continue
        a, b = za.read(ma[name]), zb.read(mb[name])
        if a == b:
            continue
        ta, tb = _text(a), _text(b)
        details = elf_details(a, b)
        if details is None and ta is not None and tb is not None:
            details = text_details(ta, tb)
        yield MemberDiff(
            name=name,
            status="differs",
            size=(len(a), len(b)),
            sha256=(_sha(a), _sha(b)),
            details=tuple(details or ["binary contents differ"]),
        )


def compare_wheels(built: Path, rebuilt: Path) -> WheelDiff:
    """The differences between two wheels (empty when their members are the same)."""
    with zipfile.ZipFile(built) as za, zipfile.ZipFile(rebuilt) as zb:
        members = tuple(_member_diffs(za, zb))
        notes: tuple[str, ...] = ()
        if not members:
            order_a = [i.filename for i in za.infolist()]
            order_b = [i.filename for i in zb.infolist()]
            what = "member order" if order_a != order_b else "zip metadata (timestamps, permissions, compression)"
            notes = (f"every member is identical: the {what} differs",)
    return WheelDiff(members=members, notes=notes)
