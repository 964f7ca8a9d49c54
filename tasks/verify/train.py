"""``doit verify train=on``: a few FP8 MoE training steps on every GPU of the host, in the verification venv.

:func:`train_rows` copies tasks/outside/train_gpt.py into the run's scratch directory and runs it in two ways
with the venv's interpreter (the wheelhouse and the base's torch, nothing of this checkout):

1. ``train_gpt.py --preflight``: imports every component of the stack (megatron_core, transformer_engine,
   flash_attn_3, grouped_gemm, apex) and asks each package whether it sees the others, before any GPU work; a
   component missing fails the training rows, each naming it, and nothing is launched. Without a GPU (or with
   ``gpu=off``, or GPUs other than sm_90, which FlashAttention 3 needs) the rows are SKIP, never PASS.
2. ``python -m torch.distributed.run --standalone --nproc-per-node N train_gpt.py``, one rank per GPU, through
   tasks/core/proc.py (its own process group, its output in ``LOG_DIR/train.log``, the ranks' in
   ``train.rank<R>.log``), stopped after :data:`TRAIN_TIMEOUT_S`; on Ctrl-C or the timeout, torchrun's process
   group is stopped, each rank dies with torchrun (``PR_SET_PDEATHSIG``), and any rank still there afterwards
   (named by the pid and start time it reported) is stopped too and named in ``train-launch``.

:func:`judge` (pure) reads the ranks' events into one row per check (:data:`CHECKS`), with the tolerances below,
and ``WORK/train.json`` keeps the figures (loss curves, step times, peak memory per rank, the evidence).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core import procfs
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.proc import signal_text
from tasks.verify.report import Row, Status, one_line
from tasks.verify.session import TOOL_TIMEOUT_S, VerifySession

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "outside" / "train_gpt.py"
PACKAGE = "training"
#: Seconds the whole torchrun may take: two runs of 20 steps of a tiny model, and their start (NCCL, TE and
#: torch.compile's first kernels) take a few minutes at most.
TRAIN_TIMEOUT_S = 900.0
STEPS = 20
RUNS = ("bf16", "fp8")
#: Each run's last loss at most this fraction of its first.
LOSS_FALLS_TO = 0.7
#: The fp8 run trains no worse than the bf16 run by more than this fraction of the bf16 run's first loss: its mean
#: loss over the steps and its last loss at most that above the bf16 run's; and both start from the same loss
#: (the same weights and batch) to :data:`FP8_FIRST_STEP`. Not step by step: in the steep part of the curve a
#: tiny model's two runs drop a few steps apart, FP8 earlier as often as later (on one H200, fp8 7.03 -> 0.91
#: and bf16 7.04 -> 1.89, 1.7 apart at step 11; on four, fp8 0.14 above bf16 at the end). An FP8 path that does
#: not train (a wrong scale, garbage GEMMs) stays near the first loss: its mean is about 3 above, far outside.
FP8_TOLERANCE = 0.1
#: The fp8 and bf16 runs' first losses (before any update: only the forward's FP8 rounding) agree to this fraction.
FP8_FIRST_STEP = 0.01
#: Ranks report the data-parallel average of the loss: they agree to this relative difference.
RANKS_AGREE = 1e-5
#: Seconds a rank has to exit after torchrun ended before it counts as a stray (and is stopped).
STRAY_SETTLE_S = 10.0
#: Steps left out of the step time (the first kernels compile and tune).
WARMUP_STEPS = 3
CHECKS = (
    "train-launch",
    "train-fp8",
    "train-fa3-backend",
    "train-grouped-gemm",
    "train-apex",
    "train-dist-optimizer",
    "train-finite",
    "train-loss-falls",
    "train-fp8-vs-bf16",
    "train-figures",
)
#: The components (tasks/outside/train_gpt.py COMPONENTS) a row is about, besides torch and megatron_core.
NEEDS: dict[str, tuple[str, ...]] = {
    "train-fp8": ("transformer_engine",),
    "train-fa3-backend": ("flash_attn_3", "transformer_engine"),
    "train-grouped-gemm": ("grouped_gemm",),
    "train-apex": ("apex",),
}


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How torchrun ended."""

    ranks: int
    returncode: int = 0
    timed_out: bool = False
    timeout: float = TRAIN_TIMEOUT_S
    log: str = ""
    log_dir: str = ""
    #: ranks that outlived torchrun, stopped afterwards: (rank, pid)
    strays: tuple[tuple[int, int], ...] = ()
    #: ranks torchrun's log says ended badly: (local rank, exit code; negative: the signal), by torchrun_exits()
    exits: tuple[tuple[int, int], ...] = ()
    steps: int = STEPS
    runs: tuple[str, ...] = RUNS


@dataclass
class _Ranks:
    """Every rank's events, by rank."""

    events: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def of(self, rank: int, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events.get(rank, []) if e.get("event") == event]

    def one(self, rank: int, event: str, run: str | None = None) -> dict[str, Any] | None:
        found = [e for e in self.of(rank, event) if run is None or e.get("run") == run]
        return found[-1] if found else None

    def steps(self, rank: int, run: str) -> dict[int, dict[str, Any]]:
        return {int(e["step"]): e for e in self.of(rank, "step") if e.get("run") == run}


def train_rows(
    session: VerifySession,
    *,
    entry: Path | None = None,
    args: Sequence[str] = (),
    timeout: float = TRAIN_TIMEOUT_S,
    steps: int = STEPS,
) -> list[Row]:
    """The training rows of ``session``'s venv. ``entry``: a script run instead of train_gpt.py, beside a copy
    of it (a stand-in that imports it, for the tests); ``args``: more arguments for the script."""
    work = session.scratch / "train"
    rmtree(work)
    (session.work_dir / "train.json").unlink(missing_ok=True)  # an earlier run's figures are not this one's
    work.mkdir(parents=True)
    script = work / TRAIN_SCRIPT.name
    shutil.copyfile(TRAIN_SCRIPT, script)
    if entry is not None:
        script = work / entry.name
        shutil.copyfile(entry, script)
    python = str(session.venv_python)
    found = work / "preflight.json"
    pre = session.run(
        [python, str(script), "--preflight", str(found), *args], log="train-preflight", timeout=TOOL_TIMEOUT_S, cwd=work
    )
    if not pre.ok or not found.is_file():
        return _all(CHECKS, "FAIL", pre.failure("the training check's preflight (train_gpt.py --preflight)"))
    preflight: dict[str, Any] = json.loads(found.read_text(encoding="utf-8"))
    missing = {name: c for name, c in preflight.get("components", {}).items() if not c.get("ok")}
    if missing:
        return missing_rows(missing)
    if session.gpu == "off":
        return _all(CHECKS, "SKIP", "gpu=off: the training check needs the GPUs")
    if preflight.get("skip"):
        status: Status = "FAIL" if session.gpu == "on" else "SKIP"
        return _all(CHECKS, status, str(preflight["skip"]))
    ranks = int(preflight.get("ranks", 0))
    if ranks < 1:
        return _all(CHECKS, "FAIL", f"the preflight found no rank to start: {preflight}")
    for rank in range(ranks):
        session.log(f"train.rank{rank}")  # emptied: each rank appends its output there
    out = work / "ranks"
    out.mkdir()
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        str(script),
        "--out",
        str(out),
        "--log-dir",
        str(session.log_dir),
        "--steps",
        str(steps),
        *args,
    ]
    strays: list[tuple[int, int]] = []
    try:
        done = session.run(cmd, log="train", timeout=timeout, cwd=work)
    finally:
        strays = stop_strays(read_ranks(out))  # on Ctrl-C too: no rank outlives the run
    records = read_ranks(out)
    launch = Launch(
        ranks=ranks,
        returncode=done.returncode,
        timed_out=done.timed_out,
        timeout=timeout,
        log=str(done.log),
        log_dir=str(session.log_dir),
        strays=tuple(strays),
        steps=steps,
        exits=torchrun_exits(done.output),
    )
    rows = judge(preflight, records, launch)
    write_atomic(session.work_dir / "train.json", json.dumps(summary(preflight, records, launch, rows), indent=2))
    return rows


#: torchrun's line for each rank that ended badly (torch/distributed/elastic/multiprocessing/api.py)
_TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: \d+\)")


def torchrun_exits(output: str) -> tuple[tuple[int, int], ...]:
    """The (local rank, exit code) of each rank torchrun's output says failed, in its order; () if it says none."""
    return tuple((int(m[2]), int(m[1])) for m in _TORCHRUN_FAILED.finditer(output))


def read_ranks(out: Path) -> dict[int, list[dict[str, Any]]]:
    """``rank<R>.jsonl`` of ``out``, by rank (a line cut short by a killed rank is left out)."""
    found: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("rank*.jsonl")) if out.is_dir() else []:
        try:
            rank = int(path.stem.removeprefix("rank"))
        except ValueError:
            continue
        events = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "event" in event:
                events.append(event)
        found[rank] = events
    return found


def stop_strays(
    records: Mapping[int, list[dict[str, Any]]], grace: float = 2.0, settle: float = STRAY_SETTLE_S
) -> list[tuple[int, int]]:
    """Stop every rank still running ``settle`` seconds after torchrun ended, as named by its ``start`` event (pid
    and start time: not a later process that took the pid); the (rank, pid) of each. A rank killed with torchrun
    may take a moment to exit (its memory released), and is not one."""
    started = {}
    for rank, events in records.items():
        for event in events:
            if event.get("event") == "start" and isinstance(event.get("pid"), int):
                started[rank] = (int(event["pid"]), str(event.get("start", "")))

    def alive() -> list[int]:
        pids = []
        for pid, start in started.values():
            p = procfs.process(pid)
            if p is not None and p.state != "Z" and (not start or p.start == start):
                pids.append(pid)
        return pids

    deadline = time.monotonic() + settle
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = set(alive())
    if left:
        procfs.stop(alive, grace)
    return sorted((rank, pid) for rank, (pid, _start) in started.items() if pid in left)


def _all(checks: Iterable[str], status: Status, detail: str) -> list[Row]:
    return [Row(package=PACKAGE, check=check, status=status, detail=detail) for check in checks]


def missing_rows(missing: Mapping[str, Mapping[str, Any]]) -> list[Row]:
    """Every row FAIL, each naming what the venv lacks: its own components where it has some among them."""
    said = "; ".join(f"{name}: {c.get('detail', '')}" for name, c in missing.items())
    rows = []
    for check in CHECKS:
        own = [name for name in (*NEEDS.get(check, ()), "torch", "megatron_core") if name in missing]
        if own and check != "train-launch":
            detail = "; ".join(f"{name} missing from the venv ({missing[name].get('detail', '')})" for name in own)
        else:
            detail = f"not launched: the venv lacks {', '.join(missing)} ({said}); checked before any GPU work"
        rows.append(Row(package=PACKAGE, check=check, status="FAIL", detail=detail))
    return rows


# --------------------------------------------------------------------------- the judgement (pure)


def _where(ranks: _Ranks, rank: int) -> str:
    """Where a rank got to: its last step, or the phase it was in."""
    events = ranks.events.get(rank, [])
    if not events:
        return "never started"
    last = events[-1]
    kind = last.get("event")
    if kind == "step":
        return f"{last.get('run')} step {last.get('step')}"
    if kind == "built":
        return f"{last.get('run')} model built, before step 0"
    if kind == "facts":
        return f"after the {last.get('run')} run"
    if kind == "fail":
        return _failed_at(last)
    known = {"start": "setting up (NCCL, megatron_core's groups)", "layout": "building the model", "done": "done"}
    if kind in known:
        return known[str(kind)]
    return f"{kind} at {last.get('run')} step {last.get('step')}" if "step" in last else str(kind)


def _failed_at(event: Mapping[str, Any]) -> str:
    run, step = event.get("run"), event.get("step")
    if run is None:
        return "while setting up"
    if step is None:
        return f"in the {run} run, outside a step"
    return f"in the {run} run at step {step}"


def _rank_log(launch: Launch, rank: int) -> str:
    return str(Path(launch.log_dir) / f"train.rank{rank}.log") if launch.log_dir else f"train.rank{rank}.log"


def _launch_problem(ranks: _Ranks, launch: Launch) -> str | None:
    """Why the launch did not finish, or None: the first rank that failed, and where; a timeout; torchrun's end."""
    failures = sorted(
        ((e, r) for r in ranks.events for e in ranks.of(r, "fail")), key=lambda pair: float(pair[0].get("t", 0))
    )
    where = ", ".join(f"rank {r}: {_where(ranks, r)}" for r in range(launch.ranks))
    stray = (
        "; " + ", ".join(f"rank {r} (pid {pid})" for r, pid in launch.strays) + " outlived torchrun and were stopped"
        if launch.strays
        else ""
    )
    if failures:
        event, rank = failures[0]
        others = sorted({r for _e, r in failures[1:] if r != rank})
        also = f"; ranks {', '.join(map(str, others))} failed too" if others else ""
        return (
            f"rank {rank} failed {_failed_at(event)}: {event.get('error', '?')} "
            f"(log: {_rank_log(launch, rank)}){also}; where each rank was: {where}{stray}"
        )
    if launch.timed_out:
        return (
            f"timed out after {launch.timeout:g} s; torchrun and every rank were stopped; where each rank was: "
            f"{where}{stray}; logs: {launch.log}, {_rank_log(launch, 0)}"
        )
    not_done = [r for r in range(launch.ranks) if not ranks.of(r, "done")]
    if launch.returncode != 0 and not not_done:
        how = signal_text(launch.returncode)
        died = ", ".join(f"rank {r} ({signal_text(code)}, log: {_rank_log(launch, r)})" for r, code in launch.exits)
        return (
            f"every rank reported done, yet torchrun ended ({how}): "
            + (f"{died} ended badly after its last step, at its exit" if died else "torchrun's log names no rank")
            + f"{stray}; log: {launch.log}"
        )
    if launch.returncode != 0 or not_done:
        how = signal_text(launch.returncode) if launch.returncode else "exit status 0"
        return (
            f"torchrun ended ({how}) with ranks {', '.join(map(str, not_done)) or 'none'} unfinished and no rank "
            f"saying why; where each rank was: {where}{stray}; log: {launch.log}"
        )
    return None


def _per_rank_facts(ranks: _Ranks, launch: Launch) -> dict[tuple[int, str], dict[str, Any]] | None:
    found = {}
    for rank in range(launch.ranks):
        for run in launch.runs:
            facts = ranks.one(rank, "facts", run)
            if facts is None:
                return None
            found[(rank, run)] = facts
    return found


def _check(
    name: str,
    facts: Mapping[tuple[int, str], Mapping[str, Any]],
    problem: Callable[[int, str, Mapping[str, Any]], str | None],
    passed: str,
) -> Row:
    """FAIL naming the first rank and run where ``problem`` says what is wrong; else PASS with ``passed``."""
    for (rank, run), f in sorted(facts.items()):
        wrong = problem(rank, run, f)
        if wrong:
            return Row(package=PACKAGE, check=name, status="FAIL", detail=f"rank {rank}, {run} run: {wrong}")
    return Row(package=PACKAGE, check=name, status="PASS", detail=passed)


def _fp8_row(facts: Mapping[tuple[int, str], Mapping[str, Any]]) -> Row:
    def problem(rank: int, run: str, f: Mapping[str, Any]) -> str | None:
        te = f.get("te", {})
        linear, fp8 = int(te.get("linear_forwards", 0)), int(te.get("fp8_forwards", 0))
        if linear == 0:
            return "no TE linear layer ran"
        if run == "fp8" and fp8 != linear:
            return f"{fp8} of {linear} TE linear forwards ran in FP8 (all should)"
        if run != "fp8" and fp8:
            return f"{fp8} TE linear forwards ran in FP8 in a bf16 run"
        return None

    sample = next((f for (_r, run), f in facts.items() if run == "fp8"), {})
    te = sample.get("te", {})
    recipes = ", ".join(te.get("recipes", [])) or "?"
    return _check(
        "train-fp8",
        facts,
        problem,
        f"TE's linear layers ran in FP8 ({recipes}) in all {te.get('linear_forwards', '?')} forwards of rank 0's fp8 "
        "run, on every rank; none in the bf16 run",
    )


def _fa3_row(facts: Mapping[tuple[int, str], Mapping[str, Any]]) -> Row:
    def problem(rank: int, run: str, f: Mapping[str, Any]) -> str | None:
        att = f.get("attention", {})
        backends = att.get("backends", {})
        if not att.get("forwards"):
            return "no attention forward ran"
        other = [name for name in backends if not str(name).startswith("FlashAttention (3")]
        if other:
            return f"TE's DotProductAttention selected {', '.join(other)}, not FlashAttention 3"
        if not att.get("fa3_calls"):
            return "TE selected FlashAttention 3 but never called flash_attn_3"
        return None

    sample = next(iter(facts.values()), {})
    att = sample.get("attention", {})
    kernels = sample.get("kernels", {})
    seen = f"; {kernels['flash_attn_3']} FA3 kernel launches in a profiled step" if kernels.get("flash_attn_3") else ""
    return _check(
        "train-fa3-backend",
        facts,
        problem,
        f"TE's DotProductAttention ran {', '.join(att.get('backends', {})) or '?'} in every forward of every rank "
        f"and run; {att.get('fa3_calls', '?')} calls into flash_attn_3 on rank 0's first run{seen}",
    )


def _grouped_gemm_row(facts: Mapping[tuple[int, str], Mapping[str, Any]], layout: Mapping[str, Any]) -> Row:
    def problem(rank: int, run: str, f: Mapping[str, Any]) -> str | None:
        ex = f.get("experts", {})
        if ex.get("modules") != ["GroupedMLP"]:
            return f"the experts are {', '.join(ex.get('modules', [])) or 'missing'}, not megatron_core's GroupedMLP"
        if not ex.get("grouped_gemm_forwards"):
            return f"GroupedMLP ran {ex.get('forwards', 0)} forwards, none through grouped_gemm's gmm"
        return None

    ex = next(iter(facts.values()), {}).get("experts", {})
    return _check(
        "train-grouped-gemm",
        facts,
        problem,
        f"{ex.get('moe_layers', '?')} MoE layers of {layout.get('experts', '?')} experts "
        f"({ex.get('local_experts', '?')} per rank, EP={layout.get('ep', '?')}): megatron_core's GroupedMLP through "
        "grouped_gemm.ops.gmm, "
        f"{ex.get('grouped_gemm_forwards', '?')} grouped GEMM forwards on rank 0's first run, some on every rank",
    )


def _apex_row(facts: Mapping[tuple[int, str], Mapping[str, Any]]) -> Row:
    def problem(rank: int, run: str, f: Mapping[str, Any]) -> str | None:
        ln = f.get("layernorm", {})
        if not ln.get("apex_modules"):
            return "no megatron_core FusedLayerNorm in the model"
        if not ln.get("apex_forwards") or ln.get("apex_forwards") != ln.get("forwards"):
            return f"{ln.get('apex_forwards', 0)} of {ln.get('forwards', 0)} FusedLayerNorm forwards ran apex's kernel"
        return None

    ln = next(iter(facts.values()), {}).get("layernorm", {})
    return _check(
        "train-apex",
        facts,
        problem,
        f"q/k layer norms: {ln.get('apex_modules', '?')} megatron_core FusedLayerNorm on apex's fused_layer_norm_cuda,"
        f" {ln.get('apex_forwards', '?')} forwards on rank 0's first run, all of them on every rank (megatron_core "
        "0.14 takes Adam and its multi-tensor kernels from TE, not apex)",
    )


def _optimizer_row(facts: Mapping[tuple[int, str], Mapping[str, Any]], layout: Mapping[str, Any]) -> Row:
    sharded = int(layout.get("dp", 1)) > 1 or int(layout.get("edp", 1)) > 1

    def problem(rank: int, run: str, f: Mapping[str, Any]) -> str | None:
        opt = f.get("optimizer", {})
        parts = opt.get("parts", [])
        if not parts or any(p != "DistributedOptimizer" for p in parts):
            return (
                f"the optimizer is {opt.get('name', '?')} of {', '.join(parts) or 'nothing'}, not DistributedOptimizer"
            )
        share = opt.get("shard_fraction")
        if sharded and not (isinstance(share, (int, float)) and share < 1.0):
            return f"the distributed optimizer updates {share} of this rank's parameters: not sharded"
        return None

    opt = next(iter(facts.values()), {}).get("optimizer", {})
    return _check(
        "train-dist-optimizer",
        facts,
        problem,
        f"{opt.get('name', '?')} of {len(opt.get('parts', []))} DistributedOptimizer over "
        f"{', '.join(opt.get('inner', [])) or '?'}; rank 0 updates {opt.get('shard_fraction', '?')} of its "
        f"parameters (DP={layout.get('dp', '?')}, expert DP={layout.get('edp', '?')})",
    )


def _curves(ranks: _Ranks, launch: Launch) -> tuple[dict[str, list[float]], str | None]:
    """Rank 0's loss per run and step; what disagrees between ranks, if anything."""
    curves: dict[str, list[float]] = {}
    for run in launch.runs:
        steps = ranks.steps(0, run)
        curves[run] = [float(steps[i]["loss"]) for i in range(launch.steps) if i in steps]
        for rank in range(1, launch.ranks):
            theirs = ranks.steps(rank, run)
            for i, mine in steps.items():
                if i not in theirs:
                    continue
                a, b = float(mine["loss"]), float(theirs[i]["loss"])
                if math.isfinite(a) and math.isfinite(b) and abs(a - b) > RANKS_AGREE * max(abs(a), abs(b), 1e-12):
                    return curves, f"ranks disagree on the loss at {run} step {i}: rank 0 {a:.6g}, rank {rank} {b:.6g}"
    return curves, None


def _finite_row(ranks: _Ranks, launch: Launch, complete: bool, problem: str | None) -> Row:
    for rank in sorted(ranks.events):
        for run in launch.runs:
            for i, event in sorted(ranks.steps(rank, run).items()):
                bad = [k for k in ("loss", "grad_norm") if not _finite(event.get(k))]
                if bad:
                    said = ", ".join(f"{k} {event.get(k)}" for k in bad)
                    return Row(
                        package=PACKAGE,
                        check="train-finite",
                        status="FAIL",
                        detail=f"rank {rank}, {run} run, step {i}: {said}",
                    )
    if not complete:
        return _not_reached("train-finite", problem)
    n = launch.steps * len(launch.runs)
    return Row(
        package=PACKAGE,
        check="train-finite",
        status="PASS",
        detail=f"loss and gradient norm finite at all {n} steps of every rank",
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _not_reached(check: str, problem: str | None) -> Row:
    """FAIL: the check's evidence never came; the cause's first part (train-launch has all of it)."""
    cause = (problem or "?").split("; where each rank was")[0]
    return Row(package=PACKAGE, check=check, status="FAIL", detail=f"not reached: {one_line(cause, 200)}")


def _loss_rows(curves: Mapping[str, list[float]], launch: Launch, disagree: str | None) -> list[Row]:
    if disagree:
        falls = Row(package=PACKAGE, check="train-loss-falls", status="FAIL", detail=disagree)
    else:
        wrong = [
            f"{run}: {c[0]:.4f} -> {c[-1]:.4f} (needs at most {LOSS_FALLS_TO:g} x the first = "
            f"{LOSS_FALLS_TO * c[0]:.4f})"
            for run, c in curves.items()
            if not c[-1] <= LOSS_FALLS_TO * c[0]
        ]
        said = ", ".join(f"{run} {c[0]:.4f} -> {c[-1]:.4f}" for run, c in curves.items())
        falls = Row(
            package=PACKAGE,
            check="train-loss-falls",
            status="FAIL" if wrong else "PASS",
            detail="; ".join(wrong)
            if wrong
            else f"{said} over {launch.steps} steps (the last at most {LOSS_FALLS_TO:g} x the first)",
        )
    bf16, fp8 = curves.get("bf16", []), curves.get("fp8", [])
    if not bf16 or not fp8:
        versus = Row(package=PACKAGE, check="train-fp8-vs-bf16", status="SKIP", detail="not both runs were asked for")
        return [falls, versus]
    allowed = FP8_TOLERANCE * bf16[0]
    mean_fp8, mean_bf16 = statistics.fmean(fp8), statistics.fmean(bf16)
    problems = []
    if abs(fp8[0] - bf16[0]) > FP8_FIRST_STEP * bf16[0]:
        problems.append(f"first losses apart: fp8 {fp8[0]:.4f}, bf16 {bf16[0]:.4f} (at most {FP8_FIRST_STEP:g} x)")
    if mean_fp8 > mean_bf16 + allowed:
        problems.append(f"mean loss fp8 {mean_fp8:.4f} above bf16 {mean_bf16:.4f} by more than {allowed:.4f}")
    if fp8[-1] > bf16[-1] + allowed:
        problems.append(f"last loss fp8 {fp8[-1]:.4f} above bf16 {bf16[-1]:.4f} by more than {allowed:.4f}")
    diffs = [a - b for a, b in zip(fp8, bf16, strict=False)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    told = (
        f"mean loss fp8 {mean_fp8:.4f}, bf16 {mean_bf16:.4f}; last fp8 {fp8[-1]:.4f}, bf16 {bf16[-1]:.4f}; "
        f"tolerance {allowed:.4f} = {FP8_TOLERANCE:g} x the first bf16 loss, fp8 no worse by more; widest apart at "
        f"step {worst} (fp8 {fp8[worst]:.4f}, bf16 {bf16[worst]:.4f})"
    )
    versus = Row(
        package=PACKAGE,
        check="train-fp8-vs-bf16",
        status="FAIL" if problems else "PASS",
        detail="; ".join(problems) + f" -- {told}" if problems else told,
    )
    return [falls, versus]


def _same_start(ranks: _Ranks, launch: Launch) -> str | None:
    for rank in range(launch.ranks):
        sums = {run: (ranks.one(rank, "built", run) or {}).get("init_checksum") for run in launch.runs}
        values = [v for v in sums.values() if isinstance(v, (int, float))]
        if len(values) == len(launch.runs) and max(values) - min(values) > 1e-6 * max(abs(v) for v in values):
            return f"rank {rank}: the runs did not start from the same weights (checksums {sums})"
    return None


def _figures_row(ranks: _Ranks, launch: Launch) -> Row:
    parts = []
    for run in launch.runs:
        medians = []
        for rank in range(launch.ranks):
            times = [float(e["time_s"]) for i, e in sorted(ranks.steps(rank, run).items()) if i >= WARMUP_STEPS]
            if times:
                medians.append(statistics.median(times))
        if medians:
            slowest = max(medians)
            parts.append(f"{run}: {1 / slowest:.2f} steps/s (median step {slowest * 1000:.0f} ms, slowest rank)")
    peaks = []
    for rank in range(launch.ranks):
        per_run = [
            max((int(e.get("peak_bytes") or 0) for e in ranks.steps(rank, run).values()), default=0)
            for run in launch.runs
        ]
        peaks.append(f"rank {rank} " + "/".join(f"{p / 2**30:.2f}" for p in per_run))
    return Row(
        package=PACKAGE,
        check="train-figures",
        status="PASS",
        detail="; ".join(parts) + f"; peak memory GiB ({'/'.join(launch.runs)}): " + ", ".join(peaks),
    )


def judge(preflight: Mapping[str, Any], records: Mapping[int, list[dict[str, Any]]], launch: Launch) -> list[Row]:
    """One row per check of :data:`CHECKS`, from the preflight and every rank's events."""
    ranks = _Ranks(events={int(r): list(e) for r, e in records.items()})
    problem = _launch_problem(ranks, launch)
    layout = ranks.one(0, "layout") or {}
    if problem is None:
        versions = ", ".join(f"{k} {v}" for k, v in layout.get("versions", {}).items())
        arch = "sm_" + str(layout.get("capability", "?")).replace(".", "")
        launch_row = Row(
            package=PACKAGE,
            check="train-launch",
            status="PASS",
            detail=(
                f"torchrun: {launch.ranks} rank(s) on {layout.get('gpu', '?')} ({arch}), "
                f"NCCL {layout.get('nccl', '?')}; TP={layout.get('tp')}, EP={layout.get('ep')} (expert TP "
                f"{layout.get('etp')}), DP={layout.get('dp')}, expert DP={layout.get('edp')}; {versions}; logs: "
                f"{_rank_log(launch, 0)} and the other ranks'"
            ),
        )
    else:
        launch_row = Row(package=PACKAGE, check="train-launch", status="FAIL", detail=problem)
    rows = [launch_row]
    facts = _per_rank_facts(ranks, launch)
    if facts is None:
        rows += [_not_reached(c, problem or "a rank reported no evidence") for c in CHECKS[1:6]]
    else:
        rows += [
            _fp8_row(facts),
            _fa3_row(facts),
            _grouped_gemm_row(facts, layout),
            _apex_row(facts),
            _optimizer_row(facts, layout),
        ]
    complete = problem is None and facts is not None
    rows.append(_finite_row(ranks, launch, complete, problem))
    if complete:
        curves, disagree = _curves(ranks, launch)
        rows += _loss_rows(curves, launch, disagree or _same_start(ranks, launch))
        rows.append(_figures_row(ranks, launch))
    else:
        rows += [_not_reached(c, problem) for c in CHECKS[7:]]
    return rows


def summary(
    preflight: Mapping[str, Any], records: Mapping[int, list[dict[str, Any]]], launch: Launch, rows: Sequence[Row]
) -> dict[str, Any]:
    """``train.json``: the rows, the layout and versions, and per run and rank the loss curve, the gradient
    norms, the step times, the peak memory and the evidence (non-finite numbers as strings)."""
    ranks = _Ranks(events={int(r): list(e) for r, e in records.items()})
    runs: dict[str, Any] = {}
    for run in launch.runs:
        per_rank = {}
        for rank in sorted(ranks.events):
            steps = ranks.steps(rank, run)
            ordered = [steps[i] for i in sorted(steps)]
            per_rank[str(rank)] = {
                "loss": [_json_number(e.get("loss")) for e in ordered],
                "grad_norm": [_json_number(e.get("grad_norm")) for e in ordered],
                "step_time_s": [_json_number(e.get("time_s")) for e in ordered],
                "peak_bytes": max((int(e.get("peak_bytes") or 0) for e in ordered), default=0),
                "facts": {
                    k: v
                    for k, v in (ranks.one(rank, "facts", run) or {}).items()
                    if k not in ("event", "rank", "t", "run")
                },
            }
        runs[run] = per_rank
    return {
        "format": 1,
        "rows": [{"check": r.check, "status": r.status, "detail": r.detail} for r in rows],
        "ranks": launch.ranks,
        "layout": {k: v for k, v in (ranks.one(0, "layout") or {}).items() if k not in ("event", "rank", "t")},
        "gpus": preflight.get("gpus", []),
        "tolerances": {
            "loss_falls_to": LOSS_FALLS_TO,
            "fp8_tolerance": FP8_TOLERANCE,
            "fp8_first_step": FP8_FIRST_STEP,
            "warmup_steps": WARMUP_STEPS,
        },
        "runs": runs,
        "timed_out": launch.timed_out,
        "returncode": launch.returncode,
        "strays": [list(s) for s in launch.strays],
    }


def _json_number(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)
