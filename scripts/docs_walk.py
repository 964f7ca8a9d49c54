#!/usr/bin/env python3
"""The docs walk: run the shell blocks of the user's pages as written, in order, on two hosts' roles.

Users copy the pages' commands; the developers' own runs used this checkout's venv, so a page could be wrong
while every test passed (issue 38). This script runs the fenced shell blocks of docs/real-stack.md,
docs/offline.md and docs/your-package.md (or the pages given) as a user would, each with
``bash -euo pipefail``, and fails at the first command that fails, naming the page, the block and the command.

The pages mark each shell block with its role in the info string (docs/development.md, "The docs walk")::

    ```bash host=mirror      a host with network (the checkout, `doit mirror`, `reprostack lock`)
    ```bash host=node        the offline GPU host or cluster node (the tool installed from tool/, builds, installs)
    ```bash host=both        both (the page's variables)
    ```bash no-walk          not run: an alternative, a step by hand, another site's command

Other fences (``toml``, ``text``, ``console``) are never run; a ``bash``/``sh``/``shell`` block without one of
these marks is refused. Placeholders are variables in capitals that a page sets with a default,
``MIRROR=${MIRROR:-/shared/reprostack-mirror}``: the walk sets them from its environment; nothing else of a
block is changed. Each host keeps its shell's state from block to block of a page (the directory and the
variables), as a terminal does; every page starts afresh (the mirror host in the checkout, the node in its
home). A command line (a line with its continuations, or a whole ``if``/``for``) that ends non-zero fails
the walk even inside an ``a && b`` list, where ``set -e`` alone would go on; a block passes only when its shell
ran past its last line (one that ends early, ``exit 0`` or ``exec``, fails at the line where it stopped).

The node runs apart from the mirror host:

- ``--node docker``: in a container with ``--network none`` of ``--node-image`` (default: the image
  ``SUITE=trixie scripts/make-base-image.sh node`` makes: Debian trixie's Python 3.13, a compiler, git), with
  the scratch directory (and every directory a page variable names) mounted at the same path;
- ``--node local`` (where docker is not usable, and on a GPU host): on this host, with a home of its own
  in the scratch directory, without this checkout's venv, and without network for the tools that honour
  the usual variables (``PIP_NO_INDEX=1``, proxies pointed at a closed port, git's protocols to ``file``);
- ``--node auto`` (the default): docker where ``docker info`` answers, else local (the walk says so).

CI has no GPU host, so its node stands in for one: ``--fake-gpu 9.0`` gives it a stand-in NVIDIA driver
(tests/fixtures/fake_libcuda.c, compiled here; ``REPRO_LIBCUDA`` names it to preflight) with one GPU of that
compute capability, ``--fake-torch 2.11.0`` a stand-in torch in the container's base Python (the
distribution's metadata and version attributes, no code: what the pages' "venv that sees the base's torch"
finds). The walk lists them with the hosts.

    python3 scripts/docs_walk.py --list                             # the blocks, their lines and roles
    MIRROR=... LOCKDIR=... PROFILE=... python3 scripts/docs_walk.py --scratch /tmp/walk
    python3 scripts/docs_walk.py docs/real-stack.md --roles node --node local --summary walk.md

Prints each block's output (also to ``SCRATCH/walk/log.txt``), then the hosts and a summary: each block's page,
line, host, exit status and seconds, then each command line of a second or more with its seconds
(``--summary FILE`` writes the tables too, ``--json FILE`` everything as JSON). Exit status 0 when every block
ran and passed, 1 when one failed, 2 when a page is not walkable or the walk cannot start. Standard library only
(it runs on the GPU host, with no checkout venv).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
PAGES = ("docs/real-stack.md", "docs/offline.md", "docs/your-package.md")
ROLES = ("mirror", "node")
MARKS = "host=mirror, host=node, host=both, no-walk"
SHELLS = ("bash", "sh", "shell")
#: A page's variable: ``NAME=${NAME:-default}`` (``export`` allowed) at the start of a line of a walked block.
VARIABLE = re.compile(r"^\s*(?:export\s+)?([A-Z][A-Z0-9_]*)=\"?\$\{\1:-", re.M)
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
#: Environment of a local node: what is dropped from this host's, what is set.
LOCAL_DROP = ("PIP_", "REPRO_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "UV_")
NO_NETWORK = {
    "PIP_NO_INDEX": "1",
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "GIT_ALLOW_PROTOCOL": "file",
    # A closed port (discard): a tool that honours the proxy variables fails at once instead of reaching out.
    **dict.fromkeys(
        ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"), "http://127.0.0.1:9"
    ),
    "no_proxy": "",
    "NO_PROXY": "",
}
#: Shell variables a block's state does not carry to the next (bash's own, and the walk's).
_SPECIAL = (
    "BASH*|COLUMNS|COMP_*|DIRSTACK|EPOCH*|EUID|FUNCNAME|GROUPS|HISTCMD|HOSTNAME|IFS|LINENO|LINES|OLDPWD|OPTARG"
    "|OPTERR|OPTIND|PIPESTATUS|PPID|PS4|PWD|RANDOM|SECONDS|SHELLOPTS|SHLVL|SRANDOM|UID|_|__walk_*"
)


class WalkError(Exception):
    """The walk cannot start: a page is not walkable, a host cannot be set up (exit status 2)."""


@dataclass(frozen=True)
class Unit:
    """One command line of a block as a user types it: a line with its continuations, or a whole compound."""

    line: int  # in the page
    text: str


@dataclass(frozen=True)
class Block:
    page: str
    number: int  # 1-based, among the page's fenced blocks
    line: int  # the opening fence's line
    info: str
    role: str  # mirror, node, both, or "" (not run)
    text: str

    @property
    def runs_on(self) -> tuple[str, ...]:
        return ROLES if self.role == "both" else (self.role,) if self.role else ()

    def label(self) -> str:
        return f"{self.page}:{self.line} (block {self.number}, {self.info.strip()})"


def parse_page(path: Path, name: str = "") -> list[Block]:
    """The fenced blocks of a Markdown page; :class:`WalkError` for a shell block without its role."""
    name = name or str(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group("indent")), m.group("fence"), m.group("info").strip()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        words = info.split()
        lang = words[0] if words else ""
        marks = words[1:]
        role = ""
        if lang in SHELLS:
            roles = [w.split("=", 1)[1] for w in marks if w.startswith("host=")]
            others = [w for w in marks if not w.startswith("host=") and w != "no-walk"]
            where = f"{name}:{start + 1}"
            if others:
                problems.append(f"{where}: unknown mark {' '.join(others)} (host=mirror|node|both, no-walk)")
            if ("no-walk" in marks) == bool(roles) or len(roles) > 1:
                problems.append(f"{where}: a {lang} block needs exactly one of {MARKS}")
            elif roles:
                role = roles[0]
                if role not in (*ROLES, "both"):
                    problems.append(f"{where}: host={role}: the roles are mirror, node and both")
        blocks.append(Block(name, len(blocks) + 1, start + 1, info, role, "\n".join(body) + "\n"))
    if problems:
        raise WalkError("\n".join(problems))
    return blocks


def split_units(block: Block) -> list[Unit]:
    """The block's command lines, each as bash parses it whole (``bash -n``): a line ending in ``\\``, ``&&`` or
    ``|``, or opening an ``if``, takes the next ones with it. Comments and blank lines are no units."""
    units = []
    pending: list[str] = []
    first = 0
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            first = block.line + 1 + offset
        pending.append(line)
        text = "\n".join(pending)
        if text.rstrip().endswith("\\"):
            continue
        if subprocess.run(["bash", "-n", "-c", text], capture_output=True, check=False).returncode == 0:
            units.append(Unit(first, text))
            pending = []
    if pending:
        raise WalkError(f"{block.label()}: bash cannot parse the block from line {first}: {pending[0].strip()}")
    return units


def variables(blocks: list[Block]) -> list[str]:
    """The page's variables: the names its walked blocks set as ``NAME=${NAME:-default}``."""
    names: list[str] = []
    for b in blocks:
        if b.role:
            names += [n for n in VARIABLE.findall(b.text) if n not in names]
    return names


# --------------------------------------------------------------------------- hosts


@dataclass
class Host:
    """Where a role's blocks run: how to start bash there, with which environment, in which first directory."""

    role: str
    start: Path
    env: dict[str, str]
    describe: str = ""
    container: str = ""  # a node's container ID (docker), else local

    def argv(self, script: str, extra: dict[str, str]) -> list[str]:
        if not self.container:
            return ["bash", "-euo", "pipefail", "-c", script]
        env = [f"--env={k}={v}" for k, v in sorted({**self.env, **extra}.items())]
        return ["docker", "exec", *env, self.container, "bash", "-euo", "pipefail", "-c", script]

    def popen(self, script: str, extra: dict[str, str]) -> subprocess.Popen[str]:
        env = {**os.environ, "LC_ALL": "C.UTF-8"} if self.container else {**self.env, **extra}
        return subprocess.Popen(
            self.argv(script, extra), env=env, cwd=str(self.start) if not self.container else None,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip

    def query(self, command: str) -> str:
        """One line of what ``command`` prints on this host ('' when it fails)."""
        proc = self.popen(command, {})
        out, _ = proc.communicate()
        return out.strip().splitlines()[-1] if proc.returncode == 0 and out.strip() else ""


def _outside_checkout(env: dict[str, str], checkout: Path) -> dict[str, str]:
    """``env`` with this checkout's venv taken off: no VIRTUAL_ENV, no PATH entry inside the checkout."""
    out = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    keep = []
    for entry in env.get("PATH", os.defpath).split(os.pathsep):
        try:
            inside = Path(entry).resolve().is_relative_to(checkout)
        except (OSError, ValueError):
            inside = False
        if entry and not inside:
            keep.append(entry)
    out["PATH"] = os.pathsep.join(keep)
    return out


def mirror_host(checkout: Path) -> Host:
    """The host with network: this one, as it is, in the checkout (less the checkout's venv on PATH)."""
    return Host("mirror", checkout, _outside_checkout(dict(os.environ), checkout), "this host, in the checkout")


def local_node(home: Path, checkout: Path, extra: dict[str, str]) -> Host:
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(LOCAL_DROP)}
    env = _outside_checkout(env, checkout)
    env.update(NO_NETWORK)
    # The node's base stays as it is: packages installed with `pip install --user` are the base's, not the home's.
    user_base = os.environ.get("PYTHONUSERBASE") or str(Path.home() / ".local")
    if Path(user_base, "lib").is_dir():
        env["PYTHONUSERBASE"] = user_base
    env.update(HOME=str(home), **extra)
    env.pop("XDG_CACHE_HOME", None)
    env.pop("XDG_CONFIG_HOME", None)
    return Host("node", home, env, f"this host, home {home}, no network for pip, git and proxied tools")


def docker_usable() -> str:
    """'' when a docker daemon answers here, else why not."""
    if shutil.which("docker") is None:
        return "no docker command"
    res = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        return "docker info: " + (res.stderr.strip().splitlines() or ["failed"])[-1][:200]
    return ""


def node_image(checkout: Path, suite: str) -> str:
    """The node's image made by scripts/make-base-image.sh (cached by its recipe's tag)."""
    say(f"node image: SUITE={suite} bash scripts/make-base-image.sh node (made once, then found by its tag)")
    res = subprocess.run(
        ["bash", str(checkout / "scripts" / "make-base-image.sh"), "node"], env={**os.environ, "SUITE": suite},
        capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if res.returncode != 0:
        raise WalkError(f"scripts/make-base-image.sh node failed:\n{res.stderr[-3000:]}")
    return res.stdout.strip().splitlines()[-1]


def docker_node(home: Path, image: str, mounts: list[Path], extra: dict[str, str]) -> Host:
    """A container that lives as long as this walk: its main process reads the walk's pipe, so when the walk
    ends, killed or not, the pipe closes, the process ends and ``--rm`` removes the container."""
    home.mkdir(parents=True, exist_ok=True)
    name = f"docs-walk-{os.getpid()}-{int(time.time())}"
    argv = ["docker", "run", "--interactive", "--rm", "--name", name, "--network", "none"]
    for path in sorted(set(mounts)):
        argv.append(f"--volume={path}:{path}")
    env = {"HOME": str(home), "LANG": "C.UTF-8", **extra}
    argv += [f"--env={k}={v}" for k, v in sorted(env.items())]
    argv += ["--workdir", str(home), "--entrypoint", "cat", image]
    keeper = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _KEEPERS.append(keeper)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = subprocess.run(["docker", "inspect", "--format", "{{.State.Running}}", name], capture_output=True,
                               text=True, check=False, stdin=subprocess.DEVNULL)  # fmt: skip
        if state.stdout.strip() == "true":
            return Host("node", home, env, f"a docker container of {image[:19]}, --network none, home {home}", name)
        if keeper.poll() is not None:
            err = keeper.stderr.read().decode(errors="replace") if keeper.stderr else ""
            raise WalkError(f"cannot start the node's container: {err.strip()[-500:]}")
        time.sleep(0.2)
    raise WalkError(f"the node's container {name} did not start within 300 s")


#: The `docker run` processes whose stdin keeps a node's container alive (closed by :meth:`Walk.close`).
_KEEPERS: list[subprocess.Popen[bytes]] = []


#: A stand-in torch for the node's base Python: the distribution's metadata and the attributes preflight and the
#: toolchain probe read (``__version__``, ``version.cuda``, ``_C._GLIBCXX_USE_CXX11_ABI``), no code of torch's.
STAND_IN_TORCH = r"""
import os, sys, sysconfig
version = sys.argv[1]
site = sysconfig.get_paths()["purelib"]
info = "torch-%s.dist-info" % version
files = {
    "torch/__init__.py": "# A stand-in for torch (scripts/docs_walk.py --fake-torch): no code of torch's.\n"
                         "from torch import _C, version\n__version__ = %r\n" % version,
    "torch/version.py": "cuda = None\n__version__ = %r\n" % version,
    "torch/_C.py": "_GLIBCXX_USE_CXX11_ABI = True\n",
    info + "/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: %s\n" % version,
    info + "/INSTALLER": "docs-walk\n",
}
files[info + "/RECORD"] = "".join("%s,,\n" % n for n in sorted(files)) + info + "/RECORD,,\n"
for name, text in files.items():
    path = os.path.join(site, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
print(site)
"""


def fake_torch(host: Host, version: str) -> str:
    """Install the stand-in torch into the node container's base Python; where it went."""
    res = subprocess.run(["docker", "exec", host.container, "python3", "-c", STAND_IN_TORCH, version],
                         capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)  # fmt: skip
    if res.returncode != 0:
        raise WalkError(f"cannot put the stand-in torch into the node's Python: {res.stderr.strip()[-500:]}")
    return res.stdout.strip()


def fake_driver(dest: Path, checkout: Path) -> Path:
    """libcuda.so.1 from tests/fixtures/fake_libcuda.c, compiled here: a stand-in driver for a node without GPU."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise WalkError("--fake-gpu needs a C compiler (cc) to build the stand-in libcuda.so.1")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "libcuda.so.1"
    src = checkout / "tests" / "fixtures" / "fake_libcuda.c"
    argv = [cc, "-shared", "-fPIC", "-o", str(out), str(src)]
    res = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise WalkError(f"cannot compile {src}: {res.stderr.strip()[-500:]}")
    return out


# --------------------------------------------------------------------------- running a block


def script_for(units: list[Unit], state: Path, fail: Path, times: Path) -> str:
    """The bash script that runs a block's command lines in a host's shell: the state before them, each line
    checked and timed, the state after them (the directory and the variables, for the host's next block)."""
    q = shlex.quote
    clock = '"${EPOCHREALTIME:-$(date +%s.%N)}"'
    lines = [
        f"__walk_state={q(str(state))}; __walk_fail={q(str(fail))}; __walk_times={q(str(times))}; __walk_unit=0",
        'if [ -f "$__walk_state" ]; then . "$__walk_state"; fi',
        'trap \'__walk_rc=$?; printf "%s %s %s\\n" "$__walk_unit" "$__walk_rc" "$BASH_COMMAND" >>"$__walk_fail"\' ERR',
    ]
    for n, unit in enumerate(units, 1):
        lines += [
            f"__walk_unit={n}; printf '%s %s\\n' {n} {clock} >>\"$__walk_times\"",
            unit.text,
            '__walk_rc=$?; if [ "$__walk_rc" != 0 ]; then printf "%s %s\\n" "$__walk_unit" "$__walk_rc" '
            '>>"$__walk_fail"; exit "$__walk_rc"; fi',
        ]
    lines += [
        f"printf '%s %s\\n' end {clock} >>\"$__walk_times\"",
        "trap - ERR",
        "{ for __walk_v in $(compgen -v); do",
        f"    case $__walk_v in {_SPECIAL}) continue ;; esac",
        '    __walk_d=$(declare -p "$__walk_v" 2>/dev/null) || continue',
        "    __walk_f=${__walk_d#declare -}; case ${__walk_f%% *} in *r*) continue ;; esac",
        '    printf "%s\\n" "$__walk_d"',
        "  done",
        "  printf 'cd -- %q\\n' \"$PWD\"",
        '} >"$__walk_state.tmp" && mv -f "$__walk_state.tmp" "$__walk_state"',
    ]
    return "\n".join(lines) + "\n"


#: A block's status when its shell ended with status 0 before the walk's mark after its last line (``exit 0``,
#: ``exec``): the lines after it never ran, and its state is not the host's for the next block.
ENDED_EARLY = "ended early"


@dataclass
class Result:
    page: str
    block: int
    line: int
    role: str
    status: str  # "0", an exit status, ENDED_EARLY, "not run", "skipped"
    seconds: float = 0.0
    failed_line: int = 0
    command: str = ""
    detail: str = ""
    #: (line, seconds, command line) of each command line that ran
    commands: list[tuple[int, float, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("0", "skipped")


@dataclass
class Walk:
    checkout: Path
    scratch: Path
    roles: tuple[str, ...]
    node_mode: str
    image: str
    suite: str
    fake_gpu: str
    fake_torch: str
    log: IO[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    def host(self, role: str, variables: dict[str, str]) -> Host:
        if role in self.hosts:
            return self.hosts[role]
        if role == "mirror":
            host = mirror_host(self.checkout)
        else:
            extra: dict[str, str] = {}
            if self.fake_gpu:
                driver = fake_driver(self.scratch / "walk" / "driver", self.checkout)
                extra.update(REPRO_LIBCUDA=str(driver), FAKE_CUDA_GPUS=self.fake_gpu, FAKE_CUDA_VERSION="13000")
                self.facts.append(
                    f"node driver: a stand-in libcuda.so.1 (tests/fixtures/fake_libcuda.c), GPU {self.fake_gpu}"
                )
            home = self.scratch / "node-home"
            if self.node_mode == "docker":
                mounts = [self.scratch]
                for name, value in variables.items():
                    path = Path(value)
                    if not path.is_absolute() or path == self.scratch or self.scratch in path.parents:
                        continue
                    if path.is_dir():
                        mounts.append(path)
                    elif not path.exists():
                        say(f"warning: {name}={value} does not exist yet and lies outside the scratch directory: "
                            "the node's container will not see it (give a path under --scratch)", self.log)  # fmt: skip
                host = docker_node(home, self.image or node_image(self.checkout, self.suite), mounts, extra)
                if self.fake_torch:
                    site = fake_torch(host, self.fake_torch)
                    self.facts.append(f"node base: a stand-in torch {self.fake_torch} (its metadata and version "
                                      f"attributes, no torch code) in {site}")  # fmt: skip
            else:
                host = local_node(home, self.checkout, extra)
        python = host.query("python3 -c 'import sys; print(sys.version.split()[0])'")
        self.facts.append(f"{role}: {host.describe}; python3 {python or 'not found'}")
        say(f"host {role}: {host.describe}; python3 {python or 'not found'}", self.log)
        self.hosts[role] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            if host.container:
                subprocess.run(["docker", "rm", "-f", host.container], capture_output=True, check=False)
                host.container = ""
        while _KEEPERS:
            keeper = _KEEPERS.pop()
            if keeper.stdin is not None:
                keeper.stdin.close()
            try:
                keeper.wait(timeout=60)
            except subprocess.TimeoutExpired:
                keeper.kill()
                keeper.wait()

    def run_page(self, page: str, blocks: list[Block]) -> bool:
        names = variables(blocks)
        given = {n: os.environ[n] for n in names if n in os.environ}
        for n in names:
            say(f"{page}: {n}=" + (given[n] if n in given else "(the page's default)"), self.log)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", page)
        for block in blocks:
            for role in block.runs_on:
                if role not in self.roles:
                    self.results.append(Result(page, block.number, block.line, role, "skipped",
                                               detail=f"--roles {','.join(self.roles)}"))  # fmt: skip
                    continue
                host = self.host(role, given)
                state = self.scratch / "walk" / "state" / f"{stem}.{role}"
                if not state.exists():
                    state.parent.mkdir(parents=True, exist_ok=True)
                    state.write_text(f"cd -- {shlex.quote(str(host.start))}\n")
                result = self.run_block(block, role, host, state, given)
                self.results.append(result)
                if not result.ok:
                    return False
        return True

    def run_block(self, block: Block, role: str, host: Host, state: Path, given: dict[str, str]) -> Result:
        units = split_units(block)
        fail = state.with_suffix(state.suffix + ".fail")
        times = state.with_suffix(state.suffix + ".times")
        for path in (fail, times):
            path.unlink(missing_ok=True)
        say(f"--- {block.page}:{block.line} block {block.number}, host={role}", self.log)
        started = time.monotonic()
        proc = host.popen(script_for(units, state, fail, times), given)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                self.log.write(line)
                sys.stdout.write(f"  | {line}")
                sys.stdout.flush()
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        seconds = time.monotonic() - started
        result = Result(block.page, block.number, block.line, role, str(proc.returncode), seconds)
        marks = read_marks(times)
        result.commands = command_times(units, marks, time.time())
        # The script marks each command line as it starts and "end" after the last one: a shell that ended
        # without that mark stopped at the last line it marked, whatever its exit status.
        finished = bool(marks) and marks[-1][0] == "end"
        if finished and proc.returncode == 0:
            return result
        if finished:
            result.detail = "after its last line ran"
            return result
        if proc.returncode == 0:
            result.status = ENDED_EARLY
        reports = fail.read_text().splitlines() if fail.exists() else []
        unit_no, command = 0, ""
        if reports:
            parts = reports[-1].split(" ", 2)
            unit_no = int(parts[0]) if parts[0].isdigit() else 0
            command = parts[2] if len(parts) > 2 else ""
        reached = [int(key) for key, _ in marks if key.isdigit()]
        stopped = reached[-1] if reached else unit_no
        if not 0 < stopped <= len(units):
            result.detail = "before its first command (the shell's state)"
            return result
        unit = units[stopped - 1]
        result.failed_line, result.command = unit.line, unit.text
        if result.status == ENDED_EARLY:
            result.detail = (
                f"line {units[stopped].line} and after never ran"
                if stopped < len(units)
                else "before the walk kept its state for the host's next block"
            )
        elif command and unit_no == stopped and not oneline(unit.text).startswith(oneline(command)):
            result.detail = f"the command that failed: {command}"
        return result

    def summary(self) -> str:
        """Each block (page, line, host, exit status, seconds), then each command line of 1 s or more."""
        lines = ["| page | line | host | exit status | seconds |", "|---|---|---|---|---|"]
        for r in self.results:
            took = f"{r.seconds:.1f}" if r.status not in ("skipped", "not run") else ""
            lines.append(f"| {r.page} | {r.line} | {r.role} | {r.status} | {took} |")
        slow = [(r, c) for r in self.results for c in r.commands if c[1] >= 1.0]
        if slow:
            lines += ["", "| page | line | host | seconds | command |", "|---|---|---|---|---|"]
            for r, (line, seconds, text) in slow:
                command = oneline(uncommented(text)).replace("|", "\\|")
                command = command if len(command) <= 100 else command[:97] + "..."
                lines.append(f"| {r.page} | {line} | {r.role} | {seconds:.1f} | `{command}` |")
        return "\n".join(lines) + "\n"


def read_marks(times: Path) -> list[tuple[str, float | None]]:
    """The marks the block's script wrote, in order: (command line's number or "end", when; None where the
    host's clock gave no number)."""
    marks: list[tuple[str, float | None]] = []
    for raw in times.read_text().splitlines() if times.exists() else []:
        key, _, stamp = raw.partition(" ")
        try:
            marks.append((key, float(stamp.replace(",", "."))))
        except ValueError:
            marks.append((key, None))
    return marks


def command_times(
    units: list[Unit], marks: list[tuple[str, float | None]], ended: float
) -> list[tuple[int, float, str]]:
    """(line, seconds, text) of each command line that ran, from the block's timed marks (a line that failed
    lasts until the block ended)."""
    timed = [(key, when) for key, when in marks if when is not None]
    out = []
    for i, (key, when) in enumerate(timed):
        if not key.isdigit() or not 0 < int(key) <= len(units):
            continue
        until = timed[i + 1][1] if i + 1 < len(timed) else ended
        unit = units[int(key) - 1]
        out.append((unit.line, max(0.0, until - when), unit.text))
    return out


def say(text: str, log: IO[str] | None = None) -> None:
    print(f"docs walk: {text}", flush=True)
    if log is not None:
        log.write(f"docs walk: {text}\n")
        log.flush()


def oneline(text: str) -> str:
    """A command line as one line: continuations joined, runs of blanks made one."""
    return " ".join(text.replace("\\\n", " ").split())


def uncommented(text: str) -> str:
    """A command line without its trailing comments (a ``#`` that starts a word, outside quotes)."""
    out, quote = [], ""
    for line in text.splitlines():
        kept: list[str] = []
        for ch in line:
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (not kept or kept[-1].isspace()):
                break
            kept.append(ch)
        out.append("".join(kept).rstrip())
    return "\n".join(out)


def failure_text(r: Result) -> str:
    where = f"{r.page}:{r.line} (block {r.block}, host={r.role})"
    ended = "ended the shell (status 0)" if r.status == ENDED_EARLY else f"exited {r.status}"
    if r.failed_line:
        text = f"FAILED at {where}, line {r.failed_line}: `{oneline(uncommented(r.command))}` {ended}"
    else:
        text = f"FAILED at {where}: {ended}"
    return text + (f"; {r.detail}" if r.detail else "")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the node's container is removed on the way out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="*", help=f"Markdown pages, walked in this order (default: {' '.join(PAGES)})")
    ap.add_argument("--list", action="store_true", help="print the blocks, their lines and roles; run nothing")
    ap.add_argument("--roles", default="mirror,node", help="the roles run here (mirror,node; the others are skipped)")
    ap.add_argument("--node", choices=("auto", "docker", "local"), default="auto", help="where the node's blocks run")
    ap.add_argument("--node-image", default="", help="the node's docker image (default: make-base-image.sh node)")
    ap.add_argument("--node-suite", default="trixie", help="the Debian suite of that default image (trixie: 3.13)")
    ap.add_argument("--fake-gpu", default="", metavar="MAJOR.MINOR", help="a stand-in NVIDIA driver with this GPU")
    ap.add_argument("--fake-torch", default="", metavar="VERSION", help="(docker) a stand-in torch in the node's base")
    ap.add_argument("--scratch", default="", help="the walk's directory (default: a new temporary one, kept)")
    ap.add_argument("--summary", default="", help="also write the summary table (Markdown) to this file")
    ap.add_argument("--json", default="", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    checkout = REPO
    pages = args.pages or [str(checkout / p) for p in PAGES]
    roles = tuple(r for r in args.roles.split(",") if r)
    if not set(roles) <= set(ROLES) or not roles:
        ap.error(f"--roles {args.roles}: give mirror, node or both, comma-separated")
    try:
        parsed = []
        for page in pages:
            path = Path(page)
            if not path.is_file():
                raise WalkError(f"{page}: no such page")
            name = str(path.resolve().relative_to(checkout)) if path.resolve().is_relative_to(checkout) else page
            parsed.append((name, parse_page(path, name)))
    except WalkError as exc:
        print(f"docs walk: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for name, blocks in parsed:
            for b in blocks:
                what = f"host={b.role}" if b.role else "not run"
                print(f"{name}:{b.line}  block {b.number}  {b.info or '(no info)'}  -> {what}")
        return 0
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="docs-walk-")).resolve()
    (scratch / "walk").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(scratch / "walk" / "state", ignore_errors=True)  # every walk starts its shells afresh
    mode = args.node
    if "node" in roles and mode != "local":
        why = docker_usable()
        if why and mode == "docker":
            print(f"docs walk: --node docker: {why}", file=sys.stderr)
            return 2
        mode = "local" if why else "docker"
        if why:
            say(f"the node runs locally, not in a container ({why}): a home of its own, no network for pip and git")
    if args.fake_torch and mode != "docker":
        print(
            "docs walk: --fake-torch writes into the node container's Python: it needs --node docker", file=sys.stderr
        )
        return 2
    log_path = scratch / "walk" / "log.txt"
    signal.signal(signal.SIGTERM, _interrupted)
    with open(log_path, "w", encoding="utf-8") as log:
        walk = Walk(checkout, scratch, roles, mode, args.node_image, args.node_suite, args.fake_gpu, args.fake_torch,
                    log)  # fmt: skip
        say(f"scratch {scratch}; log {log_path}", log)
        ok = True
        try:
            for name, blocks in parsed:
                if not walk.run_page(name, blocks):
                    ok = False
                    break
        except WalkError as exc:
            say(str(exc), log)
            walk.close()
            return 2
        except KeyboardInterrupt:
            say("interrupted", log)
            ok = False
        finally:
            walk.close()
        ran = {(r.page, r.block, r.role) for r in walk.results}
        for name, blocks in parsed:
            for b in blocks:
                for role in b.runs_on:
                    if (name, b.number, role) not in ran:
                        walk.results.append(Result(name, b.number, b.line, role, "not run"))
        table = walk.summary()
        failed = [r for r in walk.results if not r.ok and r.status != "not run"]
        print()
        for fact in walk.facts:
            say(fact, log)
        sys.stdout.write(table)
        log.write(table)
        for r in failed:
            say(failure_text(r), log)
        run = sum(r.status not in ("skipped", "not run") for r in walk.results)
        say(f"{run} blocks run, {len(failed)} failed, "
            f"{sum(r.status == 'skipped' for r in walk.results)} skipped (other roles), "
            f"{sum(r.status == 'not run' for r in walk.results)} not run", log)  # fmt: skip
    if args.summary:
        Path(args.summary).write_text(table, encoding="utf-8")
    if args.json:
        doc: dict[str, Any] = {
            "ok": ok and not failed,
            "facts": walk.facts,
            "results": [r.__dict__ for r in walk.results],
            "failures": [failure_text(r) for r in failed],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
