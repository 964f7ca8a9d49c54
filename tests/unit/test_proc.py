"""A failed command's error names the cause, not only the wrapper's last words; Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core import proc
from tasks.core.errors import ReproError


def _fail(tmp_path: Path, script: str) -> str:
    log = tmp_path / "build.log"
    with pytest.raises(ReproError) as info:
        proc.run(["bash", "-c", script], env=dict(os.environ), log=log, cwd=tmp_path, what="build of demo")
    return str(info.value)


def test_compiler_error_far_above_the_tail_is_shown(tmp_path: Path) -> None:
    # A real gcc error, then more output than the tail holds (as pip's cleanup prints after a failed build).
    (tmp_path / "broken.c").write_text("int f(void) { return undefined_name; }\n")
    message = _fail(
        tmp_path, f"gcc -c broken.c -o broken.o; for i in $(seq {proc.TAIL_LINES * 2}); do echo noise $i; done; exit 1"
    )
    assert "--- first error lines of" in message
    assert "broken.c:1:" in message and "undefined_name" in message
    assert message.index("first error lines") < message.index("--- last lines of")
    assert f"noise {proc.TAIL_LINES * 2}" in message  # the tail is still there


def test_error_already_in_the_tail_is_not_repeated(tmp_path: Path) -> None:
    (tmp_path / "broken.c").write_text("int f(void) { return undefined_name; }\n")
    message = _fail(tmp_path, "gcc -c broken.c -o broken.o")
    assert "first error lines" not in message
    assert message.count("undeclared (first use") == 1


def test_no_error_lines_means_tail_only(tmp_path: Path) -> None:
    message = _fail(tmp_path, "echo all fine until now; exit 3")
    assert "exit status 3" in message
    assert "first error lines" not in message
    assert "all fine until now" in message


def test_error_lines_are_capped_and_clipped(tmp_path: Path) -> None:
    log = tmp_path / "many.log"
    long_line = "x.cu(1): error: " + "y" * 1000
    log.write_text("\n".join([f"FAILED: unit{i}.o" for i in range(30)] + [long_line]) + "\n")
    lines = proc.error_lines(log)
    assert len(lines) == proc.ERROR_LINES
    assert lines[0] == "FAILED: unit0.o"
    clipped = proc.error_lines(tmp_path / "many.log", limit=100)[-1]
    assert clipped.endswith(" …") and len(clipped) <= proc.ERROR_LINE_CHARS + 2
    assert proc.error_lines(tmp_path / "absent.log") == []


# A process shaped like `doit -n N`: the command runs in a daemon worker thread,
# which cleans up after it fails; the main thread waits on a queue. argv[3], as on a
# loaded host: "register", the worker is a second late to register its started
# command; "wait", a second late to wait for it. argv[4] == "bystander": another
# thread takes a Ctrl-C of its own once the command runs; "main": the command runs
# in the main thread (doit without -n).
_WORKER = """
import os, queue, signal, sys, threading, time
from pathlib import Path
from tasks.core import proc, workspace
from tasks.core.errors import ReproError

work = Path(sys.argv[1])
proc.install_interrupt_handler()
if sys.argv[4] == "bystander":
    def bystander():
        while not ((work / "build.log").exists() and "started" in (work / "build.log").read_text().splitlines()):
            time.sleep(0.05)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        time.sleep(300)
    threading.Thread(target=bystander, daemon=True).start()
if sys.argv[3] == "register":
    import subprocess
    popen = subprocess.Popen
    def late_popen(*args, **kwargs):
        started = popen(*args, **kwargs)
        time.sleep(1.0)
        return started
    subprocess.Popen = late_popen
if sys.argv[3] == "wait":
    noted = workspace.session
    def late(pid, live):
        noted(pid, live)
        if live:
            time.sleep(1.0)
    workspace.session = late
done = queue.Queue()

def worker():
    try:
        proc.run(["bash", "-c", "echo started; sleep 300"], env=dict(os.environ), log=work / "build.log")
    except ReproError as exc:
        (work / "error.txt").write_text(str(exc))
        time.sleep(float(sys.argv[2]))  # removing a large build tree
        (work / "cleaned").write_text("yes")
        try:
            proc.run(["true"], env=dict(os.environ), log=work / "next.log")
        except ReproError as again:
            (work / "refused.txt").write_text(str(again))
    done.put(1)

if sys.argv[4] == "main":
    worker()
else:
    threading.Thread(target=worker, daemon=True).start()
    done.get()
sys.exit(1)
"""


def _start_worker(
    spawned: list[subprocess.Popen[str]], tmp_path: Path, cleanup_s: float, late: str = "-", thread: str = "worker"
) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    p = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(tmp_path), str(cleanup_s), late, thread],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    spawned.append(p)
    log = tmp_path / "build.log"
    deadline = time.monotonic() + 60
    # The command's own line: the log's first line, the command echoed, names "started" too
    # (a Ctrl-C sent on that came before the fork, and the test hung on it in CI).
    while not (log.exists() and "started" in log.read_text().splitlines()):
        assert time.monotonic() < deadline and p.poll() is None, "the command never started"
        time.sleep(0.05)
    return p


@pytest.mark.parametrize(
    ("late", "thread"), [("-", "worker"), ("register", "worker"), ("wait", "worker"), ("register", "main")]
)
def test_ctrl_c_lets_the_worker_thread_clean_up(
    tmp_path: Path, spawned: list[subprocess.Popen[str]], late: str, thread: str
) -> None:
    # register: the Ctrl-C comes between the fork and the command's registration; the handler found
    # nothing running, raised KeyboardInterrupt and left the command running.
    # wait: the handler stops the command before its thread waits for it; the handler used to reap
    # it too, and the thread's wait4 then died with ECHILD (no "interrupted", no cleanup).
    p = _start_worker(spawned, tmp_path, cleanup_s=1.0, late=late, thread=thread)
    p.send_signal(signal.SIGINT)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err  # the worker's failure ended the run, not a KeyboardInterrupt
    assert "interrupted" in (tmp_path / "error.txt").read_text()
    assert "# interrupted: process group stopped" in (tmp_path / "build.log").read_text()
    assert (tmp_path / "cleaned").read_text() == "yes"
    assert "not started, the run was interrupted" in (tmp_path / "refused.txt").read_text()
    assert not (tmp_path / "next.log").exists()
    assert "cleaning up" in err


def test_a_ctrl_c_another_thread_took_is_answered(tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    # The kernel may hand a Ctrl-C to any thread; Python runs the handler in the main thread, which
    # sat blocked on the queue (as doit's runner does) until the command ended on its own, 300 s on.
    p = _start_worker(spawned, tmp_path, cleanup_s=0.0, thread="bystander")
    _out, err = p.communicate(timeout=30)
    assert p.returncode == 1, err
    assert "interrupted" in (tmp_path / "error.txt").read_text()
    assert "cleaning up" in err


def test_second_ctrl_c_exits_at_once(tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    p = _start_worker(spawned, tmp_path, cleanup_s=120.0)
    p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while not (tmp_path / "error.txt").exists():
        assert p.poll() is None, f"the first Ctrl-C ended the process: {p.communicate()[1]}"
        assert time.monotonic() < deadline, "the first Ctrl-C did not stop the command"
        time.sleep(0.05)
    started = time.monotonic()
    p.send_signal(signal.SIGINT)
    _out, err = p.communicate(timeout=30)
    assert time.monotonic() - started < 10
    # Ended by the handler itself, never a KeyboardInterrupt raised into the thread it landed in.
    assert p.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("interrupted:")]) == 1, err
    assert "exiting now (second signal)" in err, err
    assert not (tmp_path / "cleaned").exists()


def test_a_timeout_before_the_wait_is_a_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The timer stops the command before run() waits for it (as on a loaded host): still the timeout
    # error. The timer used to reap the command, and run()'s wait4 then failed with ECHILD.
    wait4 = os.wait4

    def late(pid: int, options: int) -> tuple[int, int, object]:
        time.sleep(1.0)
        return wait4(pid, options)

    monkeypatch.setattr(proc.os, "wait4", late)
    log = tmp_path / "slow.log"
    with pytest.raises(ReproError, match=r"timed out after 0.2 s; its process group was stopped"):
        proc.run(["sleep", "30"], env=dict(os.environ), log=log, timeout=0.2)
    assert "# timed out after 0.2 s" in log.read_text()


# --------------------------------------------------------------------------- query, stream


def test_query_gives_the_exit_status_and_both_outputs() -> None:
    res = proc.query(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (res.returncode, res.stdout, res.stderr) == (3, b"out\n", b"err\n")
    assert proc.query(["sh", "-c", "echo $X"], env={"X": "é"}, text=True).stdout == "é\n"
    assert proc.query(["sh", "-c", "cat"]).stdout == b""  # stdin is /dev/null
    with pytest.raises(OSError):
        proc.query(["/nonexistent/program"])


def test_query_timeout_stops_the_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    with pytest.raises(proc.TimeoutExpired, match=r"timed out after 0\.5 seconds"):
        proc.query(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout=0.5)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "the background child survived the timeout"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Running (a zombie left to a non-reaping init counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_stream_talks_to_the_command() -> None:
    with proc.stream(["cat"]) as (ask, answer):
        for word in (b"one\n", b"two\n"):
            ask.write(word)
            ask.flush()
            assert answer.readline() == word


_QUERY_WORKER = """
import os, queue, sys, threading
from pathlib import Path
from tasks.core import proc
from tasks.core.errors import ReproError

work = Path(sys.argv[1])
proc.install_interrupt_handler()
done = queue.Queue()

def worker():
    try:
        proc.query(["bash", "-c", f"echo started > {work / 'started'}; sleep 300"])
    except ReproError as exc:
        (work / "error.txt").write_text(f"{type(exc).__name__}: {exc}")
    done.put(1)

threading.Thread(target=worker, daemon=True).start()
done.get()
sys.exit(1)
"""


def test_ctrl_c_stops_a_query_in_a_worker_thread(tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.Popen(
        [sys.executable, "-c", _QUERY_WORKER, str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(repo)),
        stderr=subprocess.PIPE,
        text=True,
    )
    spawned.append(p)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and p.poll() is None, "the query never started"
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert (tmp_path / "error.txt").read_text().startswith("Interrupted: bash -c ")
    assert "interrupted; process group stopped" in (tmp_path / "error.txt").read_text()
    assert "stopped 1 running command(s), cleaning up" in err
