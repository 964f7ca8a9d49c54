"""The run's job budget with real ninja processes: the jobserver caps all of them together."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require

from tasks.engine import admission
from tasks.engine.jobserver import (
    JobServer,
    killed_for_memory,
    ninja_version,
)
from tasks.outside import ninjaorder
from tasks.outside.gate import ENV_PACKAGE, ENV_PRIORITY, ENV_UNIT_TIMES, ENV_WAIT_LOG
from tasks.store.history import load_memory, record_memory
from tasks.store.history import memory_path as memory_record

JOB = textwrap.dedent(
    """
    import sys, time  # cc -o OUT [SECONDS]
    start = time.time()
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.4)
    with open(sys.argv[2], "w") as fh:
        fh.write(f"{start} {time.time()}")
    """
)


def _fake_compiler(directory: Path) -> Path:
    """A directory holding ``cc``: a "compiler" that sleeps and records when it ran (job.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.py").write_text(JOB)
    cc = directory / "cc"
    cc.write_text(f'#!/bin/sh\nexec {sys.executable} {directory / "job.py"} "$@"\n')
    cc.chmod(0o755)
    return directory


def _ninja_dir() -> str:
    """The PATH entry of a ninja new enough to be a jobserver client (the venv's, from PyPI)."""
    for path in (str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)):
        found = shutil.which("ninja", path=path)
        if found and (ninja_version(found) or (0,)) >= (1, 13):
            return path
    require("no ninja >= 1.13 installed (pip install ninja==1.13.0)")


def _project(root: Path, edges: int, seconds: dict[int, float] | None = None) -> Path:
    """A ninja project of ``edges`` compile steps (``cc``, found on PATH), 0.4 s each unless ``seconds`` says."""
    root.mkdir(parents=True)
    lines = ["rule job\n  command = cc -o $out $dur\n"]
    lines += [f"build t{i}.txt: job\n  dur = {(seconds or {}).get(i, 0.4)}\n" for i in range(edges)]
    (root / "build.ninja").write_text("".join(lines))
    return root


def _max_overlap(dirs: list[Path]) -> int:
    events: list[tuple[float, int]] = []
    for d in dirs:
        for f in d.glob("t*.txt"):
            start, end = map(float, f.read_text().split())
            events += [(start, 1), (end, -1)]
    running = peak = 0
    for _t, delta in sorted(events, key=lambda e: (e[0], e[1])):
        running += delta
        peak = max(peak, running)
    return peak


def _free_tokens(server: JobServer) -> int:
    fd = os.open(server.fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        try:
            tokens = os.read(fd, 1024)
        except BlockingIOError:
            tokens = b""
        os.write(server._fd, tokens)
        return len(tokens)
    finally:
        os.close(fd)


def _tokens_back(server: JobServer) -> int:
    """The free tokens once the broker has seen every ended gate's connection close (JobServer.settle):
    read at once, a loaded host could show a token the broker had not yet taken back."""
    assert server.broker is None or server.broker.settle(), "a gate's connection is still open"
    return _free_tokens(server)


def _results(server: JobServer, package: str = "pkg") -> dict[str, dict[str, object]]:
    """What ``package``'s units reported, once the broker has read the end of each (as tasks/stages/build.py)."""
    assert server.broker is not None and server.broker.settle(package)
    return server.broker.results(package)


def _run_many(tmp_path: Path, env: dict[str, str], count: int = 2) -> list[Path]:
    """``count`` ninja builds at once, each told ``-j 8`` the way setup scripts do."""
    dirs = [_project(tmp_path / f"p{i}", 8) for i in range(count)]
    errors: list[str] = []

    def build(d: Path) -> None:
        res = subprocess.run(["ninja", "-j", "8"], cwd=d, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            errors.append(res.stdout + res.stderr)

    threads = [threading.Thread(target=build, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return dirs


def test_two_ninjas_share_one_budget(tmp_path: Path) -> None:
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(3, tmp_path / "js", search_path=path)
    try:
        assert server.clients, server.describe()
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        assert "--jobserver-auth=fifo:" in env["MAKEFLAGS"]
        dirs = _run_many(tmp_path / "shared", env)
        peak = _max_overlap(dirs)
        assert 2 <= peak <= 3, f"{peak} jobs ran at once; the budget is 3"
        # Four ninjas at once (apex builds extensions in parallel): every compiler takes its token, so
        # they still stay within the budget.
        dirs = _run_many(tmp_path / "four", env, count=4)
        peak = _max_overlap(dirs)
        assert 2 <= peak <= 3, f"{peak} jobs ran at once; the budget is 3"
        assert _tokens_back(server) == 3  # every token came back
    finally:
        server.close()
    assert not server.fifo.exists()

    # The same two builds without the jobserver run their own -j 8 each.
    dirs = _run_many(tmp_path / "unshared", {**os.environ, "PATH": path})
    assert _max_overlap(dirs) > 3


def test_a_slot_freed_while_a_long_unit_runs_goes_to_the_units_waiting(tmp_path: Path) -> None:
    """Another package holds one of two slots when this ninja starts; its first unit is long, its other
    four are short. ninja 1.13 as a jobserver client starts what tokens it gets, then waits for one of
    its own commands to end before taking a token that came free (ninja-build/ninja#2683): the short
    units waited for the long one, as TransformerEngine's 53 units waited 230 s for cast_transpose_fusion.
    Through the gate, the slot freed at 0.5 s goes to a waiting short unit at once."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(2, tmp_path / "js", search_path=path)
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        project = _project(tmp_path / "p", 5, seconds={0: 4.0, 1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2})
        done: list[subprocess.CompletedProcess[str]] = []
        with server.slot(1):  # the other package's compiler
            build = threading.Thread(
                target=lambda: done.append(
                    subprocess.run(["ninja", "-j", "8"], cwd=project, env=env, capture_output=True, text=True)
                )
            )
            build.start()
            time.sleep(0.5)
        build.join()
        assert done[0].returncode == 0, done[0].stdout + done[0].stderr
        times = {f.name: tuple(map(float, f.read_text().split())) for f in project.glob("t*.txt")}
        # Each short unit starts while the long one runs (their ends may come after its end on a busy host,
        # where starting four processes one after another on one slot takes longer than its 4 s).
        short_starts = [times[f"t{i}.txt"][0] for i in range(1, 5)]
        assert max(short_starts) < times["t0.txt"][1], f"the short units waited for the long one: {times}"
        assert _max_overlap([project]) <= 2
        assert _tokens_back(server) == 2
    finally:
        server.close()


def test_a_wait_after_the_packages_first_unit_ended_counts_as_waiting_for_slots(tmp_path: Path) -> None:
    """A package's waits for a slot count (its build summary's "waited", and what the forecast takes out of
    its serial part) after one of its units has run too: on the GPU host, TransformerEngine's CMake checks
    and megatron_core's link waited 70-95 s each behind other packages' compiles, after a first unit of
    theirs had ended, and the record said 0.0 (the end of a unit also took one off the package's waiters)."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(1, tmp_path / "js", search_path=path)
    env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
    out = tmp_path / "te"
    out.mkdir()
    big = None
    try:
        with server.build_session(
            "te", out=out, cache_root=tmp_path / "cache", patches=tmp_path / "p", default_mb=0, log=out / "log"
        ) as session:
            te_env = {**env, **session.env}
            subprocess.run(["cc", "-o", str(out / "1.txt"), "0.1"], env=te_env, check=True)  # ran and ended
            big = subprocess.Popen(
                ["cc", "-o", str(tmp_path / "big.txt"), "4.0"], env={**env, "REPRO_GATE_PACKAGE": "big"}
            )
            broker = server.broker
            assert broker is not None
            deadline = time.monotonic() + 30
            while not broker._held and time.monotonic() < deadline:  # big's compile holds the one slot
                time.sleep(0.01)
            subprocess.run(["cc", "-o", str(out / "2.txt"), "0.1"], env=te_env, check=True)  # waits for it
        assert big.wait(timeout=30) == 0
        waited = sum(end - start for start, end in session.starved)
        assert waited >= 1.0, f"te's second unit waited most of big's 4 s compile; counted {session.starved}"
        assert _tokens_back(server) == 1
    finally:
        if big is not None and big.poll() is None:
            big.kill()
        server.close()


def test_a_short_unit_its_package_waits_on_alone_takes_the_next_free_token(tmp_path: Path) -> None:
    """A build whose one waiting unit is recorded short (a CMake check, a link: admission.is_step), running
    no compile, gets the next free token before the waiting units of a package of higher priority, through
    the broker as a build session opens it (its times from the cache's records)."""
    from tasks.store.history import record_times

    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(1, tmp_path / "js", search_path=path)
    cache = tmp_path / "cache"
    record_times(cache, "te", {"check.txt": 0.2, "big.txt": 300.0})
    out = tmp_path / "te"
    out.mkdir()
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        higher = {**env, "REPRO_GATE_PRIORITY": "900", "REPRO_GATE_PACKAGE": "apex"}
        with server.build_session(
            "te", out=out, cache_root=cache, patches=tmp_path / "p", default_mb=0, log=out / "log"
        ) as session:
            with server.slot(1):  # every token taken: the waiters line up
                apex = [
                    subprocess.Popen(["cc", "-o", str(tmp_path / f"apex{i}.txt"), "0.3"], env=higher) for i in range(2)
                ]
                te = subprocess.Popen(["cc", "-o", str(out / "check.txt"), "0.1"], env={**env, **session.env})
                broker = server.broker
                assert broker is not None
                deadline = time.monotonic() + 30
                while len(broker._waiting) < 3 and time.monotonic() < deadline:  # all three in line
                    time.sleep(0.01)
            assert te.wait(timeout=30) == 0
        assert all(p.wait(timeout=30) == 0 for p in apex)
        te_start = float((out / "check.txt").read_text().split()[0])
        apex_starts = [float((tmp_path / f"apex{i}.txt").read_text().split()[0]) for i in range(2)]
        assert te_start < min(apex_starts), f"te's check started at {te_start}, apex's at {apex_starts}"
        assert _tokens_back(server) == 1
    finally:
        server.close()


def test_a_freed_token_goes_to_the_highest_priority_waiting_compiler(tmp_path: Path) -> None:
    """Three packages' compilers wait for the one slot, arriving in the order 1, 5, 3 of their packages'
    priorities; the slot goes to 5, then 3, then 1. A waiter that gives up is dropped, and its place
    taken by the next."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(1, tmp_path / "js", search_path=path)
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        procs = {}
        with server.slot(1):
            for prio in (1, 5, 3):
                out = tmp_path / f"p{prio}.txt"
                gate_env = {**env, "REPRO_GATE_PRIORITY": str(prio), "REPRO_GATE_PACKAGE": f"pkg{prio}"}
                procs[prio] = subprocess.Popen(["cc", "-o", str(out), "0.1"], env=gate_env)
                time.sleep(0.3)  # connected and waiting, in this order
            quitter = subprocess.Popen(
                ["cc", "-o", str(tmp_path / "p9.txt"), "0.1"], env={**env, "REPRO_GATE_PRIORITY": "9"}
            )
            time.sleep(0.3)
            quitter.kill()
            quitter.wait()
        for proc in procs.values():
            assert proc.wait(timeout=30) == 0
        starts = {prio: float((tmp_path / f"p{prio}.txt").read_text().split()[0]) for prio in procs}
        assert sorted(starts, key=starts.__getitem__) == [5, 3, 1]
        # What each package waited for a slot (its build summary's "waited"): pkg1 the longest, from its
        # arrival until 5 and 3 had run.
        assert server.broker is not None and server.broker.settle()
        waited = {p: sum(end - start for start, end in server.broker.starved(f"pkg{p}")) for p in procs}
        assert waited[1] > waited[3] > 0.3 and waited[1] >= 0.6, waited
        assert server.broker.starved("pkg1") == []  # reported once
        assert not (tmp_path / "p9.txt").exists()
        assert _tokens_back(server) == 1  # every token came back
    finally:
        server.close()


def test_a_killed_compiler_gives_its_token_back(tmp_path: Path) -> None:
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(1, tmp_path / "js", search_path=path)
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        proc = subprocess.Popen(["cc", "-o", str(tmp_path / "long.txt"), "30"], env=env)
        time.sleep(0.5)
        assert _free_tokens(server) == 0  # held by the running compiler
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _free_tokens(server) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _free_tokens(server) == 1
    finally:
        server.close()


def _drain(fifo: Path) -> int:
    """Read every token the fifo holds now (without blocking): how many."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    count = 0
    try:
        while True:
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            count += len(chunk)
    finally:
        os.close(fd)
    return count


@pytest.mark.parametrize("slots", [70_000, 2_000_000])
def test_a_budget_larger_than_the_fifo_holds_never_blocks(
    slots: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """jobs= above 65 536 (or a Ray cluster of more CPUs): the job server wrote its tokens into a fifo that
    holds 64 KiB before anything read it, and blocked for ever, with no output. It grows the pipe where it may
    and otherwise takes the tokens the fifo holds, with a warning; it never waits."""
    made: list[JobServer] = []
    thread = threading.Thread(
        target=lambda: made.append(JobServer(slots, tmp_path / "js", search_path="", ninja=(None, None))), daemon=True
    )
    thread.start()
    thread.join(timeout=60)
    blocked = thread.is_alive()
    fifos = list((tmp_path / "js").glob("jobserver-*.fifo"))
    while thread.is_alive() and fifos:  # (before the fix: let its write end, so the test ends)
        _drain(fifos[0])
        thread.join(timeout=0.1)
    assert not blocked, f"the job server blocked writing {slots} tokens"
    server = made[0]
    try:
        held = _drain(server.fifo)
        assert held == server.slots and 4096 <= server.slots <= slots
        warned = capsys.readouterr().err
        assert server.slots == slots or f"holds {held} tokens, not {slots}" in warned, warned
    finally:
        server.close()


def test_slots_are_returned_after_a_failed_block(tmp_path: Path) -> None:
    server = JobServer(2, tmp_path / "js", search_path=os.environ.get("PATH", ""))
    try:
        with pytest.raises(RuntimeError), server.slot(2):
            raise RuntimeError("build failed")
        with server.slot(2):  # would block forever if the tokens were lost
            pass
    finally:
        server.close()


def test_shim_passes_arguments_through_without_a_jobserver(tmp_path: Path) -> None:
    path = os.pathsep.join([_ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(2, tmp_path / "js", search_path=path)
    try:
        project = _project(tmp_path / "p", 2)
        env = {k: v for k, v in server.env({**os.environ, "PATH": path}).items() if k != "MAKEFLAGS"}
        res = subprocess.run(
            ["ninja", "-j", "1", "-n", "-C", str(project)], env=env, capture_output=True, text=True, check=False
        )
        assert res.returncode == 0, res.stderr
        assert "[2/2]" in res.stdout
    finally:
        server.close()


def test_compiler_out_of_memory_is_recognised(tmp_path: Path) -> None:
    """g++ under a small address-space limit fails the way the OOM killer's victims report."""
    cxx = shutil.which("g++")
    if cxx is None:
        require("g++ is not installed")
    src = tmp_path / "big.cpp"
    src.write_text("#include <map>\n#include <string>\n#include <vector>\nint main() { return 0; }\n")
    res = subprocess.run(
        ["bash", "-c", f"ulimit -v 60000; {cxx} -c {src} -o {tmp_path / 'big.o'}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode != 0
    assert killed_for_memory(res.stdout + res.stderr) is not None, res.stderr
    assert killed_for_memory("error: expected ';' before '}' token") is None


#: Slow enough to catch its cicc running (a few seconds), small enough for CI.
_SLOW_KERNEL = textwrap.dedent(
    """
    template <int N> struct F { __device__ static int v(int x) { return F<N-1>::v(x) * 3 + F<N-2>::v(x ^ N); } };
    template <> struct F<0> { __device__ static int v(int x) { return x; } };
    template <> struct F<1> { __device__ static int v(int x) { return x + 1; } };
    __global__ void k(int* o) { o[threadIdx.x] = F<30>::v(threadIdx.x); }
    """
)


def _processes(name: str) -> list[tuple[int, bytes]]:
    """(pid, command line) of the running processes called ``name``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == name:
                found.append((int(proc.name), (proc / "cmdline").read_bytes()))
        except OSError:  # gone meanwhile
            continue
    return found


def test_nvcc_whose_cicc_the_oom_killer_stopped_is_recognised(tmp_path: Path) -> None:
    """nvcc only prints a bare "Killed" when cicc gets SIGKILL, as from the OOM killer on the H200 host."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        require("nvcc is not installed")
    src = tmp_path / "slow_kernel.cu"
    src.write_text(_SLOW_KERNEL)
    build = subprocess.Popen(
        [nvcc, "-c", str(src), "-o", str(tmp_path / "k.o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and build.poll() is None and time.monotonic() < deadline:
        victim = next((pid for pid, args in _processes("cicc") if str(src).encode() in args), None)
        time.sleep(0.02)
    assert victim is not None, "cicc finished before it could be killed"
    os.kill(victim, signal.SIGKILL)
    out, _ = build.communicate(timeout=120)
    assert build.returncode != 0
    found = killed_for_memory(f"  FAILED: [code=255] k.o\n{out}")
    assert found == "FAILED: [code=255] k.o: Killed", out


def _ninja_log_order(project: Path) -> list[str]:
    rows = [line.split("\t") for line in (project / ".ninja_log").read_text().splitlines() if line[:1] != "#"]
    return [row[3] for row in sorted(rows, key=lambda r: int(r[0]))]


def test_shim_starts_the_longest_units_first(tmp_path: Path) -> None:
    """With REPRO_UNIT_TIMES the shim reorders the manifest; real ninja then starts the slowest unit first."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(1, tmp_path / "js", search_path=path)
    try:
        env = server.env({**os.environ, "PATH": path})
        plain = _project(tmp_path / "plain", 4)
        res = subprocess.run(["ninja", "-j", "4"], cwd=plain, env=env, capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        assert _ninja_log_order(plain) == ["t0.txt", "t1.txt", "t2.txt", "t3.txt"]

        timed = _project(tmp_path / "timed", 4)
        manifest = timed / "build.ninja"
        before, mtime = manifest.read_text(), manifest.stat().st_mtime_ns
        times = tmp_path / "times.json"
        times.write_text('{"t2.txt": 700.0, "t0.txt": 90.5, "t3.txt": 300, "elsewhere.o": 999}')
        env_timed = {**env, "REPRO_UNIT_TIMES": str(times)}
        res = subprocess.run(
            ["ninja", "-j", "4", "-C", str(timed)], env=env_timed, capture_output=True, text=True, check=False
        )
        assert res.returncode == 0, res.stdout + res.stderr
        # One slot, so one unit at a time: the start order is the log's order.
        assert _ninja_log_order(timed) == ["t2.txt", "t3.txt", "t0.txt", "t1.txt"]
        assert sorted(manifest.read_text().splitlines()) == sorted(before.splitlines())
        assert manifest.stat().st_mtime_ns == mtime
        again = subprocess.run(["ninja", "-C", str(timed)], env=env_timed, capture_output=True, text=True, check=False)
        assert "no work to do" in again.stdout, again.stdout

        # A broken times file is ignored, never fatal.
        times.write_text("{not json")
        broken = _project(tmp_path / "broken", 2)
        res = subprocess.run(["ninja"], cwd=broken, env=env_timed, capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        assert _ninja_log_order(broken) == ["t0.txt", "t1.txt"]
    finally:
        server.close()


#: A "compiler" that holds MB of memory for SECONDS and records when it ran: ``cc -o OUT MB SECONDS``.
#: With a PHASES file (``REPRO_TEST_PHASES``) it runs as two processes, a large one then a small one.
HOLD = textwrap.dedent(
    """
    import os, sys, time
    out, mb, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    start = time.time()
    held = b"x" * (mb << 20)  # resident, page by page
    time.sleep(seconds)
    with open(out, "a") as fh:
        fh.write(f"{start} {time.time()}\\n")
    """
)


def _memory_compiler(directory: Path, *, phases: bool = False) -> Path:
    """A directory holding ``cc``; with ``phases``, each compile runs ``bigstep`` (the MB given) and then
    ``smallstep`` (20 MB for 3 s: longer than the watcher's longest sample interval, so that a busy machine
    still sees the first end while the second runs), two processes named apart as nvcc's cicc and ptxas are."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hold.py").write_text(HOLD)
    for name in ("bigstep", "smallstep"):
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to(sys.executable)
    if phases:
        body = (
            f'{directory / "bigstep"} -S {directory / "hold.py"} -o "$2.big" "$3" "$4" && '
            f'{directory / "smallstep"} -S {directory / "hold.py"} -o "$2.small" 20 3 && touch "$2"\n'
        )
    else:
        body = f'exec {sys.executable} -S {directory / "hold.py"} "$@"\n'
    (directory / "cc").write_text("#!/bin/sh\n" + body)
    (directory / "cc").chmod(0o755)
    return directory


def _memory_project(root: Path, units: dict[str, tuple[int, float]]) -> Path:
    """A ninja project whose units (output name -> (MB, seconds)) run ``cc -o OUT MB SECONDS``."""
    root.mkdir(parents=True)
    lines = ["rule job\n  command = cc -o $out $mb $dur\n"]
    lines += [f"build {name}: job\n  mb = {mb}\n  dur = {dur}\n" for name, (mb, dur) in units.items()]
    (root / "build.ninja").write_text("".join(lines))
    return root


def _spans(files: list[Path]) -> list[tuple[float, float]]:
    return [tuple(map(float, line.split())) for f in files if f.exists() for line in f.read_text().splitlines()]  # type: ignore[misc]


def _overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _t, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def _build_in(project: Path, server: JobServer, path: str, package: str = "pkg") -> subprocess.CompletedProcess[str]:
    env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
    env["REPRO_GATE_PACKAGE"] = package
    return subprocess.run(["ninja", "-j", "8"], cwd=project, env=env, capture_output=True, text=True, check=False)


def test_units_are_admitted_by_their_own_memory(tmp_path: Path) -> None:
    """Four slots, a 600 MB budget: four heavy units (250 MB each) and four light ones (30 MB). The heavy
    ones never run more than two at once (750 MB would overcommit); the light ones fill the other slots.
    With tokens only (no memory budget), the heavy units run four at once."""
    path = os.pathsep.join([str(_memory_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    units = {f"h{i}.o": (250, 1.5) for i in range(4)} | {f"l{i}.o": (30, 1.5) for i in range(4)}
    hints: dict[str, dict[str, object]] = {"h*.o": {"peak_mb": 260}, "l*.o": {"peak_mb": 50}}

    server = JobServer(4, tmp_path / "js", search_path=path, mem_budget_gb=600 / 1024, unit_log=tmp_path / "u.log")
    try:
        assert server.broker is not None
        server.broker.building("pkg", records={}, hints=hints, default_mb=260)
        project = _memory_project(tmp_path / "budget", units)
        res = _build_in(project, server, path)
        assert res.returncode == 0, res.stdout + res.stderr
        heavy = _overlap(_spans([project / f"h{i}.o" for i in range(4)]))
        every = _overlap(_spans([project / n for n in units]))
        assert heavy <= 2, f"{heavy} heavy units ran at once in a 600 MB budget"
        assert every >= 3, f"the light units did not fill the free slots ({every} at once)"
        results = _results(server)
        assert set(results) == set(units)
        assert 250 <= float(str(results["h0.o"]["peak_mb"])) < 400, results["h0.o"]
        assert float(str(results["l0.o"]["peak_mb"])) < 120, results["l0.o"]
        assert _tokens_back(server) == 4
    finally:
        server.close()
    log = (tmp_path / "u.log").read_text()
    assert "start pkg h0.o expect=260MB" in log and "end pkg h0.o" in log

    tokens_only = JobServer(4, tmp_path / "js2", search_path=path)
    try:
        project = _memory_project(tmp_path / "tokens", units)
        res = _build_in(project, tokens_only, path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert _overlap(_spans([project / f"h{i}.o" for i in range(4)])) >= 3
    finally:
        tokens_only.close()


def test_recorded_memory_replaces_the_estimate_at_the_next_build(tmp_path: Path) -> None:
    """Without records every unit counts the package's default (250 MB: two at once in 600 MB); the
    build records what each held (about 40 MB), and the next build runs them four at once."""
    path = os.pathsep.join([str(_memory_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    units = {f"u{i}.o": (30, 1.5) for i in range(4)}
    cache = tmp_path / "cache"
    overlaps = []
    for run in ("first", "second"):
        server = JobServer(4, tmp_path / f"js-{run}", search_path=path, mem_budget_gb=600 / 1024)
        try:
            assert server.broker is not None
            records = load_memory(memory_record(cache, "pkg"))
            server.broker.building("pkg", records=records, hints={}, default_mb=250)
            project = _memory_project(tmp_path / run, units)
            res = _build_in(project, server, path)
            assert res.returncode == 0, res.stdout + res.stderr
            overlaps.append(_overlap(_spans([project / n for n in units])))
            record_memory(cache, "pkg", _results(server))
        finally:
            server.close()
    assert overlaps[0] <= 2 and overlaps[1] >= 3, overlaps
    recorded = load_memory(memory_record(cache, "pkg"))
    assert set(recorded) == set(units)
    assert all(30 <= float(str(r["peak_mb"])) < 120 for r in recorded.values()), recorded


def test_a_unit_past_its_peak_process_counts_only_its_rest(tmp_path: Path) -> None:
    """Each unit runs a 250 MB process (as nvcc's cicc) and then a 20 MB one (as ptxas). Recorded with its
    peak in the first, a unit counts only its rest once that process has ended, so while two units
    run their small step two more start their large one: four units at once in 600 MB, never more
    than two large steps. Without the record's rest, two units at a time."""
    path = os.pathsep.join(
        [str(_memory_compiler(tmp_path / "bin", phases=True)), _ninja_dir(), os.environ.get("PATH", "")]
    )
    units = {f"u{i}.o": (250, 1.5) for i in range(4)}
    found = {}
    for name, record in (
        ("rest", {"peak_mb": 270, "peak_in": "bigstep", "after_mb": 40}),
        ("peak", {"peak_mb": 270}),
    ):
        server = JobServer(4, tmp_path / f"js-{name}", search_path=path, mem_budget_gb=600 / 1024)
        try:
            assert server.broker is not None
            server.broker.building("pkg", records={u: record for u in units}, hints={}, default_mb=270)
            project = _memory_project(tmp_path / name, units)
            res = _build_in(project, server, path)
            assert res.returncode == 0, res.stdout + res.stderr
            big = _overlap(_spans([project / f"{n}.big" for n in units]))
            whole = _overlap(_spans([project / f"{n}.big" for n in units] + [project / f"{n}.small" for n in units]))
            found[name] = (big, whole)
            if name == "rest":
                learned = _results(server)["u0.o"]
                assert learned["peak_in"] == "bigstep" and float(str(learned["after_mb"])) < 120, learned
        finally:
            server.close()
    assert found["rest"][0] <= 2 and found["rest"][1] >= 3, found
    assert found["peak"][1] <= 2, found


#: A "compiler" of one process that holds MB for SECONDS, frees it, and holds a few MB for TAIL seconds more:
#: ``cc -o OUT MB SECONDS TAIL``. It appends when it ran to OUT and when it held MB to OUT.big.
BRIEF_PEAK = textwrap.dedent(
    """
    import sys, time
    out, mb, seconds, tail = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
    start = time.time()
    held = b"x" * (mb << 20)  # resident, page by page; freed at once (an mmap of its own)
    time.sleep(seconds)
    peak_end = time.time()
    del held
    time.sleep(tail)
    with open(out + ".big", "a") as fh:
        fh.write(f"{start} {peak_end}\\n")
    with open(out, "a") as fh:
        fh.write(f"{start} {time.time()}\\n")
    """
)


def _brief_peak_compiler(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "brief.py").write_text(BRIEF_PEAK)
    (directory / "cc").write_text(f'#!/bin/sh\nexec {sys.executable} -S {directory / "brief.py"} "$@"\n')
    (directory / "cc").chmod(0o755)
    return directory


def test_a_unit_whose_peak_is_brief_is_charged_its_peak_only_around_it(tmp_path: Path) -> None:
    """Each unit holds 250 MB for its first 1.5 s and a few MB for 8 s more, in one process (no process
    that ends marks its peak past). Budget 600 MB, four slots. The first build, without a record, counts
    each unit the package's 270 MB for all of it: two at a time. It records when each unit's peak came; the
    next build counts a unit its peak only around then: two start, and the other two once the first two
    are past their peaks by the clock (no event tells the broker: it asks again each second), while the
    first two still run: four at once, never more than two peaks. The same records without their timing:
    two at a time again."""
    path = os.pathsep.join([str(_brief_peak_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    units = [f"u{i}.o" for i in range(4)]
    cache = tmp_path / "cache"

    def build(name: str, records: dict[str, dict[str, object]]) -> tuple[int, int]:
        log = tmp_path / f"{name}-units.log"
        server = JobServer(4, tmp_path / f"js-{name}", search_path=path, mem_budget_gb=600 / 1024, unit_log=log)
        try:
            assert server.broker is not None
            server.broker.building("pkg", records=records, hints={}, default_mb=270)
            project = tmp_path / name
            project.mkdir()
            lines = ["rule job\n  command = cc -o $out 250 1.5 8.0\n"] + [f"build {u}: job\n" for u in units]
            (project / "build.ninja").write_text("".join(lines))
            res = _build_in(project, server, path)
            assert res.returncode == 0, res.stdout + res.stderr
            record_memory(cache, "pkg", _results(server))
            whole = _overlap(_spans([project / u for u in units]))
            peaks = _overlap(_spans([project / f"{u}.big" for u in units]))
            return whole, peaks
        finally:
            server.close()

    first = build("first", {})
    assert first[0] <= 2, first
    recorded = load_memory(memory_record(cache, "pkg"))
    for found in recorded.values():  # its peak early in the unit and short (between samples), then little
        peak = float(str(found["peak_mb"]))
        start, span = float(str(found["peak_from_s"])), float(str(found["peak_for_s"]))
        assert 1.0 <= span and start + span < float(str(found["seconds"])) - 4, found
        assert 250 <= peak < 400, found
        # Under half its peak before and after its span (a sample may catch it filling or freeing its 250 MB),
        # as the gate measured them; the record keeps whole MB, so a rounded figure may reach half of the rounded
        # peak, plus half a MB where that is odd (seen under load: before_mb 129 of a peak of 258).
        half = peak / 2 + 0.5
        assert float(str(found["before_mb"])) <= half and float(str(found["after_mb"])) <= half, found
    timed = build("timed", recorded)
    assert timed[0] >= 3 and timed[1] <= 2, f"{timed}: with its peak timed, units ran four at once, two peaks"
    assert " start pkg u0.o expect=" in (tmp_path / "timed-units.log").read_text()
    assert " peak_at=" in (tmp_path / "timed-units.log").read_text()
    assert " peak_at=" not in (tmp_path / "first-units.log").read_text()
    untimed = {u: {k: v for k, v in r.items() if k not in ("peak_from_s", "peak_for_s", "before_mb")}
               for u, r in recorded.items()}  # fmt: skip
    assert build("untimed", untimed)[0] <= 2


def test_admission_holds_back_on_what_the_host_really_has_left(tmp_path: Path) -> None:
    """mem= says four times what the host has free (MemAvailable); each unit is expected (by the lock's hint)
    to reach 60 % of what the host has free, though it holds a few MB. The budget would take three at once;
    what the host really has left takes one: each waits for the one before it to end. With what the host
    has known to be ample (a budget of a tenth of it), all four at once."""
    from tasks.engine.broker import available_memory_mb

    free = available_memory_mb()
    if free is None:
        require("/proc/meminfo has no MemAvailable here")
    path = os.pathsep.join([str(_memory_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    units = {f"u{i}.o": (20, 3.0) for i in range(4)}
    found = {}
    for name, budget_mb, expect_mb in (("high", 4 * free, 0.6 * free), ("ample", free / 10, 20.0)):
        server = JobServer(4, tmp_path / f"js-{name}", search_path=path, mem_budget_gb=budget_mb / 1024)
        try:
            assert server.broker is not None
            server.broker.building("pkg", records={}, hints={"u*.o": {"peak_mb": expect_mb}}, default_mb=expect_mb)
            project = _memory_project(tmp_path / name, units)
            res = _build_in(project, server, path)
            assert res.returncode == 0, res.stdout + res.stderr
            found[name] = _overlap(_spans([project / n for n in units]))
        finally:
            server.close()
    assert found == {"high": 1, "ample": 4}, found


KILLED_ONCE = textwrap.dedent(
    """#!/bin/sh
    # Killed (SIGKILL, as by the OOM killer) the first time; compiles the second.
    if [ ! -e "$2.tried" ]; then touch "$2.tried"; kill -9 $$; fi
    if [ -n "$ALWAYS_KILLED" ]; then kill -9 $$; fi
    echo ok > "$2"
    """
)


def test_a_unit_killed_for_memory_is_run_once_more(tmp_path: Path) -> None:
    """A compile SIGKILLed (the OOM killer's signal) runs once more, and the build passes; one killed
    again fails it, with the shell's 137. The record keeps the mark."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "cc").write_text(KILLED_ONCE)
    (bindir / "cc").chmod(0o755)
    path = os.pathsep.join([str(bindir), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(2, tmp_path / "js", search_path=path, mem_budget_gb=1.0, unit_log=tmp_path / "u.log")
    try:
        assert server.broker is not None
        server.broker.building("pkg", records={}, hints={}, default_mb=100)
        project = _memory_project(tmp_path / "p", {"a.o": (1, 0), "b.o": (1, 0)})
        res = _build_in(project, server, path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert (project / "a.o").read_text() == "ok\n" and (project / "b.o").read_text() == "ok\n"
        assert "a.o (pkg) was killed for memory" in res.stdout + res.stderr
        results = _results(server)
        assert results["a.o"]["killed"] is True and "exit" not in results["a.o"], results
        assert " retry pkg a.o " in (tmp_path / "u.log").read_text()

        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        again = _memory_project(tmp_path / "again", {"c.o": (1, 0)})
        res = subprocess.run(
            ["ninja"], cwd=again, env={**env, "ALWAYS_KILLED": "1"}, capture_output=True, text=True, check=False
        )
        assert res.returncode != 0
        assert "FAILED" in res.stdout and (res.stdout + res.stderr).count("was killed for memory") == 1
        assert _tokens_back(server) == 2
    finally:
        server.close()


def test_one_token_is_kept_for_the_package_that_sets_the_wall_time(tmp_path: Path) -> None:
    """Four slots; a low-priority package's ninja has eight 3 s units ready when the highest-priority
    package's first compile (a CMake check, say) arrives. The low package runs on three slots, and the
    check starts at once on the fourth instead of waiting 3 s for one of them to end. While the top
    package runs a compile of its own, the low one may take the three others; once the top package has
    finished, all four."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(4, tmp_path / "js", search_path=path)
    try:
        assert server.broker is not None
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        server.broker.building("top", 500.0)
        server.broker.building("low", 10.0)
        low = _project(tmp_path / "low", 8, seconds={i: 3.0 for i in range(8)})
        low_env = {**env, "REPRO_GATE_PRIORITY": "10", "REPRO_GATE_PACKAGE": "low"}
        build = subprocess.Popen(["ninja", "-j", "8"], cwd=low, env=low_env, stdout=subprocess.DEVNULL)
        time.sleep(0.8)
        asked = time.time()
        check = subprocess.run(
            ["cc", "-o", str(tmp_path / "check.txt"), "0.1"],
            env={**env, "REPRO_GATE_PRIORITY": "500", "REPRO_GATE_PACKAGE": "top"},
            check=False,
        )
        assert check.returncode == 0
        started = float((tmp_path / "check.txt").read_text().split()[0])
        assert started - asked < 1.5, f"the top package's compile waited {started - asked:.1f} s for a token"
        time.sleep(0.5)
        done = time.time()
        server.broker.finished("top")
        assert build.wait(timeout=60) == 0
        spans = [tuple(map(float, f.read_text().split())) for f in low.glob("t*.txt")]
        early = [s for s in spans if s[0] < done]
        assert len(early) == 3, f"{len(early)} low units took tokens while the top package built"
        assert _overlap(spans) == 4  # all four once the top package had finished  # type: ignore[arg-type]

        # The top package builds again, and this time runs a long compile of its own.
        server.broker.building("top", 500.0)
        top_env = {**env, "REPRO_GATE_PRIORITY": "500", "REPRO_GATE_PACKAGE": "top"}
        long = subprocess.Popen(["cc", "-o", str(tmp_path / "long.txt"), "4"], env=top_env)
        time.sleep(0.5)
        again = _project(tmp_path / "again", 6, seconds={i: 1.0 for i in range(6)})
        res = subprocess.run(["ninja", "-j", "8"], cwd=again, env=low_env, capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stdout
        assert long.wait(timeout=30) == 0
        server.broker.finished("top")
        spans = [tuple(map(float, f.read_text().split())) for f in again.glob("t*.txt")]
        assert _overlap(spans) == 3, "with the top package compiling, the low one had the other three tokens"  # type: ignore[arg-type]
    finally:
        server.close()


@pytest.fixture
def busy_cores() -> Iterator[int]:
    """A busy loop on every core for the test's duration (CI's loaded host), stopped after it."""
    loops = [
        subprocess.Popen(["sh", "-c", "while :; do :; done"], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield len(loops)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _compilers(project: Path) -> list[int]:
    """The fake compiler processes (job.py) running in ``project`` now."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            here = os.readlink(cmdline.parent / "cwd")
        except OSError:
            continue
        if any(a.endswith(b"job.py") for a in args) and here == str(project):
            found.append(int(cmdline.parent.name))
    return found


def _gates(project: Path) -> list[int]:
    """The gates of the compilers running in ``project`` (each compiler's parent)."""
    parents = []
    for pid in _compilers(project):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents.append(int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]))
    return parents


def test_every_token_is_back_after_any_build_under_load(tmp_path: Path, busy_cores: int) -> None:
    """One run's budget of 2 through builds that succeed, fail, are stopped by Ctrl-C, lose a compiler
    (SIGKILL: the gate runs it once more) and lose a gate, with a busy loop on every core: after each,
    every token is back, so the rest of a long run keeps its slots."""
    path = os.pathsep.join([str(_fake_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    server = JobServer(2, tmp_path / "js", search_path=path)
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)

        def project(name: str, seconds: list[str]) -> Path:
            root = tmp_path / name
            root.mkdir()
            lines = ["rule job\n  command = cc -o $out $dur\n"]
            lines += [f"build t{i}.txt: job\n  dur = {d}\n" for i, d in enumerate(seconds)]
            (root / "build.ninja").write_text("".join(lines))
            return root

        def start(root: Path) -> subprocess.Popen[str]:
            return subprocess.Popen(
                ["ninja", "-j", "8"], cwd=root, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches a build
            )  # fmt: skip

        def running(root: Path, count: int) -> None:
            deadline = time.monotonic() + 120
            while len(_compilers(root)) < count:
                assert time.monotonic() < deadline, f"{count} compilers never ran in {root.name}"
                time.sleep(0.05)

        ok = subprocess.run(["ninja", "-j", "8"], cwd=project("ok", ["0.2"] * 6), env=env, capture_output=True)
        assert ok.returncode == 0, ok.stdout
        assert _tokens_back(server) == 2

        failed = subprocess.run(  # "fail" is no number of seconds: that unit's compiler exits 1
            ["ninja", "-j", "8"], cwd=project("failed", ["0.5", "fail", "0.5", "0.5"]), env=env, capture_output=True
        )
        assert failed.returncode != 0, failed.stdout
        assert _tokens_back(server) == 2

        root = project("ctrl-c", ["30"] * 4)
        build = start(root)
        running(root, 2)
        os.killpg(build.pid, signal.SIGINT)  # ninja's group, as a terminal's: ninja stops its commands
        build.communicate(timeout=60)
        assert not list(root.glob("t*.txt")), "the 30 s units ran to the end: the build was not interrupted"
        assert _tokens_back(server) == 2

        root = project("killed", ["3", "3", "0.2"])
        build = start(root)
        running(root, 2)
        os.kill(_compilers(root)[0], signal.SIGKILL)  # the gate sees it killed, and runs it once more
        out, _ = build.communicate(timeout=120)
        assert build.returncode == 0 and "was killed for memory" in out, out
        assert _tokens_back(server) == 2

        root = project("gate-killed", ["30", "30"])
        build = start(root)
        running(root, 2)
        for gate in _gates(root):
            os.kill(gate, signal.SIGKILL)  # its compiler dies with it (PR_SET_PDEATHSIG)
        out, _ = build.communicate(timeout=60)
        assert build.returncode != 0, out
        assert _tokens_back(server) == 2
    finally:
        server.close()


def _ninja_passes(project: Path, env: dict[str, str]) -> None:
    res = subprocess.run(["ninja"], cwd=project, env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_build_session_names_the_package_to_the_gate_and_records_its_units(tmp_path: Path) -> None:
    """JobServer.build_session, as tasks/stages/build.py opens it: the build's environment names the package and
    its priority (from the lock's unit times) to the gate, the times to the ninja shim and the file for
    its waits; each unit's memory and seconds are in the cache once it ends, before the block does; when
    the block ends, a failed build's too, its units' memory and seconds are in the cache,
    its log says so and every token is back. Without ninja 1.13, only the wait log."""
    path = os.pathsep.join([str(_memory_compiler(tmp_path / "bin")), _ninja_dir(), os.environ.get("PATH", "")])
    cache = tmp_path / "cache"
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / ninjaorder.HINTS_FILE).write_text(json.dumps({"a.o": 8.0, "b.o": 4.0}))
    log = tmp_path / "build.log"
    server = JobServer(4, tmp_path / "js", search_path=path, mem_budget_gb=1.0)
    try:
        env, _how = server.gate_env(server.env({**os.environ, "PATH": path}), ccache=False)
        out = tmp_path / "out"
        out.mkdir()
        with server.build_session("pkg", out=out, cache_root=cache, patches=patches, default_mb=100, log=log) as s:
            assert s.env == {
                ENV_UNIT_TIMES: str(out / "unit-times.json"),
                ENV_PRIORITY: str(admission.priority({"a.o": 8.0, "b.o": 4.0}, 4)),
                ENV_PACKAGE: "pkg",
                ENV_WAIT_LOG: str(out / "waits.log"),
            }
            project = _memory_project(tmp_path / "ok", {"a.o": (30, 0.3), "b.o": (30, 0.3)})
            _ninja_passes(project, {**env, **s.env})
            assert server.broker is not None and server.broker.settle("pkg")
            # in the cache as each unit ends, before the block does (a host taken back mid-build keeps them)
            assert set(load_memory(memory_record(cache, "pkg"))) == {"a.o", "b.o"}
            assert set(ninjaorder.load_times(cache / "timings" / "pkg.json")) == {"a.o", "b.o"}
        assert all(isinstance(found.get("cpu_s"), float) for found in s.units.values()), s.units  # (the kernel's)
        assert set(s.units) == {"a.o", "b.o"} and set(load_memory(memory_record(cache, "pkg"))) == {"a.o", "b.o"}
        assert set(ninjaorder.load_times(cache / "timings" / "pkg.json")) == {"a.o", "b.o"}
        assert "# 2 compiles; the largest held" in log.read_text()
        assert _free_tokens(server) == 4

        failing = tmp_path / "out-failing"
        failing.mkdir()
        with (
            pytest.raises(RuntimeError),
            server.build_session("bad", out=failing, cache_root=cache, patches=patches, default_mb=100, log=log) as f,
        ):
            project = _memory_project(tmp_path / "failing", {"c.o": (30, 0.3)})
            _ninja_passes(project, {**env, **f.env})
            raise RuntimeError("the build failed after its compiles")
        assert set(f.units) == {"c.o"} and set(load_memory(memory_record(cache, "bad"))) == {"c.o"}
        assert _free_tokens(server) == 4
    finally:
        server.close()

    plain = JobServer(2, tmp_path / "js-plain", search_path=path, ninja=(None, None))
    try:
        with plain.build_session("pkg", out=out, cache_root=cache, patches=patches, default_mb=100, log=log) as p:
            assert p.env == {ENV_WAIT_LOG: str(out / "waits.log")}
        assert p.units == {} and p.starved == []
    finally:
        plain.close()
