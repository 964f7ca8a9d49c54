"""The training check's pure parts (issue 40): the parallel layout by GPU count, the judgement of the ranks'
events into rows (tasks/verify/train.py ``judge``), the rows for a venv that lacks a component, and reading the
ranks' event files. The launcher and the rank loop run for real in tests/integration/test_train.py."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tasks.outside import train_gpt
from tasks.verify import checks, train
from tasks.verify.report import Row
from tasks.verify.train import CHECKS, Launch, judge, missing_rows, read_ranks


@pytest.mark.parametrize(
    ("world", "expected"),
    [
        (1, {"tp": 1, "ep": 1, "dp": 1, "edp": 1, "experts": 4}),
        (2, {"tp": 2, "ep": 1, "dp": 1, "edp": 2, "experts": 4}),
        (4, {"tp": 2, "ep": 2, "dp": 2, "edp": 2, "experts": 4}),
        (8, {"tp": 2, "ep": 4, "dp": 4, "edp": 2, "experts": 8}),
        (3, {"tp": 1, "ep": 3, "dp": 3, "edp": 1, "experts": 6}),
    ],
)
def test_the_layout_follows_the_gpu_count(world: int, expected: dict[str, int]) -> None:
    layout = train_gpt.parallel_layout(world)
    assert {k: layout[k] for k in expected} == expected
    assert layout["etp"] == 1 and layout["tp"] * layout["dp"] == world and layout["ep"] * layout["edp"] == world


# --------------------------------------------------------------------------- the judgement

STEPS = 4


def _facts(run: str) -> dict[str, Any]:
    fp8 = run == "fp8"
    return {
        "te": {"linear_forwards": 40, "fp8_forwards": 40 if fp8 else 0, "recipes": ["DelayedScaling HYBRID"] * fp8},
        "attention": {"forwards": 16, "backends": {"FlashAttention (3.0.0b1)": 16}, "fa3_calls": 16},
        "experts": {
            "modules": ["GroupedMLP"],
            "moe_layers": 2,
            "local_experts": 2,
            "forwards": 8,
            "grouped_gemm_forwards": 8,
        },
        "layernorm": {"apex_modules": 8, "forwards": 32, "apex_forwards": 32},
        "optimizer": {
            "name": "ChainedOptimizer",
            "parts": ["DistributedOptimizer"] * 2,
            "inner": ["transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"],
            "shard_fraction": 0.5,
        },
        "kernels": {"flash_attn_3": 12},
    }


def _records(ranks: int = 2, losses: Mapping[str, list[float]] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Every rank's events for a run that went as it should: both runs, STEPS steps, the loss halving."""
    losses = losses or {"bf16": [6.9, 5.0, 3.5, 2.5], "fp8": [6.9, 5.1, 3.6, 2.6]}
    records: dict[int, list[dict[str, Any]]] = {}
    t = 1000.0
    for rank in range(ranks):
        events: list[dict[str, Any]] = [
            {"event": "start", "rank": rank, "t": t, "pid": 10 + rank, "start": "1"},
            {
                "event": "layout",
                "rank": rank,
                "t": t,
                **train_gpt.parallel_layout(ranks),
                "gpu": "NVIDIA H100",
                "capability": "9.0",
                "nccl": "2.28.9",
                "versions": {"megatron_core": "0.14.0"},
            },
        ]
        for run in ("bf16", "fp8"):
            events.append({"event": "built", "rank": rank, "t": t, "run": run, "init_checksum": 123.0})
            for step in range(STEPS):
                t += 1
                events.append(
                    {
                        "event": "step",
                        "rank": rank,
                        "t": t,
                        "run": run,
                        "step": step,
                        "loss": losses[run][step],
                        "grad_norm": 1.0,
                        "time_s": 0.1,
                        "peak_bytes": 2**30,
                    }
                )
            events.append({"event": "facts", "rank": rank, "t": t, "run": run, **_facts(run)})
        events.append({"event": "done", "rank": rank, "t": t})
        records[rank] = events
    return records


def _launch(**kw: Any) -> Launch:
    return Launch(ranks=kw.pop("ranks", 2), steps=STEPS, log="train.log", log_dir="/logs", **kw)


def _rows(records: Mapping[int, list[dict[str, Any]]], **kw: Any) -> dict[str, Row]:
    rows = judge({"gpus": []}, records, _launch(**kw))
    assert [r.check for r in rows] == list(CHECKS)
    return {r.check: r for r in rows}


def test_a_run_that_went_as_it_should_passes_every_row() -> None:
    rows = _rows(_records())
    assert {r.status for r in rows.values()} == {"PASS"}, rows
    assert "TP=2, EP=1" in rows["train-launch"].detail and "sm_90" in rows["train-launch"].detail
    assert "FlashAttention (3.0.0b1)" in rows["train-fa3-backend"].detail
    assert "bf16 6.9000 -> 2.5000" in rows["train-loss-falls"].detail
    assert rows["train-fp8-vs-bf16"].detail.startswith("mean loss fp8 ")
    assert "10.00 steps/s" in rows["train-figures"].detail and "rank 1 1.00/1.00" in rows["train-figures"].detail


def _edit(records: dict[int, list[dict[str, Any]]], rank: int, event: str, run: str | None, **changes: Any) -> None:
    for e in records[rank]:
        if e["event"] == event and (run is None or e.get("run") == run):
            for key, value in changes.items():
                if isinstance(value, dict):
                    e[key] = {**e[key], **value}
                else:
                    e[key] = value


def test_each_component_that_did_not_run_fails_its_row_naming_rank_and_run() -> None:
    records = _records()
    _edit(records, 1, "facts", "fp8", attention={"backends": {"FusedAttention (sub-backend 1)": 16}})
    _edit(records, 0, "facts", "bf16", experts={"modules": ["SequentialMLP"]})
    _edit(records, 1, "facts", "bf16", layernorm={"apex_forwards": 0})
    _edit(records, 0, "facts", "fp8", te={"fp8_forwards": 30})
    _edit(records, 1, "facts", "bf16", optimizer={"parts": ["FP32Optimizer"]})
    rows = _rows(records)
    assert rows["train-fa3-backend"].detail == (
        "rank 1, fp8 run: TE's DotProductAttention selected FusedAttention (sub-backend 1), not FlashAttention 3"
    )
    assert rows["train-grouped-gemm"].detail.startswith("rank 0, bf16 run: the experts are SequentialMLP")
    assert rows["train-apex"].detail.startswith("rank 1, bf16 run: 0 of 32 FusedLayerNorm forwards")
    assert rows["train-fp8"].detail == "rank 0, fp8 run: 30 of 40 TE linear forwards ran in FP8 (all should)"
    assert "not DistributedOptimizer" in rows["train-dist-optimizer"].detail
    assert rows["train-loss-falls"].status == "PASS"  # the rest stands


def test_fa3_selected_but_never_called_and_an_unsharded_optimizer_fail() -> None:
    records = _records(ranks=4)
    _edit(records, 2, "facts", "bf16", attention={"fa3_calls": 0})
    _edit(records, 3, "facts", "fp8", optimizer={"shard_fraction": 1.0})
    rows = _rows(records, ranks=4)
    assert (
        rows["train-fa3-backend"].detail
        == "rank 2, bf16 run: TE selected FlashAttention 3 but never called flash_attn_3"
    )
    assert rows["train-dist-optimizer"].detail.startswith("rank 3, fp8 run: the distributed optimizer updates 1.0")


def test_a_loss_that_does_not_fall_or_an_fp8_run_that_drifts_fails_naming_the_step() -> None:
    flat = _rows(_records(losses={"bf16": [6.9, 6.8, 6.7, 6.6], "fp8": [6.9, 6.8, 6.7, 6.6]}))
    assert flat["train-loss-falls"].status == "FAIL"
    assert "bf16: 6.9000 -> 6.6000 (needs at most 0.7 x the first = 4.8300)" in flat["train-loss-falls"].detail
    drift = _rows(_records(losses={"bf16": [6.9, 5.0, 3.5, 2.5], "fp8": [6.9, 6.2, 5.0, 4.0]}))
    assert drift["train-fp8-vs-bf16"].status == "FAIL"
    said = drift["train-fp8-vs-bf16"].detail
    assert said.startswith("mean loss fp8 5.5250 above bf16 4.4750 by more than 0.6900; last loss fp8 4.0000"), said
    assert "widest apart at step 2 (fp8 5.0000, bf16 3.5000)" in said
    # Apart step by step but no worse overall: fp8 dropping earlier is no fault (seen on one H200).
    early = _rows(_records(losses={"bf16": [6.9, 6.0, 4.8, 1.9], "fp8": [6.88, 4.0, 3.1, 0.9]}))
    assert early["train-fp8-vs-bf16"].status == "PASS", early["train-fp8-vs-bf16"].detail
    apart = _rows(_records(losses={"bf16": [6.9, 5.0, 3.5, 2.5], "fp8": [6.0, 4.0, 3.0, 2.0]}))
    assert apart["train-fp8-vs-bf16"].detail.startswith("first losses apart: fp8 6.0000, bf16 6.9000")


def test_ranks_that_disagree_or_runs_that_start_apart_fail() -> None:
    records = _records()
    _edit(records, 1, "step", "fp8", loss=5.5)
    assert (
        "ranks disagree on the loss at fp8 step 0: rank 0 6.9, rank 1 5.5" in _rows(records)["train-loss-falls"].detail
    )
    records = _records()
    _edit(records, 1, "built", "fp8", init_checksum=124.0)
    assert "rank 1: the runs did not start from the same weights" in _rows(records)["train-loss-falls"].detail


def _until(events: list[dict[str, Any]], event: str, run: str, step: int | None = None) -> list[dict[str, Any]]:
    """``events`` up to the first ``event`` of ``run`` (at ``step``), inclusive: a rank stopped there."""
    for i, e in enumerate(events):
        if e["event"] == event and e.get("run") == run and (step is None or e.get("step") == step):
            return events[: i + 1]
    raise AssertionError(f"no {event} of {run}")


def test_a_nan_names_rank_run_and_step_and_the_rest_is_not_reached() -> None:
    records = _records()
    for rank in (0, 1):  # each rank saw the NaN of the averaged loss at fp8 step 2, and stopped
        records[rank] = _until(records[rank], "step", "fp8", 2)
        records[rank][-1]["loss"] = math.nan
        records[rank].append(
            {
                "event": "fail",
                "rank": rank,
                "t": 2000.0 + rank,
                "run": "fp8",
                "step": 2,
                "error": "FloatingPointError: loss nan, grad norm 1.0",
            }
        )
    rows = _rows(records, returncode=1)
    assert rows["train-launch"].detail.startswith(
        "rank 0 failed in the fp8 run at step 2: FloatingPointError: loss nan, grad norm 1.0 "
        "(log: /logs/train.rank0.log); ranks 1 failed too"
    )
    assert rows["train-finite"].detail == "rank 0, fp8 run, step 2: loss nan"
    assert rows["train-loss-falls"].detail.startswith("not reached: rank 0 failed in the fp8 run at step 2")
    assert all(rows[c].status == "FAIL" for c in CHECKS)


def test_a_timeout_says_where_each_rank_was_and_what_was_stopped() -> None:
    records = _records(ranks=3)
    records[0] = _until(records[0], "facts", "bf16")
    records[1] = _until(records[1], "step", "bf16", 3)
    records[2] = _until(records[2], "built", "fp8")
    rows = _rows(records, ranks=3, timed_out=True, returncode=-9, timeout=900.0, strays=((2, 12),))
    detail = rows["train-launch"].detail
    assert detail.startswith(
        "timed out after 900 s; torchrun and every rank were stopped; where each rank was: rank 0: after the bf16 "
        "run, rank 1: bf16 step 3, rank 2: fp8 model built, before step 0; rank 2 (pid 12) outlived torchrun"
    )
    assert rows["train-fp8"].detail == "not reached: timed out after 900 s; torchrun and every rank were stopped"
    assert rows["train-finite"].status == "FAIL"


def test_ranks_that_never_started_or_ended_silently_fail_the_launch() -> None:
    records = _records(ranks=2)
    del records[1]
    detail = _rows(records, returncode=1)["train-launch"].detail
    assert detail.startswith("torchrun ended (exit status 1) with ranks 1 unfinished and no rank saying why")
    assert "rank 1: never started" in detail


def test_a_rank_that_dies_at_its_exit_after_done_is_named_with_its_signal() -> None:
    # torchrun's own lines (torch 2.13) for a rank that aborted at exit and the one it then stopped
    output = (
        "W1129 12:46:45.353000 32319 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 32372 "
        "closing signal SIGTERM\n"
        "E1129 12:46:45.472000 32319 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) "
        "local_rank: 1 (pid: 32373) of binary: /venv/bin/python\n"
    )
    exits = train.torchrun_exits(output)
    assert exits == ((1, -6),)
    assert train.torchrun_exits("no rank failed\n") == ()
    detail = _rows(_records(), returncode=1, exits=exits)["train-launch"].detail
    assert detail == (
        "every rank reported done, yet torchrun ended (exit status 1): rank 1 (killed by signal SIGABRT, log: "
        "/logs/train.rank1.log) ended badly after its last step, at its exit; log: train.log"
    )
    detail = _rows(_records(), returncode=1)["train-launch"].detail
    assert detail.startswith("every rank reported done, yet torchrun ended (exit status 1): torchrun's log names no")


def test_the_rows_for_a_venv_without_flash_attn_3_name_it() -> None:
    said = "import flash_attn_3.flash_attn_interface: ModuleNotFoundError: No module named 'flash_attn_3'"
    rows = {r.check: r for r in missing_rows({"flash_attn_3": {"detail": said}})}
    assert [r for r in rows.values() if r.status != "FAIL"] == []
    assert rows["train-fa3-backend"].detail.startswith("flash_attn_3 missing from the venv (import flash_attn_3")
    assert rows["train-launch"].detail.startswith("not launched: the venv lacks flash_attn_3 (flash_attn_3: import")
    assert all("flash_attn_3" in r.detail for r in rows.values())


def test_the_summary_keeps_the_curves_and_writes_no_nan(tmp_path: Path) -> None:
    records = _records()
    _edit(records, 0, "step", "bf16", grad_norm=math.inf)
    rows = judge({}, records, _launch())
    doc = train.summary({"gpus": [{"name": "H100"}]}, records, _launch(), rows)
    text = json.dumps(doc, allow_nan=False)  # would raise on a NaN or an infinity
    assert json.loads(text)["runs"]["fp8"]["1"]["loss"] == [6.9, 5.1, 3.6, 2.6]
    assert doc["runs"]["bf16"]["0"]["grad_norm"] == ["inf"] * STEPS


def test_reading_the_ranks_leaves_out_a_line_a_killed_rank_cut_short(tmp_path: Path) -> None:
    (tmp_path / "rank0.jsonl").write_text('{"event": "start", "rank": 0}\n{"event": "step", "ra')
    (tmp_path / "rank1.jsonl").write_text('{"event": "start", "rank": 1}\n[1]\n{"no": "event"}\n')
    (tmp_path / "notes.txt").write_text("x")
    assert read_ranks(tmp_path) == {0: [{"event": "start", "rank": 0}], 1: [{"event": "start", "rank": 1}]}
    assert read_ranks(tmp_path / "missing") == {}


def test_nothing_reported_fails_every_row() -> None:
    rows = judge({}, {}, _launch())
    assert [r.status for r in rows] == ["FAIL"] * len(CHECKS)
    assert rows[0].detail.startswith("torchrun ended (exit status 0) with ranks 0, 1 unfinished")


def test_the_docs_state_the_check_s_own_numbers() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    tasks, stack = (docs / "tasks.md").read_text(), (docs / "real-stack.md").read_text()
    assert f"stopped after {train.TRAIN_TIMEOUT_S:g} s" in tasks and "| `train` | `REPRO_TRAIN` | `off` |" in tasks
    assert f"the last loss is at most {train.LOSS_FALLS_TO:g} of the first" in stack
    assert f"within {train.FP8_TOLERANCE:g} × the first bf16 loss" in stack
    assert f"the timeout ({train.TRAIN_TIMEOUT_S:g} s)" in stack and f"{train_gpt.STEPS} steps in bf16" in stack
    assert all(f"`{check}`" in stack for check in CHECKS)


def test_the_closing_advice_points_at_the_ranks_logs() -> None:
    said = checks.advice([Row(package="training", check="train-launch", status="FAIL", detail="rank 1 failed")])
    assert said.startswith("The training check (train=on)") and "train.rank<R>.log" in said
    assert "recipe" not in said  # a failed training row is not, by itself, a wheel's recipe
