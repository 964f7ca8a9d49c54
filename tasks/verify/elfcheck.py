"""Pure readers of ELF shared objects, for the verify stage.

Everything here reads files and returns values: no subprocesses, no loader.
The loader's own verdict (does the object really open?) comes from
``tasks/outside/verify_runner.py``; these functions explain it and catch what the
loader can miss (a torch symbol the installed torch no longer defines, in an
object that nothing has opened yet).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.hash import ELFHashSection, GNUHashSection
from elftools.elf.sections import Symbol, SymbolTableSection

ELF_MAGIC = b"\x7fELF"

# Sections in which nvcc puts the device code of a host object.
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin", ".nvFatBinSegment")

# A fatbinary starts with this header: magic 0xBA55ED50, version 1, header
# size 16 (little endian). Eight bytes, so a chance match is negligible.
FATBIN_HEADER = b"\x50\xed\x55\xba\x01\x00\x10\x00"

# Mangled-name prefixes of the c10, at and torch namespaces (plain and
# nested-name forms). These are the symbols a torch ABI mismatch breaks.
TORCH_PREFIXES = ("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10", "_ZNK2at", "_ZNK5torch")

_DEFINED_BINDINGS = ("STB_GLOBAL", "STB_WEAK", "STB_GNU_UNIQUE", "STB_LOOS")


@dataclass(frozen=True, kw_only=True)
class ElfInfo:
    """What the dynamic loader needs to know about one shared object."""

    path: Path
    soname: str | None
    needed: tuple[str, ...]
    rpath: tuple[str, ...]
    runpath: tuple[str, ...]
    undefined: tuple[str, ...]  # strong undefined dynamic symbols, sorted
    has_fatbin: bool


def is_elf(path: Path) -> bool:
    """True if ``path`` is a regular file that starts with the ELF magic."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == ELF_MAGIC
    except OSError:
        return False


def read_elf(path: Path) -> ElfInfo:
    """Read NEEDED, RPATH/RUNPATH, undefined symbols and device-code presence."""
    with path.open("rb") as fh:
        elf = _open(fh, path)
        soname: str | None = None
        needed: list[str] = []
        rpath: list[str] = []
        runpath: list[str] = []
        for section in elf.iter_sections():
            if not isinstance(section, DynamicSection):
                continue
            for tag in section.iter_tags():
                if tag.entry.d_tag == "DT_NEEDED":
                    needed.append(_tag_text(tag, "needed"))
                elif tag.entry.d_tag == "DT_SONAME":
                    soname = _tag_text(tag, "soname")
                elif tag.entry.d_tag == "DT_RPATH":
                    rpath.extend(_split_path(_tag_text(tag, "rpath")))
                elif tag.entry.d_tag == "DT_RUNPATH":
                    runpath.extend(_split_path(_tag_text(tag, "runpath")))
        undefined = sorted({s.name for s in _dynamic_symbols(elf) if _is_strong_undefined(s)})
        has_fatbin = any(elf.get_section_by_name(name) is not None for name in FATBIN_SECTIONS)
    if not has_fatbin:
        has_fatbin = contains_fatbin_header(path)
    return ElfInfo(
        path=path,
        soname=soname,
        needed=tuple(needed),
        rpath=tuple(rpath),
        runpath=tuple(runpath),
        undefined=tuple(undefined),
        has_fatbin=has_fatbin,
    )


def defined_symbols(path: Path) -> frozenset[str]:
    """Every symbol that ``path`` defines in its dynamic symbol table."""
    with path.open("rb") as fh:
        elf = _open(fh, path)
        return frozenset(s.name for s in _dynamic_symbols(elf) if _is_defined(s))


class SymbolIndex:
    """Answers "does any of these libraries define symbol X?".

    Uses each library's GNU (or SysV) hash table, so a lookup costs a few
    reads instead of a scan of a 100k-entry symbol table; a library without
    a hash table is scanned once.
    """

    def __init__(self, libraries: Iterable[Path]) -> None:
        self._libraries = tuple(sorted(set(libraries)))
        self._cache: dict[str, Path | None] = {}
        self._scanned: dict[Path, frozenset[str]] = {}

    @property
    def libraries(self) -> tuple[Path, ...]:
        return self._libraries

    def provider(self, name: str) -> Path | None:
        """The first library that defines ``name``, or None."""
        if name not in self._cache:
            self._cache[name] = self._lookup(name)
        return self._cache[name]

    def missing(self, names: Iterable[str]) -> list[str]:
        """The names no library defines, in the order given."""
        return [name for name in names if self.provider(name) is None]

    def _lookup(self, name: str) -> Path | None:
        for lib in self._libraries:
            if self._defines(lib, name):
                return lib
        return None

    def _defines(self, lib: Path, name: str) -> bool:
        if lib in self._scanned:
            return name in self._scanned[lib]
        try:
            with lib.open("rb") as fh:
                elf = ELFFile(fh)
                table = _hash_table(elf)
                if table is not None:
                    symbol = table.get_symbol(name)
                    return symbol is not None and _is_defined(symbol)
        except (OSError, ELFError):
            self._scanned[lib] = frozenset()
            return False
        self._scanned[lib] = defined_symbols(lib)
        return name in self._scanned[lib]


def torch_namespace(names: Iterable[str]) -> list[str]:
    """The mangled names that live in the c10, at or torch namespaces."""
    return [name for name in names if name.startswith(TORCH_PREFIXES)]


def contains_fatbin_header(path: Path, chunk: int = 1 << 24) -> bool:
    """True if the file contains a CUDA fatbinary header anywhere."""
    overlap = len(FATBIN_HEADER) - 1
    tail = b""
    try:
        with path.open("rb") as fh:
            while block := fh.read(chunk):
                if FATBIN_HEADER in tail + block:
                    return True
                tail = block[-overlap:]
    except OSError:
        return False
    return False


_NEEDED_ERROR = re.compile(r"(?P<lib>[^\s:]+): cannot open shared object file")
_UNDEFINED_ERROR = re.compile(r"undefined symbol: (?P<sym>[^\s,]+)")


def missing_library(error: str) -> str | None:
    """The library named in a loader 'cannot open shared object file' error."""
    match = _NEEDED_ERROR.search(error)
    return match.group("lib") if match else None


def undefined_symbol(error: str) -> str | None:
    """The symbol named in a loader 'undefined symbol' error."""
    match = _UNDEFINED_ERROR.search(error)
    return match.group("sym") if match else None


def _open(fh: BinaryIO, path: Path) -> ELFFile:
    try:
        return ELFFile(fh)
    except ELFError as exc:
        raise ValueError(f"{path}: not a readable ELF file: {exc}") from exc


def _dynamic_symbols(elf: ELFFile) -> Iterator[Symbol]:
    section = elf.get_section_by_name(".dynsym")
    if isinstance(section, SymbolTableSection):
        yield from section.iter_symbols()


def _hash_table(elf: ELFFile) -> GNUHashSection | ELFHashSection | None:
    for name in (".gnu.hash", ".hash"):
        section = elf.get_section_by_name(name)
        if isinstance(section, GNUHashSection | ELFHashSection):
            return section
    return None


def _is_strong_undefined(symbol: Symbol) -> bool:
    return bool(symbol.name) and symbol["st_shndx"] == "SHN_UNDEF" and symbol["st_info"]["bind"] == "STB_GLOBAL"


def _is_defined(symbol: Symbol) -> bool:
    return bool(symbol.name) and symbol["st_shndx"] != "SHN_UNDEF" and symbol["st_info"]["bind"] in _DEFINED_BINDINGS


def _tag_text(tag: object, name: str) -> str:
    # pyelftools resolves string-valued tags into instance attributes.
    return str(vars(tag)[name])


def _split_path(value: str) -> list[str]:
    return [part for part in value.split(":") if part]
