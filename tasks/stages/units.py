"""Compile units and the object cache: what decided each unit's entry at the last build, and which units a
build of the lock as it is now will find there.

After a build with the object cache, :func:`record` reads ccache's own log of the build (each compile's
command line, working directory, compiler, object, the keys of its manifest and result, and whether it hit),
and, for each unit, the files its manifest lists (every header the compile read, as ccache keys on them:
``ccache --inspect``), and keeps in the build history (tasks/store/history.py, ``timings/<pkg>.units.json``)
the sha256 of each of those files, of its code without comments, and of each compiler.

`doit plan` then asks :func:`predict` what the next build's units will do. It re-derives the same hashes for
the staged tree the lock would produce now, without compiling and without writing anything but a scratch
directory outside the cache: the files the package's patches touch are copied from the cached sources into
that directory and the patches applied there (tasks/stages/patch.py's ``apply_patches``); every other file
is the cached source's. For each unit, as ccache decides:

- every file it read unchanged, its compiler too, and its manifest and result in the object cache: a
  **hit** (ccache's direct mode), at what its last hit took;
- a file changed only in its comments (the same code digest: what the preprocessor makes of it line for
  line is the same): **preprocessed**, ccache runs the preprocessor and then finds the result, at what the
  preprocessor run took; so too where the result is there but the manifest is not;
- anything else: it **compiles**, at its recorded compile time, and the line names why (which file, which
  flag, which compiler); a change of the key outside the sources and patches (the toolchain, the recipe's
  environment, the archs) compiles every unit, naming the change and, for an environment variable whose
  old value is on the unit's command line, that flag;
- with a remote object cache (``remote=http…``), a result missing here but present there is a **remote**
  hit, at its download's cost (two round trips, measured now, and its size at :data:`REMOTE_RATE`).

What it does not see: units a patch adds (a new source file is named, not counted), units the build system
adds for a changed flag, and a header that a patch adds where it shadows another one (ccache's direct mode
does not see that either).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tasks.core.errors import PatchError, ReproError
from tasks.engine.forecast import UnitForecast
from tasks.env import objcache, reproducible
from tasks.lock.lockfile import ARCH_RE, arch_env, expand_env
from tasks.outside.gate import SOURCES, compiles
from tasks.stages.patch import Patch, apply_patches
from tasks.store import history

if TYPE_CHECKING:
    from tasks.core.settings import Settings
    from tasks.lock.lockfile import Lock, Package
    from tasks.store.cache import Cache


class Context(Protocol):
    """What this module reads of a run (tasks/stages/context.py's ``Context``, which imports this module)."""

    settings: Settings
    lock: Lock
    cache: Cache

    def patches(self, pkg: Package) -> list[Patch]: ...


#: What a unit will do, as :class:`UnitCall` says it.
HIT, REMOTE, PREPROCESSED, COMPILE = "hit", "remote", "preprocessed", "compile"
OUTCOMES = (HIT, REMOTE, PREPROCESSED, COMPILE)
#: What a remote hit's bytes are taken to come at (bytes per second): the plan measures the round trip, not
#: the bandwidth.
REMOTE_RATE = 100e6
#: A hit's cost where no hit of the package was measured yet (seconds).
DEFAULT_HIT_S = 0.05
#: How many of a package's compiling units a plan names.
NAMED = 5
#: Why a unit compiles whose entry is not in the object cache.
ABSENT = "not in the object cache (evicted or cleared)"


# --------------------------------------------------------------------------- hashes


#: A comment, or a literal that may hold what looks like one (kept as it is).
_CODE = re.compile(
    rb'R"(?P<delim>[^ ()\\\t\n]{0,16})\((?s:.*?)\)(?P=delim)"'  # raw string literal
    rb'|"(?:[^"\\\n]|\\.)*"'  # string literal
    rb"|(?<![0-9A-Za-z_])'(?:[^'\\\n]|\\.)*'"  # character literal (not a digit separator)
    rb"|(?P<line>//(?:[^\\\n]|\\.|\\\n)*)"  # line comment, continued by a backslash-newline
    rb"|(?P<block>/\*(?s:.*?)\*/)"  # block comment
)


def code_digest(data: bytes) -> str:
    """The sha256 of ``data`` (C, C++ or CUDA) with each comment made one space and the newlines it held.

    Two files with the same digest differ only inside their comments, and where their lines are, so the
    preprocessor's output of them is the same, line markers included (it drops comments): ccache's
    preprocessor mode then finds the same result. (The converse does not hold: a change in code the
    preprocessor drops, ``#if 0``, gives another digest; the plan then says "compiles" where ccache may hit.)
    """

    def blank(m: re.Match[bytes]) -> bytes:
        if m.group("line") is None and m.group("block") is None:
            return m.group(0)
        return b" " + b"\n" * m.group(0).count(b"\n")

    return hashlib.sha256(_CODE.sub(blank, data)).hexdigest()


class Hashes:
    """Each file's sha256 and code digest, each read once per plan or record; None for a file not there."""

    def __init__(self) -> None:
        self._sha: dict[Path, str | None] = {}
        self._code: dict[Path, str | None] = {}

    def sha256(self, path: Path) -> str | None:
        if path not in self._sha:
            self._sha[path] = _read_sha(path)
        return self._sha[path]

    def code(self, path: Path) -> str | None:
        """:func:`code_digest` of the file (about 10 MB/s: only where it is needed)."""
        if path not in self._code:
            try:
                self._code[path] = code_digest(path.read_bytes()) if path.is_file() else None
            except OSError:
                self._code[path] = None
        return self._code[path]


def _read_sha(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


# --------------------------------------------------------------------------- the staged tree, file by file


def touched(patch: Patch) -> list[str]:
    """The files ``patch`` writes, deletes or reads (renames and copies), relative to the tree it applies to."""
    try:
        text = patch.path.read_text(errors="replace")
    except OSError:
        return []
    found: list[str] = []

    def add(name: str, strip: int) -> None:
        name = name.split("\t")[0].strip()
        if name.startswith('"') and name.endswith('"'):
            name = name[1:-1]
        parts = name.split("/")[strip:]
        rel = "/".join(parts)
        if name != "/dev/null" and rel and rel not in found:
            found.append(rel)

    for line in text.splitlines():
        if line.startswith(("--- ", "+++ ")):
            add(line[4:], patch.strip)
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            add(line.split(" ", 2)[2], 0)
    return found


@dataclass
class TreeView:
    """The staged tree a build of the package would compile, file by file, without copying it: each file
    from the cached tree of the source it comes from (the package's source, or an overlay's at its place),
    but those its patches touch, from ``patched`` (where they were copied and patched)."""

    trees: list[tuple[str, Path]]  # (destination in the package, cached tree), overlays first
    patched: Path | None = None
    touched: frozenset[str] = frozenset()

    def path(self, rel: str) -> Path | None:
        """Where the staged tree's file ``rel`` is (None: not in the staged tree, or gone by a patch)."""
        if rel in self.touched and self.patched is not None:
            here = self.patched / rel
            return here if here.is_file() else None
        for dest, root in self.trees:
            if dest == ".":
                return root / rel
            if rel.startswith(dest + "/"):
                return root / rel[len(dest) + 1 :]
        return None


def _trees(ctx: Context, pkg: Package) -> list[tuple[str, Path]] | str:
    """The package's cached source trees by destination (overlays first), or why they are not all there."""
    out = []
    for dest, name in sorted(((".", pkg.source), *pkg.overlays), key=lambda d: (d[0] == ".", -len(d[0]))):
        src = ctx.lock.sources[name]
        if not src.tree_sha256 or not ctx.cache.has_source(src.tree_sha256):
            return f"the source {name} is not in the cache yet (`doit fetch:{name}`)"
        out.append((dest.strip("/") or ".", ctx.cache.source_tree(src.tree_sha256)))
    return out


def staged_view(ctx: Context, pkg: Package, scratch: Path) -> TreeView | str:
    """The tree the lock would stage for ``pkg`` now, with its patches applied in ``scratch`` to copies of the
    files they touch; or why it cannot be had (a source not fetched, a patch that does not apply)."""
    trees = _trees(ctx, pkg)
    if isinstance(trees, str):
        return trees
    view = TreeView(trees)
    try:
        patches = ctx.patches(pkg)
    except ReproError as exc:
        return exc.message
    if not patches:
        return view
    names = {rel for p in patches for rel in touched(p)}
    root = scratch / "tree"
    root.mkdir(parents=True)
    for rel in sorted(names):
        if ".." in rel.split("/"):
            return f"a patch names {rel!r}, outside the tree"
        found = view.path(rel)
        if found is not None and found.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(found, root / rel)
    try:
        apply_patches(root, patches, scratch / "patch.log")
    except (PatchError, ReproError) as exc:
        first = exc.message.splitlines()[0] if exc.message else str(exc)
        return f"the patches do not apply: {first}"
    return TreeView(trees, patched=root, touched=frozenset(names))


# --------------------------------------------------------------------------- after a build: the record


#: The directory a run's ccache masquerade lives in (tasks/env/objcache.py): gone once the run has ended.
_MASQUERADE_DIR = re.compile(r"^(ccache-bin-\d+|reprostack-ccache-.*)$")


def real_compiler(path: str) -> str:
    """The compiler ``path`` stands for: itself, or where it is in ccache's masquerade directory (a run's own,
    gone when the run ends: ``PYTORCH_NVCC`` names it), the compiler of that name on ``PATH`` outside it, which
    ccache ran and keyed on by its content; '' for none. (Recorded as the masquerade's path, every nvcc unit of
    TransformerEngine counted as compiling at the next plan: "compiler .../ccache-bin-10763/nvcc is gone".)"""
    if not path:
        return ""
    where = Path(path)
    if not _MASQUERADE_DIR.match(where.parent.name):
        return path
    search = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d and Path(d) != where.parent)
    found = shutil.which(where.name, path=search)
    return os.path.realpath(found) if found else path


def record(
    ctx: Context,
    pkg: Package,
    *,
    key: str,
    doc: Mapping[str, Any],
    log: Path,
    stage: Path,
    seen: str,
    ccache: str,
) -> list[tuple[float, float]]:
    """Keep what decided each of ``pkg``'s compile units' object-cache entries at the build just done (its
    ccache ``log``; ``stage`` holds the staged tree, which the build saw at ``seen``); the (start, end) of
    each unit's run, seconds since the epoch. A build whose log tells no compile keeps the last record."""
    runs = [r for r in objcache.read_log(log) if r.outcome != "uncached" or compiles(r.command.split())]
    if not runs:
        return []
    earlier = history.read_units(ctx.cache.root, pkg.name)
    hit_before = {u.object: u.hit_s for u in earlier.units if u.hit_s is not None} if earlier else {}
    hashes = Hashes()
    trees = _trees(ctx, pkg)
    view = TreeView(trees if isinstance(trees, list) else [])
    try:
        patched = {rel for p in ctx.patches(pkg) for rel in touched(p)}
    except ReproError:
        patched = set()
    files: list[tuple[str, str, str]] = []
    index: dict[str, int] = {}
    compilers: dict[str, str] = {}

    def file_index(path: str, cwd: str) -> int:
        full = os.path.normpath(os.path.join(cwd, path))
        rel = os.path.relpath(full, seen) if full == seen or full.startswith(seen.rstrip("/") + "/") else ""
        name = rel or full
        if name not in index:
            # The package's own file: hashed in the stage, with its code digest (a patch may change its comments
            # only), unless the build wrote it (no hashes). The host's (the toolchain's): its sha256 alone.
            sha, code = "", ""
            if rel:
                cached = view.path(rel)
                if rel in patched or (cached is not None and cached.is_file()):
                    sha, code = hashes.sha256(stage / rel) or "", hashes.code(stage / rel) or ""
            else:
                sha = hashes.sha256(Path(full)) or ""
            index[name] = len(files)
            files.append((name, sha, code if sha else ""))
        return index[name]

    units: dict[str, history.UnitRecord] = {}  # by the object's path: two units may share a file name
    for run in runs:
        output = run.output or _output(run.command)
        if not output or any(part in _PROBES for part in Path(run.cwd, output).parts):
            continue  # (CMake's configure probes: in the serial part, with names of their own at each build)
        name = os.path.basename(output)
        inputs: list[int] = []
        if run.source:
            inputs.append(file_index(run.source, run.cwd))
        if run.manifest_key and run.result_key:
            listed = objcache.manifest_inputs(ccache, ctx.cache.objects, run.manifest_key, run.result_key)
            inputs.extend(file_index(p, run.cwd) for p in listed or [])
        compiler = real_compiler(run.compiler)
        if compiler and compiler not in compilers:
            compilers[compiler] = hashes.sha256(Path(compiler)) or ""
        units[os.path.normpath(os.path.join(run.cwd, output))] = history.UnitRecord(
            name=name,
            object=output,
            command=run.command,
            compiler=compiler,
            manifest=run.manifest_key,
            result=run.result_key,
            inputs=tuple(dict.fromkeys(inputs)),
            outcome=run.outcome,
            why=run.why,
            seconds=run.seconds,
            preprocess_s=run.preprocess_s if run.preprocess_s > 0 else None,
            compile_s=run.compile_s if run.compile_s > 0 else None,
            hit_s=run.seconds if run.outcome == "hit" else hit_before.get(output),
        )
    history.record_units(
        ctx.cache.root,
        pkg.name,
        history.UnitRecords(
            key=key,
            time=time.time(),
            document=doc,
            root=seen,
            ccache=objcache.version(ccache),
            files=tuple(files),
            compilers=compilers,
            units=tuple(units.values()),
        ),
    )
    return [(r.start, r.start + r.seconds) for r in runs]


#: Directories of CMake's compiler checks (``try_compile``, the compiler's identification): not units.
_PROBES = frozenset({"CMakeScratch", "CMakeTmp", "CompilerIdC", "CompilerIdCXX", "CompilerIdCUDA"})


def _output(command: str) -> str:
    words = command.split()
    for i, word in enumerate(words):
        if word == "-o" and i + 1 < len(words):
            return words[i + 1]
    return ""


# --------------------------------------------------------------------------- before a build: the prediction


@dataclass(frozen=True)
class UnitCall:
    """What one compile unit will do at the next build: its outcome (:data:`OUTCOMES`), the seconds it
    takes (its hit, its download, its preprocessor run, or its compile with its preprocessor run), why
    (for what is not a hit: the file, the flag), and the unit whose memory record the broker would admit
    it by (the compile's, or its preprocessor run's)."""

    name: str
    outcome: str
    seconds: float
    why: str = ""
    memory_as: str = ""

    @property
    def gated(self) -> bool:
        """Whether it runs a compiler process through the gate (and takes a job token)."""
        return self.outcome in (PREPROCESSED, COMPILE)


@dataclass(frozen=True)
class UnitsPlan:
    """A package's compile units at its next build, by the records of its last build with the object cache.

    ``last``: each unit's seconds as at that build (what the forecast takes out of its wall time to find
    the rest of it); ``notes``: what the counts do not cover; ``remote``: how the remote object cache was
    counted (``checked``, ``not shared`` or why not); ``stage_s``: what re-deriving the staged tree took."""

    units: tuple[UnitCall, ...]
    since: float
    last: tuple[tuple[str, float], ...] = ()
    notes: tuple[str, ...] = ()
    remote: str = ""
    stage_s: float = 0.0
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def compile_s(self) -> float:
        """The seconds of compiles (and preprocessor runs) the build will run, one after another."""
        return sum(u.seconds for u in self.units if u.gated)

    def first(self, n: int = NAMED) -> list[UnitCall]:
        """The first ``n`` units that compile or preprocess, the longest first."""
        return sorted((u for u in self.units if u.gated), key=lambda u: (u.outcome != COMPILE, -u.seconds))[:n]


def _only_docs(change: str) -> bool:
    """A change of the key that does not reach a compiler: the sources and patches are looked at file by
    file, the Requires-Dist lines added to the wheel's metadata are not compiled."""
    return change.startswith(("source ", "patch", "requires_added "))


def reaching_changes(old: Mapping[str, Any], new: Mapping[str, Any], pkg: Package) -> list[str]:
    """The sections of the key that differ from ``old`` to ``new`` and may reach a compiler (not the sources
    and patches, looked at file by file; not torch for a package that does not build against it)."""
    out = []
    for section in sorted(set(old) | set(new)):
        if section in ("sources", "patches", "requires_added"):
            continue
        a, b = old.get(section), new.get(section)
        if section == "toolchain" and not pkg.needs_torch and isinstance(a, dict) and isinstance(b, dict):
            a = {k: v for k, v in a.items() if not k.startswith("torch")}
            b = {k: v for k, v in b.items() if not k.startswith("torch")}
        if a != b:
            out.append(f"{section} changed")
    return out


def _old_env(document: Mapping[str, Any]) -> dict[str, str]:
    """The recipe's environment in ``document`` with its arch placeholders filled as that build filled them."""
    recipe = document.get("recipe")
    env = recipe.get("env") if isinstance(recipe, dict) else None
    env = {k: v for k, v in env.items() if isinstance(v, str)} if isinstance(env, dict) else {}
    archs = document.get("archs")
    if isinstance(archs, list) and all(isinstance(a, str) and ARCH_RE.match(a) for a in archs):
        return expand_env(env, arch_env(tuple(archs)))
    return env


def _flag(change: str, env_old: Mapping[str, Any], commands: Iterable[str]) -> str:
    """``change`` (``env NAME old -> new``), naming the flag on the command line that holds the old value."""
    m = re.match(r"^env (\S+) ", change)
    if m is None:
        return change
    old = env_old.get(m.group(1))
    if not isinstance(old, str) or len(old) < 2:
        return change
    values = [v for v in re.split(r"[\s;,]+", old) if len(v) >= 2] or [old]
    for command in commands:
        for word in command.split():
            if any(v in word for v in values):
                return f"flag {word} ({change})"
    return f"{change}: the command lines may change"


def predict(
    ctx: Context,
    pkg: Package,
    records: history.UnitRecords,
    key: str,
    doc: Mapping[str, Any],
    changes: Sequence[str] | None = None,
    *,
    remote_sizes: RemoteSizes | None = None,
) -> UnitsPlan:
    """What each of ``pkg``'s units will do at its next build (action key ``key``, its document ``doc``), by
    ``records``; ``changes``: how ``doc`` differs from the records' (tasks/cli/plan.py's ``diff_inputs``; None:
    :func:`reaching_changes` names the sections only).
    ``remote_sizes``: a function of a list of ccache keys giving each one's size on the remote object cache
    (None: absent) and the round trip it measured; None where there is no remote object cache."""
    started = time.monotonic()
    memory = history.load_memory(history.memory_path(ctx.cache.root, pkg.name))
    hits = [u.hit_s for u in records.units if u.hit_s is not None]
    typical_hit = statistics.median(hits) if hits else DEFAULT_HIT_S
    notes: list[str] = []

    def gate_seconds(unit: str) -> float | None:
        found = memory.get(unit, {})
        seconds = found.get("seconds")
        return float(seconds) if isinstance(seconds, int | float) and "exit" not in found else None

    def preprocess_name(u: history.UnitRecord) -> str:
        return f"{os.path.basename(records.files[u.inputs[0]][0])}.E" if u.inputs else f"{u.name}.E"

    def cost(u: history.UnitRecord, outcome: str) -> float:
        cpp = gate_seconds(preprocess_name(u))
        if cpp is None:
            cpp = u.preprocess_s
        if outcome == PREPROCESSED:
            return cpp if cpp is not None else 0.1 * (gate_seconds(u.name) or u.compile_s or u.seconds)
        if outcome == COMPILE:
            compile_s = gate_seconds(u.name) or u.compile_s or u.seconds
            return compile_s + (cpp or 0.0)
        return u.hit_s if u.hit_s is not None else typical_hit

    last = tuple(
        (u.name, cost(u, {"hit": HIT, "preprocessed": PREPROCESSED}.get(u.outcome, COMPILE))) for u in records.units
    )
    if changes is None:
        reaching = reaching_changes(records.document, doc, pkg)
    else:
        reaching = [c for c in changes if not _only_docs(c) and not _torch_only(c, pkg)]
    env_old = _old_env(records.document)

    calls: list[UnitCall] = []
    pending: list[tuple[history.UnitRecord, str, str]] = []  # (unit, outcome if the object cache has it, why)
    if not ctx.settings.objcache:
        calls = [UnitCall(u.name, COMPILE, cost(u, COMPILE), "the object cache is off", u.name) for u in records.units]
        return UnitsPlan(tuple(calls), records.time, last, remote="", counts=_counts(calls))
    moved = records.root != _canonical(pkg) and records.key != key
    if reaching or moved:
        why = reaching[0] if reaching else "the build directory moves with the action key (prefix-map builds)"
        for u in records.units:
            said = _flag(why, env_old, [u.command]) if reaching else why
            calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), said, u.name))
        return UnitsPlan(tuple(calls), records.time, last, counts=_counts(calls))

    same_tree = records.document.get("sources") == doc.get("sources") and records.document.get("patches") == doc.get(
        "patches"
    )
    local = ctx.cache.objects
    # Where none of the package's entries is in the object cache (a cold build with the records of another,
    # an emptied cache) and there is no remote to look at, every unit compiles whatever its files say: no
    # tree is staged and no file hashed.
    absent = (
        remote_sizes is None
        and any(u.outcome != "uncached" for u in records.units)
        and not any(
            u.outcome != "uncached" and u.manifest and u.result and objcache.entry_path(local, u.result).is_file()
            for u in records.units
        )
    )
    hashes = Hashes()
    with tempfile.TemporaryDirectory(prefix="reprostack-plan-") as scratch:
        view: TreeView | str | None = None
        if not same_tree and not absent:
            view = staged_view(ctx, pkg, Path(scratch))
            if isinstance(view, str):
                notes.append(f"units not compared: {view}")

        def how(i: int) -> str:
            """How file ``i`` differs now: "" (as recorded, or the same by construction: a file the build
            writes itself follows from the rest; a file of the same staged tree), ``comments`` (only they
            changed), ``changed`` or ``gone``."""
            path, sha, code = records.files[i]
            if not sha or (view is None and not path.startswith("/")):
                return ""
            where = Path(path) if path.startswith("/") else view.path(path) if isinstance(view, TreeView) else None
            now = hashes.sha256(where) if where is not None else None
            if where is None or now is None:
                return "gone"
            if now == sha:
                return ""
            return "comments" if code and hashes.code(where) == code else "changed"

        compilers_now = {path: (hashes.sha256(Path(real_compiler(path))) or "") for path in records.compilers}
        for u in records.units:
            if u.outcome == "uncached":
                calls.append(
                    UnitCall(u.name, COMPILE, cost(u, COMPILE), f"the object cache does not cache it ({u.why})", u.name)
                )
                continue
            if absent and u.manifest and u.result:
                calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), ABSENT, u.name))
                continue
            if isinstance(view, str) and any(not records.files[i][0].startswith("/") for i in u.inputs):
                calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), "its sources are not known yet", u.name))
                continue
            if u.compiler and compilers_now.get(u.compiler, "") != records.compilers.get(u.compiler, ""):
                gone = "is gone" if not compilers_now.get(u.compiler) else "changed"
                calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), f"compiler {u.compiler} {gone}", u.name))
                continue
            changed: list[str] = []
            code_changed: list[str] = []
            for i in u.inputs:
                found = how(i)
                if found:
                    changed.append(records.files[i][0])
                if found in ("gone", "changed"):
                    code_changed.append(f"{records.files[i][0]} {'is gone' if found == 'gone' else 'changed'}")
            if not u.manifest or not u.result:
                calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), "no object-cache key was recorded", u.name))
            elif code_changed:
                more = f" (and {len(code_changed) - 1} more)" if len(code_changed) > 1 else ""
                calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), code_changed[0] + more, u.name))
            elif changed:
                more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
                pending.append((u, PREPROCESSED, f"{changed[0]} changed in its comments only{more}"))
            else:
                pending.append((u, HIT, ""))

    # The object cache: is the entry there (here, else on the remote)?
    missing: list[tuple[history.UnitRecord, str, str]] = []
    for u, outcome, why in pending:
        result_here = objcache.entry_path(local, u.result).is_file()
        manifest_here = objcache.entry_path(local, u.manifest).is_file()
        if result_here and (manifest_here or outcome == PREPROCESSED):
            calls.append(UnitCall(u.name, outcome, cost(u, outcome), why, preprocess_name(u) if outcome != HIT else ""))
        elif result_here:
            calls.append(
                UnitCall(u.name, PREPROCESSED, cost(u, PREPROCESSED), "its manifest is not in the object cache",
                         preprocess_name(u))
            )  # fmt: skip
        else:
            missing.append((u, outcome, why))
    remote = ""
    if missing and remote_sizes is not None:
        sizes, rtt = remote_sizes([u.result for u, _, _ in missing])
        remote = "checked"
        for u, outcome, why in missing:
            size = sizes.get(u.result)
            if size is None:
                calls.append(
                    UnitCall(u.name, COMPILE, cost(u, COMPILE), "not in the object cache here or on the remote", u.name)
                )
                continue
            fetch = 2 * rtt + size / REMOTE_RATE
            if outcome == PREPROCESSED:
                calls.append(UnitCall(u.name, PREPROCESSED, cost(u, PREPROCESSED) + fetch, why, preprocess_name(u)))
            else:
                calls.append(UnitCall(u.name, REMOTE, cost(u, HIT) + fetch, "on the remote object cache"))
    else:
        for u, _outcome, _why in missing:
            calls.append(UnitCall(u.name, COMPILE, cost(u, COMPILE), ABSENT, u.name))
    known = {os.path.basename(records.files[u.inputs[0]][0]) for u in records.units if u.inputs}
    if isinstance(view, TreeView) and view.touched:
        new = sorted(
            rel for rel in view.touched
            if os.path.splitext(rel)[1] in SOURCES and os.path.basename(rel) not in known and view.path(rel) is not None
        )  # fmt: skip
        if new:
            notes.append(
                f"not counted: {', '.join(new[:3])}{' …' if len(new) > 3 else ''}, new source file(s) a patch adds"
            )
    order = {u.name: i for i, u in enumerate(records.units)}
    calls.sort(key=lambda c: order.get(c.name, 0))
    return UnitsPlan(
        tuple(calls),
        records.time,
        last,
        tuple(notes),
        remote=remote,
        stage_s=time.monotonic() - started,
        counts=_counts(calls),
    )


class RemoteSizes:
    """The sizes of ccache entries on the remote object cache (HEAD requests, a few at a time), and the round
    trip one took; a remote that does not answer has none of them."""

    def __init__(self, remote: Any) -> None:
        self.remote = remote

    def __call__(self, keys: Sequence[str]) -> tuple[dict[str, int | None], float]:
        trips: list[float] = []

        def one(key: str) -> tuple[str, int | None]:
            started = time.monotonic()
            size = self.remote.size_of(objcache.remote_entry(key))
            trips.append(time.monotonic() - started)
            return key, size

        with ThreadPoolExecutor(max_workers=8) as pool:
            found = dict(pool.map(one, keys))
        return found, (statistics.median(trips) if trips else 0.0)


def _counts(calls: Sequence[UnitCall]) -> dict[str, int]:
    return {o: sum(1 for c in calls if c.outcome == o) for o in OUTCOMES}


def _torch_only(change: str, pkg: Package) -> bool:
    return change.startswith(("torch ", "torch's ")) and not pkg.needs_torch


def _canonical(pkg: Package) -> str:
    return str(reproducible.canonical_dir(pkg.name))


def for_forecast(plan: UnitsPlan) -> UnitForecast:
    """``plan`` as the forecast takes it."""
    return UnitForecast(next=tuple((u.name, u.seconds, u.memory_as) for u in plan.units), last=plan.last)
