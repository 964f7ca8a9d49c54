"""Compiles on a real Ray cluster (tasks/engine/cluster.py): a head and worker nodes started with ``ray start`` on
loopback, each with its own CPU count, as a user's cluster would be.

The example lock's compiled packages build with their compile units on the worker nodes (units.log and
trace.json say where), into the same wheels as a local build; a worker killed mid-build (its raylet,
SIGKILL) costs the build nothing but a move; a compile SIGKILLed on a worker (the OOM killer's signal) runs
once more with room; a node whose compiler is another version (a worker started
in a mount namespace where ``c++`` is another program) is refused by name; an address where no head
answers is one warning and a local build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HAVE_HEADERS,
    HAVE_NVCC,
    QUICK,
    Workspace,
    make_workspace,
    require,
    shas,
    warm_workspace,
)
from serve import FixtureServer

from tasks.core import procfs

HAVE_RAY = importlib.util.find_spec("ray") is not None
RAY = Path(sys.executable).parent / "ray"

#: Quick failure detection, so that a killed worker is known dead in seconds, not half a minute.
RAY_ENV = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "4",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}

#: How often a node is started before the fixture gives up, and how long one ``ray start`` may take. A node's
#: raylet gives its dashboard agent 15 s to report its port and aborts when it misses that (Ray has no setting for
#: it); ``ray start`` then waits out its own 30 s for the raylet to join the GCS and fails with "the GCS has become
#: overloaded". On a host whose cores are all busy the agent's Python start-up can pass 15 s: such a start is
#: stopped (every process of its session) and made again.
START_TRIES = 4
START_TIMEOUT = 300

#: A module that declines to import, first on the cluster's PYTHONPATH. jsonschema, which every Ray process imports,
#: imports rfc3987_syntax where it is installed (jsonschema[format-nongpl], which the test extra's cyclonedx
#: json-validation asks for), and that builds a Lark grammar as it loads: some 2 s of CPU, three quarters of
#: ``import ray``, in each of a node's Python processes (its agents, log monitor, Ray workers). Without it jsonschema
#: only lacks the "iri" format check, which Ray's schemas do not use; a node's agents start in a quarter of the time.
SLOW_IMPORT = "rfc3987_syntax"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayCluster:
    """A Ray head (no CPUs: it takes no compiles) and worker nodes, on this host, stopped at the end. Each node is
    started in a session of its own: the node's processes (its raylet, agents, log monitor, the Ray workers they
    start and the compiles those run) are the members of that session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_ENV)
        stubs = root / "python-path"
        stubs.mkdir(exist_ok=True)
        (stubs / f"{SLOW_IMPORT}.py").write_text('raise ImportError("left out of the test cluster (SLOW_IMPORT)")\n')
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH", "")) if p)
        self.sessions: dict[str, int] = {}  # node name -> the session its ``ray start`` began
        failed: list[str] = []
        for _ in range(START_TRIES):  # each try on ports of its own: a stopped head's may not be free yet
            self.port = _free_port()
            self.address = f"127.0.0.1:{self.port}"  # the head's GCS
            self.client = f"ray://127.0.0.1:{_free_port()}"  # Ray Client's server on the head
            self.temp = Path(f"/tmp/rt{os.getpid()}-{self.port}")  # Ray's sockets: a short path
            error = self._start(
                "head", "--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
                f"--temp-dir={self.temp}", "--object-store-memory=100000000",
                f"--ray-client-server-port={self.client.rsplit(':', 1)[1]}",
            )  # fmt: skip
            if error is None:
                return
            failed.append(error)
            shutil.rmtree(self.temp, ignore_errors=True)
        raise AssertionError(f"the head did not start in {START_TRIES} tries:\n" + "\n".join(failed))

    def _start(self, name: str, *args: str, prefix: tuple[str, ...] = ()) -> str | None:
        """``ray start`` node ``name`` in a session of its own: None once the node has joined the cluster, else
        what went wrong, with every process of that start stopped."""
        command = [*prefix, str(RAY), "start", f"--node-name={name}", *args]
        proc = subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(killed: still running after {START_TIMEOUT} s)"
        if proc.returncode == 0:
            self.sessions[name] = proc.pid
            return None
        _kill_session(proc.pid)
        return f"{' '.join(command)} ({proc.returncode}):\n{out}\n{err}"

    def add_worker(self, name: str, cpus: int = 1, prefix: tuple[str, ...] = ()) -> None:
        """Start worker node ``name``; a start that fails is stopped and made again (see START_TRIES)."""
        failed: list[str] = []
        for _ in range(START_TRIES):
            error = self._start(
                name, f"--address={self.address}", f"--num-cpus={cpus}", "--object-store-memory=100000000",
                prefix=prefix,
            )  # fmt: skip
            if error is None:
                return
            failed.append(error)
        raise AssertionError(f"worker {name} did not start in {START_TRIES} tries:\n" + "\n".join(failed))

    def kill_node(self, name: str) -> None:
        """Lose the node as a machine is lost: every process of its session (its raylet, and its Ray workers,
        which a raylet's death alone leaves running a task already handed to them), all at once."""
        _kill_session(self.sessions[name])

    def stop(self) -> None:
        """Stop this cluster's processes (not another Ray on the host): its nodes' sessions and everything
        started under its temp dir."""
        mine = str(self.temp).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if mine in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                continue
        for sid in self.sessions.values():
            _kill_session(sid)
        time.sleep(1)
        shutil.rmtree(self.temp, ignore_errors=True)


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid``, a ``ray start``'s. That ``ray start`` has ended: a session whose
    leader runs is another's, which got the number since (none, then)."""
    members = [p for p in procfs.processes() if p.sid == sid and p.state != "Z"]
    return [] if any(p.pid == sid for p in members) else [p.pid for p in members]


def _kill_session(sid: int) -> None:
    """Kill every process of session ``sid`` at once, and wait until they are gone (10 s at most). All are
    stopped before any is killed: a Ray worker that saw its compile die first would report it failed (a busy
    host leaves it the time to, between two kills), where a machine that is lost reports nothing."""
    stopped: set[int] = set()
    while more := set(_session(sid)) - stopped:  # until none is left running to start another
        for pid in more:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= more
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _other_compiler(root: Path) -> tuple[str, ...] | None:
    """A command prefix that runs a worker node where ``c++`` (the build's C++ compiler, at its path) is
    another program, reporting another version: a mount namespace (None where one cannot be made here)."""
    cxx = shutil.which("c++")
    if cxx is None or shutil.which("unshare") is None:
        return None
    fake = root / "other-c++"
    fake.write_text("#!/bin/sh\necho 'c++ (Other) 99.1.0'\nexit 1\n")
    fake.chmod(0o755)
    real = os.path.realpath(cxx)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {fake} {real} && {cxx} --version"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 1 or "Other" not in probe.stdout:
        return None
    return ("unshare", "-m", "sh", "-c", f'mount --bind {fake} {real} && exec "$0" "$@"')


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RayCluster, bool]]:
    """The cluster: worker-a and worker-b (one CPU each), and, where a mount namespace can be made,
    worker-odd, whose ``c++`` is another version."""
    if not HAVE_RAY:
        require("Ray is not installed (pip install -e '.[cluster]')")
    if not HAVE_NVCC or not HAVE_HEADERS:
        require("the example's compiled packages need nvcc and Python's C headers")
    root = tmp_path_factory.mktemp("ray")
    cluster = RayCluster(root)
    try:
        cluster.add_worker("worker-a")
        cluster.add_worker("worker-b")
        odd = _other_compiler(root)
        if odd is not None:
            cluster.add_worker("worker-odd", prefix=odd)
        yield cluster, odd is not None
    finally:
        cluster.stop()


def _units(ws: Workspace) -> list[dict[str, str]]:
    """The units.log lines of the workspace's runs: event, package, unit and node (if any)."""
    out = []
    for line in (ws.root / "build" / "logs" / "units.log").read_text().splitlines():
        if line.startswith("#"):
            continue
        words = line.split()
        node = re.search(r" node=(\S+)", line)
        out.append({"event": words[1], "package": words[2], "unit": words[3], "node": node.group(1) if node else ""})
    return out


@pytest.fixture(scope="module")
def cluster_build(
    ray_cluster: tuple[RayCluster, bool], tmp_path_factory: pytest.TempPathFactory, server: FixtureServer
) -> tuple[Workspace, subprocess.CompletedProcess[str]]:
    """The example's quick profile built from an empty cache with its compiles on the cluster, joined
    through Ray Client (``ray://``; the other tests join at the head's GCS address)."""
    cluster, _ = ray_cluster
    root = tmp_path_factory.mktemp("on-cluster")
    ws = make_workspace(root / "ws", root / "cache", server.url)
    res = ws.doit("wheels", "profile=quick", f"cluster={cluster.client}", timeout=1800)
    return ws, res


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_compiles_run_on_the_worker_nodes_into_the_wheels_of_a_local_build(
    cluster_build: tuple[Workspace, subprocess.CompletedProcess[str]], tmp_path: Path, server: FixtureServer
) -> None:
    ws, res = cluster_build
    assert "compiles on the Ray cluster" in res.stdout, res.stdout
    units = _units(ws)
    started = [u for u in units if u["event"] == "start"]
    remote = [u for u in started if u["node"]]
    assert {u["node"] for u in remote} <= {"worker-a", "worker-b"}, units
    assert {u["package"] for u in remote} >= {"repro_cuda", "repro_pybind"}, units  # both compiled packages
    assert any(u["unit"].endswith(".o") for u in remote), units
    here = [u for u in started if not u["node"]]  # links and preprocessor runs stay here; compiles do not
    assert all(u["unit"].endswith((".so", ".E")) for u in here), units
    trace = json.loads((ws.root / "build" / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert tracks >= {"this host"} and tracks & {"node worker-a", "node worker-b"}, tracks
    on_nodes = [e for e in trace["traceEvents"] if e.get("cat") == "compile" and "node" in e.get("args", {})]
    assert on_nodes, trace

    local = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    local.doit("wheels", "profile=quick", "cluster=off")
    assert "Ray cluster" not in (local.root / "build" / "logs" / "units.log").read_text()
    assert shas(ws) == shas(local)
    assert sorted(shas(ws)) == QUICK


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_a_node_with_another_compiler_is_refused_by_name(
    ray_cluster: tuple[RayCluster, bool], cluster_build: tuple[Workspace, subprocess.CompletedProcess[str]]
) -> None:
    _, odd = ray_cluster
    if not odd:
        require("a worker with another compiler needs a mount namespace (unshare -m, as root)")
    ws, res = cluster_build
    said = res.stdout + res.stderr
    line = next((x for x in said.splitlines() if "worker-odd" in x), "")
    assert "refused" in line and "cxx is 'c++ (Other) 99.1.0' there" in line, said
    assert all(u["node"] != "worker-odd" for u in _units(ws))


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_a_worker_killed_mid_build_does_not_fail_it(
    ray_cluster: tuple[RayCluster, bool], tmp_path: Path, server: FixtureServer
) -> None:
    cluster, _ = ray_cluster
    cluster.add_worker("worker-c")
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    log = ws.root / "build" / "logs" / "units.log"
    killed: list[str] = []

    def kill_first_remote_unit() -> None:  # the first node that starts a compile loses it
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            text = log.read_text() if log.exists() else ""
            m = re.search(r" start \S+ \S+\.o .* node=(worker-[abc])\b", text)
            if m:
                cluster.kill_node(m.group(1))
                killed.append(m.group(1))
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_first_remote_unit, daemon=True)
    watcher.start()
    res = ws.doit("wheels", "profile=quick", f"cluster={cluster.address}", timeout=1800)
    watcher.join(timeout=5)
    assert killed, res.stdout
    moved = [u for u in _units(ws) if u["event"] == "moved"]
    assert moved and all(u["node"] != killed[0] for u in moved), (killed, _units(ws), res.stdout, res.stderr)
    assert f"node {killed[0]} lost a compile" in res.stderr, res.stderr
    assert sorted(shas(ws)) == QUICK


def _command_lines() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of the processes running now (tasks/core/procfs.py's table)."""
    found = {}
    for proc in procfs.processes():
        with contextlib.suppress(OSError):
            found[proc.pid] = (proc.ppid, Path(f"/proc/{proc.pid}/cmdline").read_bytes())
    return found


def _compiles_under_ray_workers(path: Path) -> dict[int, str]:
    """pid -> command line of the compilers a Ray worker runs for the workspace at ``path`` (the worker's
    children: the gate's trampoline execs the compiler in place), known by their environment, the build's,
    which names ``path`` for the compile's whole life (the command line names it only until the compiler is
    exec'd in the stage's mount namespace: milliseconds, which a watcher on a busy host misses)."""
    running = _command_lines()
    found = {}
    for pid, (ppid, args) in running.items():
        if running.get(ppid, (0, b""))[1].startswith(b"ray::"):
            with contextlib.suppress(OSError):
                if str(path).encode() in args + Path(f"/proc/{pid}/environ").read_bytes():
                    found[pid] = args.replace(b"\0", b" ").decode(errors="replace")
    return found


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_a_compile_killed_on_a_worker_runs_once_more_with_room_as_here(
    ray_cluster: tuple[RayCluster, bool], tmp_path: Path, server: FixtureServer
) -> None:
    """SIGKILL, the kernel OOM killer's signal, to a compile running on a worker node: the gate counts it
    a kill for memory, asks again with room for twice its peak (a ``retry`` in units.log), and the build
    ends with the wheels of a local build."""
    cluster, _ = ray_cluster
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    killed: list[str] = []

    def kill_first_remote_compile() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            for pid, args in _compiles_under_ray_workers(ws.root).items():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(args)
                    break
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_first_remote_compile, daemon=True)
    watcher.start()
    res = ws.doit("wheels", "profile=quick", f"cluster={cluster.address}", timeout=1800)
    watcher.join(timeout=5)
    assert killed, res.stdout
    retried = [u for u in _units(ws) if u["event"] == "retry"]
    assert len(retried) == 1 and retried[0]["node"].startswith("worker-"), (killed, _units(ws))
    assert retried[0]["unit"] in killed[0], (retried, killed)
    logs = "".join(p.read_text() for p in (ws.root / "build" / "logs").glob("build-*.log"))
    assert f"{retried[0]['unit']} ({retried[0]['package']}) was killed for memory" in logs, logs
    assert sorted(shas(ws)) == QUICK


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_a_head_that_does_not_answer_is_one_warning_and_a_local_build(
    tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    if not HAVE_RAY:
        require("Ray is not installed (pip install -e '.[cluster]')")
    ws = warm_workspace(tmp_path, quick_cache, server)
    res = ws.doit("wheels", "profile=quick", f"cluster=127.0.0.1:{_free_port()}")
    warnings = [x for x in res.stderr.splitlines() if "cluster=" in x]
    assert len(warnings) == 1 and "the head does not answer" in warnings[0] and "building here" in warnings[0], (
        res.stderr
    )
    assert sorted(shas(ws)) == QUICK


def _processes_under(path: Path) -> list[str]:
    """The command lines of live processes that name ``path`` (a compile of that workspace: its stage)."""
    return [
        args.replace(b"\0", b" ").decode(errors="replace")
        for pid, (_, args) in _command_lines().items()
        if str(path).encode() in args and pid != os.getpid()
    ]


@pytest.mark.needs_nvcc
@pytest.mark.needs_headers
def test_ctrl_c_cancels_the_compiles_on_the_cluster(
    ray_cluster: tuple[RayCluster, bool], tmp_path: Path, server: FixtureServer
) -> None:
    cluster, _ = ray_cluster
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    log = ws.root / "build" / "logs" / "units.log"
    proc = ws.popen("wheels", "profile=quick", f"cluster={cluster.address}")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if re.search(r" start \S+ \S+\.o .* node=worker-", log.read_text() if log.exists() else ""):
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[0]
    time.sleep(0.5)  # the compile is on its node now
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "interrupted" in out, out
    assert [u for u in _units(ws) if u["event"] == "cancelled" and u["node"].startswith("worker-")], _units(ws)
    left = _processes_under(tmp_path)
    for _ in range(15):  # a cancelled task's worker takes a moment to go (a compile here takes longer)
        if not left:
            break
        time.sleep(0.2)
        left = _processes_under(tmp_path)
    assert left == [], left
