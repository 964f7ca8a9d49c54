"""Compile units on a Ray cluster: where the run's job broker sends a compile instead of a local slot.

With a Ray address (``cluster=``, else ``RAY_ADDRESS``; docs/cluster.md), the run connects to the
cluster as a driver, finds its nodes, and asks each node, in a Ray task pinned to it, for its toolchain
fingerprint (tasks/env/toolchain.py: Python, torch, CUDA, nvcc and the host compilers, found with the
build's own environment). A node whose fingerprint is not the build's is refused by name, with what
differs; the others take the run's compiles:

- the job broker (tasks/engine/jobserver.py) keeps its tokens, one per CPU of the accepted nodes, and its
  priorities (tasks/engine/admission.py); when it admits a compile it asks :meth:`Cluster.place` for a node:
  the one with a free slot and the most memory left beside the expected peaks of what runs there;
- the compile's gate (tasks/outside/gate.py) sends its command line, directory and environment, and the
  broker runs them on that node (:meth:`Cluster.submit`) as a Ray task that asks for the compile's
  CPU threads (nvcc's ``--threads``) and its expected peak memory, the figures the memory admission
  uses; the task (``tasks.outside.gate.run_captured``) samples the compile's memory there and sends back its
  exit status and output;
- every node sees the workspace, the cache and the toolchain at the same paths (a shared
  filesystem; the unit's objects are written there), so a unit compiled on a node is the same object
  as one compiled here, and the wheel the same bytes;
- a node lost mid-unit: the unit runs again on another node (``moved`` in ``units.log``); the Ray
  memory monitor killing a unit counts as a kill for memory (the gate runs it once more with room
  for twice its peak); with no node left, compiles run here; a gate that ends (Ctrl-C, a failed
  build) cancels its task.

Configure, link and packaging stay where ``doit`` runs. Ray is imported only here, and only with an
address: a local build does not import it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.core.console import warn

#: Seconds a node has to answer its fingerprint probe (it imports torch) before it is refused.
PROBE_TIMEOUT_S = 180.0
#: How often one unit may be moved to another node after its node was lost.
MAX_MOVES = 3
#: The fingerprint fields compared between this host and a node (tasks/env/toolchain.py ``fingerprint``).
COMPARED = ("python", "abi", "platform", "torch", "torch_cuda", "torch_cxx11_abi", "cc", "cxx", "cmake",
            "compilers", "nvcc", "nvcc_path")  # fmt: skip

Done = Callable[[dict[str, Any]], None]


def _endpoint(value: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(?:ray://)?\[?([^\]]+?)\]?:(\d+)", value)
    return (m.group(1), int(m.group(2))) if m else None


#: HTTP/2's client connection preface and an empty SETTINGS frame. A Ray GCS and Ray Client's server are gRPC
#: servers: each answers with a SETTINGS frame of its own (RFC 9113, 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def not_grpc(end: tuple[str, int], timeout: float) -> str | None:
    """What is wrong with the head at ``end`` (host, port), in a few words, or None where a gRPC server answers
    there, as a Ray GCS or Ray Client's server does; within ``timeout`` seconds to connect and as many to answer.

    ``ray.init`` at an address where something else answers (the dashboard's HTTP port 8265 given for the
    GCS's 6379) retries for about 14 minutes, logging an address of its own, before it gives up."""
    try:
        conn = socket.create_connection(end, timeout=timeout)
    except OSError as exc:
        return f"the head does not answer ({exc})"
    answer = b""
    try:
        with conn:
            conn.sendall(_H2_PREFACE)
            deadline = time.monotonic() + timeout
            while len(answer) < 9:
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = conn.recv(9 - len(answer))
                if not chunk:
                    break
                answer += chunk
    except OSError:  # (a timeout, a reset)
        pass
    if len(answer) == 9 and answer[3] == 4 and answer[5:9] == bytes(4):  # a SETTINGS frame on stream 0
        return None
    if answer.lower().startswith((b"http/", b"<!doctype", b"<html")):
        said = "an HTTP server answers there, not a Ray GCS (the dashboard's port, 8265, for the GCS's 6379?)"
    elif answer:
        said = "what answers there is not a Ray GCS (it does not speak gRPC)"
    else:
        said = f"what answers there is not a Ray GCS (no gRPC answer within {timeout:g} s)"
    return said


def nvcc_threads(argv: list[str]) -> int:
    """The CPU threads a compile uses: nvcc's ``--threads N`` (``-t N``), else one."""
    if not argv or "nvcc" not in os.path.basename(argv[0]):
        return 1
    for i, arg in enumerate(argv):
        value = ""
        if arg in ("--threads", "-t") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
        if value.isdigit():
            return max(1, int(value))  # 0: as many as it likes; counted as one
    return 1


def differences(here: Mapping[str, Any], there: Mapping[str, Any]) -> list[str]:
    """What differs between two toolchain fingerprints, one phrase per field."""
    out = []
    for key in COMPARED:
        if here.get(key) != there.get(key):
            out.append(f"{key} is {there.get(key)!r} there, {here.get(key)!r} here")
    return out


def probe_node(env: dict[str, str]) -> dict[str, Any]:
    """A node's toolchain fingerprint, found with the build's environment (run in a Ray task on the node)."""
    from tasks.env import toolchain

    return {"host": socket.gethostname(), "fingerprint": toolchain.fingerprint(toolchain.probe(env), cuda=True)}


@dataclass
class Node:
    """A node of the cluster that takes compiles: its slots (CPUs) and memory, and what runs there."""

    id: str
    name: str
    cpus: int
    memory_mb: float
    running: int = 0
    reserved_mb: float = 0.0
    alive: bool = True

    def free_mb(self) -> float:
        return self.memory_mb - self.reserved_mb


def choose_node(nodes: list[Node], expect_mb: float, avoid: tuple[str, ...] = ()) -> Node | None:
    """Where a compile expected to hold ``expect_mb`` goes: of the live nodes (not in ``avoid``, by ID) with a
    free slot (else of all live ones: the broker's tokens are the nodes' slots, so that is a node lost
    meanwhile), those where it fits (else all of them), the one with the most memory left, then the most
    free slots, then by name. None: no live node."""
    live = [n for n in nodes if n.alive and n.id not in avoid]
    open_ = [n for n in live if n.running < n.cpus] or live
    if not open_:
        return None
    fits = [n for n in open_ if n.free_mb() >= expect_mb] or open_
    return min(fits, key=lambda n: (-n.free_mb(), n.running - n.cpus, n.name))


@dataclass
class _Task:
    job: dict[str, Any]
    expect_mb: float
    node: Node | None
    done: Done
    threads: int = 1
    moves: list[str] = field(default_factory=list)
    ref: Any = None
    cancelled: bool = False


class Cluster:
    """A Ray cluster's accepted nodes, and the compiles running on them (one waiter thread)."""

    def __init__(self, ray: Any, address: str, nodes: list[Node]) -> None:
        self._ray = ray
        self.address = address
        self.nodes = nodes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._tasks: dict[Any, _Task] = {}  # ObjectRef -> task
        self._seq = 0
        self._stop = False
        from tasks.outside import gate

        self._run = ray.remote(gate.run_captured)
        self._thread = threading.Thread(target=self._wait, name="cluster-waiter", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        return sum(n.cpus for n in self.nodes if n.alive)

    def describe(self) -> str:
        nodes = ", ".join(f"{n.name} ({n.cpus} CPUs, {n.memory_mb / 1024:.0f} GB)" for n in self.nodes)
        return f"Ray cluster {self.address}: {nodes}"

    def place(self, expect_mb: float, *, avoid: tuple[str, ...] = ()) -> Node | None:
        """The node for a compile expected to hold ``expect_mb``: of the live ones with a free slot, where it
        fits, the one with the most memory left (then the most free slots, then by name); it is reserved."""
        with self._lock:
            return self._place(expect_mb, avoid)

    def _place(self, expect_mb: float, avoid: tuple[str, ...]) -> Node | None:
        node = choose_node(self.nodes, expect_mb, avoid)
        if node is not None:
            node.running += 1
            node.reserved_mb += expect_mb
        return node

    def release(self, handle: object, node: Node | None, expect_mb: float) -> None:
        """A compile placed on ``node`` has ended (its gate closed): its slot and memory there are free, and
        its task (``handle``, if it was sent), if it still runs, is cancelled (a moved task frees its new node)."""
        with self._lock:
            if isinstance(handle, _Task):
                node = handle.node
                if handle.ref in self._tasks and not handle.cancelled:
                    handle.cancelled = True
                    try:
                        self._ray.cancel(handle.ref, force=True)
                    except Exception:  # (a task that ended meanwhile: nothing to stop)
                        pass
            if node is not None:
                node.running -= 1
                node.reserved_mb -= expect_mb

    def submit(self, job: dict[str, Any], expect_mb: float, node: Node, done: Done) -> object:
        """Run the gate's ``job`` on ``node`` (placed by :meth:`place`); ``done`` gets the result (from the
        waiter thread): :func:`tasks.outside.gate.run_captured`'s, with ``node`` and ``moves``, or ``{"local": True}``
        when no node can take it any more. The handle returned cancels it (:meth:`cancel`)."""
        from tasks.env import reproducible

        given = job.get("env")
        env = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
        argv, cwd = reproducible.on_node(list(job.get("argv") or []), str(job.get("cwd") or "/"), env)
        threads = nvcc_threads(list(job.get("argv") or []))
        job = {**job, "argv": argv, "cwd": cwd}
        task = _Task(job=job, expect_mb=expect_mb, node=node, done=done, threads=threads)
        with self._lock:
            self._start(task)
        return task

    def _start(self, task: _Task) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = task.node
        assert node is not None
        memory = int(min(max(task.expect_mb, 1.0), node.memory_mb) * 1024 * 1024)
        task.ref = self._run.options(
            num_cpus=min(task.threads, max(node.cpus, 1)),
            memory=memory,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node.id, soft=False),
            max_retries=0,
            name="reprostack compile",
        ).remote(task.job)
        self._tasks[task.ref] = task
        self._wake.notify_all()

    def _wait(self) -> None:
        ray = self._ray
        while True:
            with self._lock:
                while not self._tasks and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                refs = list(self._tasks)
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            except Exception:  # (the driver's connection is gone: each task's get says why)
                ready = refs
                time.sleep(0.5)
            for ref in ready:
                self._finish(ref)

    def _finish(self, ref: Any) -> None:
        ray = self._ray
        with self._lock:
            task = self._tasks.pop(ref, None)
        if task is None:
            return
        try:
            result: dict[str, Any] = dict(ray.get(ref))
        except Exception as exc:  # (Ray's errors: sorted below)
            failed = self._failed(task, exc)
            if failed is None:
                return  # moved to another node, or cancelled
            result = failed
        if task.cancelled:
            return
        if task.node is not None:
            result["node"] = task.node.name
        result["moves"] = task.moves
        task.done(result)

    def _failed(self, task: _Task, exc: Exception) -> dict[str, Any] | None:
        """A task that raised: cancelled (None), killed by Ray's memory monitor (a kill for memory), lost
        with its node or worker (moved to another node: None), or failed in the gate's code (an error)."""
        from ray import exceptions as rx

        with self._lock:
            if task.cancelled or isinstance(exc, rx.TaskCancelledError) or task.node is None:
                return None
            if isinstance(exc, rx.OutOfMemoryError):
                message = f"reprostack cluster: Ray's memory monitor stopped the compile on {task.node.name}\n"
                return {"code": 137, "killed": True, "seconds": 0.0, "out_bytes": b"", "err_bytes": message.encode()}
            if isinstance(exc, rx.RayTaskError):  # the gate's code raised there: as a compiler that failed
                message = f"reprostack cluster: the compile failed on {task.node.name}: {exc}\n"
                return {"code": 1, "seconds": 0.0, "out_bytes": b"", "err_bytes": message.encode()}
            lost = task.node
            if not self._node_alive(lost.id):
                lost.alive = False
            lost.running -= 1  # its slot and memory go with it to the next node
            lost.reserved_mb -= task.expect_mb
            task.moves.append(lost.name)
            task.node = node = self._place(task.expect_mb, (lost.id,)) if len(task.moves) <= MAX_MOVES else None
            if node is None:
                return {"local": True}
            self._start(task)
        warn(f"cluster: node {lost.name} lost a compile ({exc.__class__.__name__}); it runs again on {node.name}")
        return None

    def _node_alive(self, node_id: str) -> bool:
        try:
            return any(n.get("NodeID") == node_id and n.get("Alive") for n in self._ray.nodes())
        except Exception:
            return False

    def close(self) -> None:
        """Cancel what still runs and leave the cluster."""
        with self._lock:
            self._stop = True
            for task in self._tasks.values():
                task.cancelled = True
                try:
                    self._ray.cancel(task.ref, force=True)
                except Exception:
                    pass
            self._wake.notify_all()
        self._thread.join(timeout=5)
        try:
            self._ray.shutdown()
        except Exception:
            pass


def _names(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Each node's name: its Ray node name (``ray start --node-name``, else its address), with the start of
    its ID where two nodes share one."""
    plain = [str(n.get("NodeName") or n.get("NodeManagerAddress") or "?") for n in nodes]
    return {
        str(n["NodeID"]): (name if plain.count(name) == 1 else f"{name}:{str(n['NodeID'])[:8]}")
        for n, name in zip(nodes, plain, strict=True)
    }


#: Joins through Ray Client (``ray://``) tried where the head's server for this client did not start.
JOIN_ATTEMPTS = 3


#: What a head's Ray Client proxy answers where the server it starts for this client did not come up: said
#: so, or its process already gone (a zombie on a loaded host) when the proxy looked at it. Only these: any
#: other "Initialization failure from server" (a version mismatch) fails the same way again.
CLIENT_SERVER_FAILED = ("Starting Ray client server failed", "psutil.ZombieProcess")


def _client_server_failed(value: str, exc: BaseException) -> bool:
    """Whether joining ``value`` failed because Ray Client's server for this client did not start (its head
    says so), which another join may not meet."""
    return value.startswith("ray://") and any(said in str(exc) for said in CLIENT_SERVER_FAILED)


def connect(value: str, env: dict[str, str], here: Mapping[str, Any], *, timeout: float = 10.0) -> Cluster | None:
    """The cluster at ``value`` with the nodes whose toolchain is this build's (``here``: its fingerprint,
    found with ``env``); None, after one warning, where there is no cluster to build on: the build then
    runs here as without one."""
    try:
        import ray
    except ImportError:
        warn(f"cluster={value}: Ray is not installed (pip install 'reprostack[cluster]'); building here")
        return None
    end = _endpoint(value)
    if end is not None:
        problem = not_grpc(end, timeout)
        if problem is not None:
            warn(f"cluster={value}: {problem}; building here")
            return None
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            ray.init(address=value, namespace="reprostack", log_to_driver=False, logging_level=logging.ERROR)
            break
        except Exception as exc:  # (Ray raises ConnectionError, RuntimeError, ...)
            if attempt < JOIN_ATTEMPTS and _client_server_failed(value, exc):
                # Ray Client's head starts a server process for each client; one that does not come up (a
                # loaded head: CI's 2-core machine saw it) fails this join alone: the next gets another.
                print(f"cluster={value}: Ray Client's server for this run did not start; joining again", flush=True)
                ray.shutdown()
                time.sleep(attempt)
                continue
            warn(f"cluster={value}: cannot join the cluster ({exc.__class__.__name__}: {exc}); building here")
            return None
    listed = [n for n in ray.nodes() if n.get("Alive")]
    names = _names(listed)
    candidates = [n for n in listed if float(n.get("Resources", {}).get("CPU", 0)) >= 1]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(probe_node)
    refs = {
        str(n["NodeID"]): probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=str(n["NodeID"]), soft=False)
        ).remote(env)
        for n in candidates
    }
    accepted = []
    for n in candidates:
        node_id = str(n["NodeID"])
        name = names[node_id]
        try:
            found = ray.get(refs[node_id], timeout=PROBE_TIMEOUT_S)
        except Exception as exc:
            warn(f"cluster: node {name} refused: its toolchain probe failed ({exc.__class__.__name__}: {exc})"[:2000])
            continue
        problems = differences(here, found["fingerprint"])
        if problems:
            why = "; ".join(problems)
            warn(f"cluster: node {name} ({found['host']}) refused: its toolchain is not this build's: {why}")
            continue
        res = n.get("Resources", {})
        accepted.append(Node(node_id, name, int(float(res.get("CPU", 0))), float(res.get("memory", 0)) / 2**20))
    if not accepted:
        warn(f"cluster={value}: no node of the cluster takes compiles with this toolchain; building here")
        ray.shutdown()
        return None
    return Cluster(ray, value, accepted)
