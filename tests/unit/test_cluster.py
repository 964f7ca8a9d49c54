"""The cluster's pure parts (tasks/engine/cluster.py): where a compile goes, what a node's toolchain differs in,
what a compile asks for; the gate's half that runs a compile on a node; the address a run takes.
tests/integration/test_cluster.py builds on a real Ray cluster."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.core.errors import ReproError
from tasks.core.settings import cluster_address
from tasks.engine import cluster
from tasks.engine.cluster import Node, choose_node, differences, not_grpc, nvcc_threads
from tasks.env import reproducible
from tasks.outside import gate

REPO = Path(__file__).resolve().parents[2]


def _nodes() -> list[Node]:
    return [Node("1", "a", cpus=2, memory_mb=8000), Node("2", "b", cpus=2, memory_mb=32000)]


def test_a_compile_goes_where_it_fits_with_the_most_memory_left() -> None:
    a, b = _nodes()
    assert choose_node([a, b], 4000) is b
    b.reserved_mb = 30000  # b's memory is taken by what runs there: a has more left
    assert choose_node([a, b], 1000) is a
    b.reserved_mb = 0
    b.running = 2  # b is full: a takes it, though b has more memory
    assert choose_node([a, b], 1000) is a


def test_a_heavy_compile_waits_for_no_node_but_goes_to_the_roomiest() -> None:
    a, b = _nodes()
    a.reserved_mb, b.reserved_mb = 1000, 31000
    assert choose_node([a, b], 20000) is a  # fits nowhere: the node with the most memory left


def test_lost_and_avoided_nodes_take_nothing() -> None:
    a, b = _nodes()
    b.alive = False
    assert choose_node([a, b], 1000) is a
    assert choose_node([a, b], 1000, avoid=("1",)) is None


def test_ties_go_by_free_slots_then_name() -> None:
    a, b = Node("1", "b", 4, 8000), Node("2", "a", 4, 8000)
    assert choose_node([a, b], 0).name == "a"
    b.running = 1
    b.reserved_mb = 0
    assert choose_node([a, b], 0).name == "b"


def test_a_compile_asks_for_nvccs_threads() -> None:
    assert nvcc_threads(["/usr/local/cuda/bin/nvcc", "-c", "x.cu", "--threads", "4"]) == 4
    assert nvcc_threads(["nvcc", "--threads=2", "-c", "x.cu"]) == 2
    assert nvcc_threads(["nvcc", "-t", "8", "-c", "x.cu"]) == 8
    assert nvcc_threads(["nvcc", "-t", "0", "-c", "x.cu"]) == 1
    assert nvcc_threads(["g++", "-t", "8", "-c", "x.cc"]) == 1
    assert nvcc_threads([]) == 1


def test_a_nodes_differences_are_named_field_by_field() -> None:
    here = {"python": "3.12.3", "cxx": "g++ 13.3.0", "nvcc": "release 13.0", "torch": "2.11.0"}
    assert differences(here, dict(here)) == []
    found = differences(here, {**here, "cxx": "g++ 12.2.0", "torch": "2.10.0"})
    assert found == ["torch is '2.10.0' there, '2.11.0' here", "cxx is 'g++ 12.2.0' there, 'g++ 13.3.0' here"]


def test_only_compiles_of_sources_may_leave_the_host() -> None:
    assert gate.compiles(["g++", "-c", "a.cc", "-o", "a.o"])
    assert gate.compiles(["nvcc", "-shared", "vadd.cu", "-o", "v.so"])  # compile and link in one: a compile
    assert not gate.compiles(["g++", "-shared", "a.o", "b.o", "-o", "x.so"])  # a link
    assert not gate.compiles(["nvcc", "-E", "a.cu"])  # a preprocessor run (ccache's)
    assert not gate.compiles(["g++", "--version"])


def test_a_node_enters_the_builds_canonical_view() -> None:
    env = {reproducible.ENV_STAGE: "/shared/build/stage/pkg", reproducible.ENV_STAGE_SEEN: "/tmp/reprostack-build/pkg"}
    argv, cwd = reproducible.on_node(["g++", "-c", "a.cc"], "/tmp/reprostack-build/pkg/src", env)
    assert cwd == "/"
    assert argv[-3:] == ["g++", "-c", "a.cc"]
    assert argv[argv.index("reprostack-build") + 1 :][:3] == [
        "/shared/build/stage/pkg", "/tmp/reprostack-build/pkg", "/tmp/reprostack-build/pkg/src",
    ]  # fmt: skip
    assert argv[0] == "unshare" and "--mount" in argv
    # a compile outside the view, or a build without one, runs as it is
    assert reproducible.on_node(["g++"], "/elsewhere", env) == (["g++"], "/elsewhere")
    assert reproducible.on_node(["g++"], "/tmp/reprostack-build/pkg", {}) == (["g++"], "/tmp/reprostack-build/pkg")


def test_a_compile_run_for_a_node_returns_its_status_output_and_memory(tmp_path: Path) -> None:
    job = {
        "argv": [sys.executable, "-c", "import sys; b = bytearray(64 << 20); print('out'); "
                 "print('err', file=sys.stderr); sys.exit(3)"],
        "cwd": str(tmp_path),
        "env": {"PATH": "/usr/bin:/bin"},
    }  # fmt: skip
    found = gate.run_captured(job)
    assert found["code"] == 3 and not found["killed"]
    assert found["out_bytes"] == b"out\n" and found["err_bytes"] == b"err\n"
    assert isinstance(found["peak_mb"], float) and found["peak_mb"] >= 64
    missing = gate.run_captured({**job, "cwd": str(tmp_path / "gone")})
    assert missing["code"] == 127 and b"cannot run" in missing["err_bytes"]


def test_a_killed_compile_is_reported_as_killed(tmp_path: Path) -> None:
    found = gate.run_captured(
        {"argv": ["sh", "-c", "kill -9 $$"], "cwd": str(tmp_path), "env": {"PATH": "/usr/bin:/bin"}}
    )
    assert found["code"] == 137 and found["killed"]


def test_the_address_comes_from_cluster_else_ray_address() -> None:
    assert cluster_address("ray://head:10001", {}) == "ray://head:10001"
    assert cluster_address("", {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert cluster_address("off", {"RAY_ADDRESS": "10.0.0.1:6379"}) == ""
    assert cluster_address("auto", {}) == "auto"
    assert cluster_address("", {}) == ""
    with pytest.raises(ReproError, match=r"cluster='ray:/x': give a Ray address"):
        cluster_address("ray:/x", {})
    # the dashboard's address, as `ray job submit` reads RAY_ADDRESS: not a cluster to build on
    assert cluster_address("", {"RAY_ADDRESS": "http://127.0.0.1:8265"}) == ""
    with pytest.raises(ReproError):
        cluster_address("head:99999", {})


def test_a_local_build_does_not_import_ray() -> None:
    """Ray is imported only inside tasks/engine/cluster.py's functions, which run only with a cluster address."""
    for path in sorted((REPO / "tasks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m == "ray" or m.startswith("ray.")], path
    code = "import sys, tasks.cli.dodo, tasks.engine.cluster, tasks.engine.jobserver; print('ray' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "REPRO_LOCK": "examples/example.lock"})  # fmt: skip
    assert res.stdout.strip().splitlines()[-1] == "False", res.stdout + res.stderr


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[int]:
    """A real HTTP server on loopback (as the dashboard's port 8265 is): its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_server_given_as_the_cluster_is_one_warning_in_seconds(http_server: int) -> None:
    """cluster=HOST:PORT where an HTTP server answers: Ray's own retries took about 14 minutes and logged an
    address of its own (the host's, for 127.0.0.1) before the warning. Now one warning of ours, naming the
    address as given, within the timeout, and nothing of Ray's; the build then runs here (None)."""
    address = f"127.0.0.1:{http_server}"
    code = f"from tasks.engine.cluster import connect; print(connect({address!r}, {{}}, {{}}, timeout=5))"
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 90  # ray's import included; the probe itself takes milliseconds
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "None", res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [
        f"WARNING: cluster={address}: an HTTP server answers there, not a Ray GCS (the dashboard's port, 8265, "
        "for the GCS's 6379?); building here"
    ], res.stderr


def test_the_head_probe_knows_grpc_from_silence_and_from_nothing() -> None:
    """A gRPC server (as a Ray GCS and Ray Client's server are) passes; one that accepts and says nothing is
    given up after the timeout; a closed port is the head not answering."""
    grpc = pytest.importorskip("grpc")  # (Ray's own dependency: the cluster extra installs it)
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert not_grpc(("127.0.0.1", port), 10) is None
    finally:
        server.stop(0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        start = time.monotonic()
        said = not_grpc(silent.getsockname(), 1.0)
        assert said is not None and "no gRPC answer within 1 s" in said
        assert time.monotonic() - start < 30
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()
    said = not_grpc(free, 5)
    assert said is not None and said.startswith("the head does not answer")


def test_only_a_ray_client_server_that_did_not_start_is_joined_again() -> None:
    """connect() joins once more where the head says Ray Client's server for this client did not start (the
    message Ray's proxier gives); any other failure, or a join at a GCS address, falls back to building here."""
    said = ConnectionAbortedError(
        "Initialization failure from server:\nRuntimeError: Starting Ray client server failed. See "
        "ray_client_server_23000.err for detailed logs."
    )
    assert cluster._client_server_failed("ray://10.0.0.1:10001", said)
    assert not cluster._client_server_failed("10.0.0.1:6379", said)
    # Its server's process gone before the proxy read its command line (seen in a loaded CI run).
    zombie = ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n  ...\n"
        "psutil.ZombieProcess: PID still exists but it's a zombie (pid=27765)\n"
    )
    assert cluster._client_server_failed("ray://127.0.0.1:43145", zombie)
    other = ConnectionAbortedError("Initialization failure from server:\nRuntimeError: Version mismatch: ...")
    assert not cluster._client_server_failed("ray://10.0.0.1:10001", other)
    assert not cluster._client_server_failed("ray://10.0.0.1:10001", ConnectionError("ray client connection timeout"))
