"""The training check of ``doit verify train=on`` (tasks/verify/train.py): a few FP8 MoE training steps of a tiny
GPT built with megatron_core's own API, on every GPU of the host, one rank a GPU, launched by torchrun.

Runs in the verification venv (or the runtime image) with the standard library, torch and the stack only:
megatron_core, transformer_engine, flash_attn_3, grouped_gemm, apex (tests/unit/test_standalone.py). Two ways::

    python train_gpt.py --preflight OUT.json
    python -m torch.distributed.run --standalone --nproc-per-node N train_gpt.py --out DIR [--log-dir DIR]

``--preflight`` imports every component and asks each package whether it sees the others (transformer_engine
sees flash-attn-3, megatron_core sees grouped_gemm and apex's fused layer norm) before any GPU work, counts the
GPUs and writes what it found (``components``: name -> ok, version, detail; ``ranks``, the GPUs, and ``skip``:
why no training can run here, or null). Under torchrun each rank writes ``DIR/rank<R>.jsonl``, one JSON object
a line, each with ``event``, ``rank`` and ``t`` (its time): ``start`` (pid, its start time in clock ticks, ppid,
world, host), ``layout`` (the parallel layout, versions, GPU), ``built`` (a run's model is built: its initial
weights' checksum), ``step`` (run, step, loss, grad_norm, time_s, peak_bytes), ``facts`` (a run's evidence,
below), ``fail`` (run, step, error: what stopped this rank, and where), ``done``. Its output goes to
``LOG_DIR/train.rank<R>.log``.

The model (:class:`GptWorkload`): megatron_core's ``GPTModel`` with its TransformerEngine layer spec
(``get_gpt_decoder_block_spec``): 4 layers, hidden 512, 4 heads of 128 (the head dimension every FlashAttention 3
build of the lock has), rope, swiglu; every other layer MoE, 4 experts (2 per rank where expert parallelism spreads
them wider), top-2, alltoall dispatch, experts on grouped_gemm (``moe_grouped_gemm`` with megatron_core's
``GroupedMLP``, which calls ``grouped_gemm.ops.gmm``; its ``TEGroupedMLP`` would run TE's own grouped GEMM instead);
q/k layer norms are megatron_core's ``FusedLayerNorm`` on apex's ``fused_layer_norm_cuda`` (with TE installed,
megatron_core 0.14 takes Adam and its multi-tensor kernels from TE, not apex: its layer norm is where it still uses
apex); attention on TE's ``DotProductAttention`` with only FlashAttention allowed (``attention_backend=flash``);
bf16 weights, megatron_core's ``DistributedDataParallel`` and distributed optimizer (Adam, lr 1e-3, clip 1.0), its
``forward_backward_func`` and ``finalize_model_grads``. Parallelism by world size (:func:`parallel_layout`): tensor
parallel 2 with sequence parallel where the world is even, expert parallel across the rest. Data: one fixed batch
per data-parallel rank (4 sequences of 256 tokens following a fixed permutation of a 1024-token vocabulary:
learnable), the same in both runs: ``bf16``, then ``fp8`` (TE's FP8 through megatron_core's ``fp8="hybrid"``,
DelayedScaling by default, or Float8CurrentScaling with ``--fp8-recipe tensorwise``), each from the same initial
weights, 20 steps.

What a run's ``facts`` hold, counted by forward hooks on the model's modules and read from the packages
themselves: ``te`` (TE linear layers' forwards, how many ran in FP8, the recipes), ``attention`` (TE's selected
backend at each forward, calls into flash_attn_3), ``experts`` (the expert modules, forwards whose output came
from ``grouped_gemm``'s ``GroupedGemm``), ``layernorm`` (forwards through apex's ``FusedLayerNormAffineFunction``),
``optimizer`` (its classes, the share of this rank's parameters it updates), ``kernels`` (CUDA kernels of one
profiled step: evidence only). The judgement is tasks/verify/train.py's.

A rank asks the kernel to kill it when torchrun ends (``PR_SET_PDEATHSIG``): torchrun starts each rank in a
session of its own, so stopping torchrun's process group (Ctrl-C, the timeout) does not reach the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import importlib.metadata
import json
import math
import os
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Read by TE when it is imported and when it picks an attention backend; megatron_core's
# attention_backend=flash checks the same values. The rest keeps a rank to itself: compiles in-process, one
# CUDA connection (megatron_core's tensor parallel overlap assumes it).
os.environ.update(
    NVTE_FLASH_ATTN="1",
    NVTE_FUSED_ATTN="0",
    NVTE_UNFUSED_ATTN="0",
    NVTE_DEBUG="1",
    NVTE_DEBUG_LEVEL="2",
    CUDA_DEVICE_MAX_CONNECTIONS="1",
    TORCHINDUCTOR_COMPILE_THREADS="1",
)
# torch.compile's cache is named after the user, whom a container's uid may not have (no passwd entry).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{os.getuid()}"))

STEPS = 20
RUNS = ("bf16", "fp8")
SEED = 1234
VOCAB, SEQ, BATCH = 1024, 256, 4
LAYERS, HIDDEN, HEADS, FFN, MOE_FFN = 4, 512, 4, 1024, 512
MIN_EXPERTS, LOCAL_EXPERTS, TOPK = 4, 2, 2
LR = 1e-3
PROFILE_STEP = 3  # the step whose CUDA kernels are listed (evidence only)
COLLECTIVE_TIMEOUT_S = 300

#: name -> (modules to import, distribution names for its version)
COMPONENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "torch": (("torch", "torch.distributed.run"), ("torch",)),
    "transformer_engine": (("transformer_engine.pytorch",), ("transformer_engine", "transformer-engine")),
    "megatron_core": (
        ("megatron.core", "megatron.core.models.gpt.gpt_model", "megatron.core.extensions.transformer_engine"),
        ("megatron_core", "megatron-core"),
    ),
    "flash_attn_3": (("flash_attn_3.flash_attn_interface",), ("flash-attn-3", "flash_attn_3")),
    "grouped_gemm": (("grouped_gemm", "grouped_gemm.ops"), ("grouped_gemm", "grouped-gemm", "nv-grouped-gemm")),
    "apex": (("apex.normalization.fused_layer_norm", "fused_layer_norm_cuda"), ("apex",)),
}
DPA_PACKAGE = "transformer_engine.pytorch.attention.dot_product_attention"
#: CUDA kernel names that show a component ran on the device (evidence in the facts, not a verdict).
KERNELS = {
    "flash_attn_3": re.compile(r"flash.*sm90|sm90.*flash", re.IGNORECASE),
    "apex_layer_norm": re.compile(r"cuApplyLayerNorm|cuComputeGradInput|cuComputePartGradGammaBeta"),
    "fp8_gemm": re.compile(r"e4m3|e5m2|fp8", re.IGNORECASE),
}


# --------------------------------------------------------------------------- pure helpers


def parallel_layout(world: int) -> dict[str, int]:
    """The parallel layout for ``world`` ranks: tensor parallel 2 where the world is even, expert parallel across
    the rest (each expert whole on its rank); 4 experts, or 2 per expert-parallel rank where that is more (a
    grouped GEMM of more than one group on every rank, top-2 routing that chooses).

    4 GPUs: TP=2, EP=2, DP=2; 2 GPUs: TP=2, EP=1; 1 GPU: all 1.
    """
    if world < 1:
        raise ValueError(f"world size {world}")
    tp = 2 if world % 2 == 0 else 1
    ep = world // tp
    return {
        "world": world,
        "tp": tp,
        "ep": ep,
        "etp": 1,
        "dp": world // tp,
        "edp": world // ep,
        "experts": max(MIN_EXPERTS, LOCAL_EXPERTS * ep),
    }


def synthetic_batch(generator: Any, torch: Any, rows: int = BATCH, length: int = SEQ, vocab: int = VOCAB) -> Any:
    """``rows`` sequences of ``length + 1`` tokens, each token the image of the one before under one fixed
    permutation of the vocabulary (seeded by SEED), from random first tokens (``generator``'s)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(SEED))
    tokens = [torch.randint(vocab, (rows,), generator=generator)]
    for _ in range(length):
        tokens.append(perm[tokens[-1]])
    return torch.stack(tokens, dim=1)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --------------------------------------------------------------------------- the rank's own housekeeping


class Reporter:
    """This rank's events, one JSON line each, flushed as written (a killed rank keeps what it said)."""

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._fh = path.open("a", encoding="utf-8", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        self._fh.write(json.dumps({"event": event, "rank": self.rank, "t": round(time.time(), 6), **fields}) + "\n")
        self._fh.flush()


def start_ticks() -> str:
    """This process's start time (clock ticks since boot, /proc/self/stat): with the pid, names it over time."""
    with contextlib.suppress(OSError):
        text = Path("/proc/self/stat").read_text()
        return text[text.rfind(")") + 2 :].split()[19]
    return ""


def die_with_parent() -> str:
    """Have the kernel KILL this rank when its parent (torchrun) ends; say how it went.

    torchrun starts each rank in a session of its own, so a stop of torchrun's process group (Ctrl-C, a
    timeout) never reaches a rank; torchrun forwards a TERM to them, but not when it is killed itself. A
    parent that ended before this call is no longer torchrun: the rank ends at once.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as exc:
        return f"prctl(PR_SET_PDEATHSIG) unavailable: {exc}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            parent = b""
        if (
            b"torch.distributed.run" not in parent
            and b"torchrun" not in parent
            and b"torch/distributed/run" not in parent
        ):
            sys.stderr.write("train_gpt: torchrun ended before this rank started; exiting\n")
            os._exit(3)
    return "killed with its parent (PR_SET_PDEATHSIG)"


def redirect_output(path: Path) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2: NCCL's and TE's C++ output too) into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def version_of(dists: tuple[str, ...]) -> str:
    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "?"


def try_imports(name: str) -> dict[str, Any]:
    """Import a component's modules; what went wrong, if anything, in one line."""
    modules, dists = COMPONENTS[name]
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an ImportError, or a shared object that does not load (OSError)
            return {
                "ok": False,
                "version": version_of(dists),
                "detail": f"import {module}: {type(exc).__name__}: {exc}",
            }
    return {"ok": True, "version": version_of(dists), "detail": "imports " + ", ".join(modules)}


def cross_checks(components: dict[str, dict[str, Any]]) -> None:
    """Whether each package sees the others it runs with, as it decides at import time (in place)."""

    def check(name: str, needs: tuple[str, ...], probe: Callable[[], str | None]) -> None:
        comp = components[name]
        if not comp["ok"] or not all(components[n]["ok"] for n in needs):
            return
        try:
            problem = probe()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            comp.update(ok=False, detail=f"{comp['detail']}, but {problem}")

    def te_sees_fa3() -> str | None:
        fa = importlib.import_module(DPA_PACKAGE + ".utils").FlashAttentionUtils
        if not fa.v3_is_installed:
            return "transformer_engine does not see it (FlashAttentionUtils.v3_is_installed is False)"
        return None

    def megatron_sees(module: str, attribute: str) -> Callable[[], str | None]:
        def probe() -> str | None:
            found = getattr(importlib.import_module(module), attribute)
            found = found() if callable(found) else found
            return None if found else f"megatron_core does not see it ({module}.{attribute} is {found!r})"

        return probe

    check("flash_attn_3", ("transformer_engine",), te_sees_fa3)
    gg = megatron_sees("megatron.core.transformer.moe.grouped_gemm_util", "grouped_gemm_is_available")
    check("grouped_gemm", ("megatron_core",), gg)
    check("apex", ("megatron_core",), megatron_sees("megatron.core.fusions.fused_layer_norm", "HAVE_FUSED_LAYER_NORM"))


# --------------------------------------------------------------------------- the rank's loop


class Job:
    """What a rank was asked to do, and where it reports."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, local_rank: int, report: Reporter) -> None:
        self.args, self.rank, self.world, self.local_rank, self.report = args, rank, world, local_rank, report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preflight", metavar="OUT.json", help="check the components, count the GPUs, no training")
    parser.add_argument("--out", metavar="DIR", help="where each rank writes rank<R>.jsonl")
    parser.add_argument("--log-dir", metavar="DIR", help="where each rank writes train.rank<R>.log")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated: bf16, fp8")
    parser.add_argument("--fp8-recipe", default="delayed", choices=("delayed", "tensorwise"))
    args = parser.parse_args(argv)
    if not args.preflight and not args.out:
        parser.error("give --preflight OUT.json or --out DIR")
    return args


def main(argv: list[str] | None = None, workload: Any = None) -> int:
    """Preflight, or one rank's whole part; the exit status (0: done, 1: this rank failed and said where)."""
    args = parse_args(argv)
    work = workload if workload is not None else GptWorkload()
    if args.preflight:
        found = work.preflight()
        Path(args.preflight).write_text(json.dumps(found, indent=2) + "\n")
        return 0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    parent_note = die_with_parent()
    if args.log_dir:
        redirect_output(Path(args.log_dir) / f"train.rank{rank}.log")
    report = Reporter(Path(args.out) / f"rank{rank}.jsonl", rank)
    report(
        "start",
        pid=os.getpid(),
        start=start_ticks(),
        ppid=os.getppid(),
        world=world,
        local_rank=local_rank,
        host=socket.gethostname(),
        parent=parent_note,
    )
    print(f"rank {rank} of {world} (local {local_rank}), pid {os.getpid()}: {parent_note}", flush=True)
    job = Job(args, rank, world, local_rank, report)
    run: str | None = None
    step: int | None = None
    try:
        report("layout", **work.setup(job))
        for run in [r for r in args.runs.split(",") if r]:
            step = None
            report("built", run=run, **work.build(job, run))
            for step in range(args.steps):
                started = time.perf_counter()
                loss, grad_norm = work.step(job, run, step)
                elapsed = time.perf_counter() - started
                peak = work.peak_bytes()
                report(
                    "step",
                    run=run,
                    step=step,
                    loss=loss,
                    grad_norm=grad_norm,
                    time_s=round(elapsed, 6),
                    peak_bytes=peak,
                )
                print(
                    f"{run} step {step}: loss {loss:.4f}, grad norm {grad_norm:.4f}, {elapsed * 1000:.0f} ms",
                    flush=True,
                )
                if not (finite(loss) and finite(grad_norm)):
                    raise FloatingPointError(f"loss {loss}, grad norm {grad_norm}")
            step = None
            report("facts", run=run, **work.facts(job, run))
            work.teardown(job, run)
        run = None
        work.finish(job)
        report("done")
        return 0
    except BaseException as exc:
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()
        report("fail", run=run, step=step, error=error[0][:500] if error else type(exc).__name__)
        sys.stdout.flush()
        sys.stderr.flush()
        return 1


# --------------------------------------------------------------------------- the GPT workload


class GptWorkload:
    """The tiny GPT of the module's docstring, on megatron_core, TE, FlashAttention 3, grouped_gemm and apex."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.backends: Counter[str] = Counter()
        self.recipes: set[str] = set()
        self.expert_modules: set[str] = set()
        self.kernels: dict[str, Any] = {}
        self.hooks: list[Any] = []
        self.layout: dict[str, int] = {}
        self.state: dict[str, Any] = {}

    # ---- before any GPU work

    def preflight(self) -> dict[str, Any]:
        components = {name: try_imports(name) for name in COMPONENTS}
        cross_checks(components)
        found: dict[str, Any] = {"components": components, "device": "cuda", "ranks": 0, "gpus": [], "skip": None}
        if not components["torch"]["ok"]:
            return found
        import torch

        if os.environ.get("REPRO_VERIFY_GPU") == "0":
            found["skip"] = "GPU checks disabled (gpu=off)"
        elif not torch.cuda.is_available():
            found["skip"] = "no CUDA device: torch.cuda.is_available() is False"
        else:
            count = torch.cuda.device_count()
            gpus = []
            for i in range(count):
                major, minor = torch.cuda.get_device_capability(i)
                gpus.append({"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"})
            found.update(ranks=count, gpus=gpus)
            other = [i for i, gpu in enumerate(gpus) if gpu["capability"] != "9.0"]
            if other:
                found["skip"] = (
                    f"FlashAttention 3 runs on sm_90 only; GPU {other[0]} ({gpus[other[0]]['name']}) is "
                    f"sm_{gpus[other[0]]['capability'].replace('.', '')}"
                )
        return found

    # ---- the process group, once

    def setup(self, job: Job) -> dict[str, Any]:
        import datetime

        import torch
        from megatron.core import parallel_state

        torch.cuda.set_device(job.local_rank)
        torch.distributed.init_process_group(backend="nccl", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.layout = layout = parallel_layout(job.world)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout["tp"],
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=layout["ep"],
            expert_tensor_parallel_size=layout["etp"],
        )
        if parallel_state.get_data_parallel_world_size() != layout["dp"]:
            raise RuntimeError(
                f"megatron_core made {parallel_state.get_data_parallel_world_size()} DP ranks, not {layout['dp']}"
            )
        self._count_flash_attn_3_calls()
        major, minor = torch.cuda.get_device_capability()
        nccl_version: Any = torch.cuda.nccl.version  # a tuple, or an int on older torch
        nccl = nccl_version()
        return {
            **layout,
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "gpu": torch.cuda.get_device_name(),
            "capability": f"{major}.{minor}",
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "versions": {name: version_of(dists) for name, (_modules, dists) in COMPONENTS.items()},
            "fp8_recipe": job.args.fp8_recipe,
        }

    def _count_flash_attn_3_calls(self) -> None:
        """Count the calls TE makes into flash_attn_3 (its backends module holds FA3's functions by name)."""
        backends = importlib.import_module(DPA_PACKAGE + ".backends")
        for name in ("flash_attn_func_v3", "flash_attn_varlen_func_v3"):
            original = getattr(backends, name, None)
            if original is None:
                continue

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.counts["fa3_calls"] += 1
                return _original(*args, **kwargs)

            setattr(backends, name, counted)

    # ---- one run

    def build(self, job: Job, run: str) -> dict[str, Any]:
        import torch
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module

        self.counts.clear()
        self.backends.clear()
        self.recipes.clear()
        self.expert_modules.clear()
        self.kernels = {}
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        config = self._config(run, job.args.fp8_recipe)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=self._block_spec(config),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
            parallel_output=True,
        )
        for param in gpt.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
            check_for_nan_in_grad=True,
        )
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
        model.broadcast_params()
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=LR,
                min_lr=LR,
                weight_decay=0.0,
                adam_beta2=0.95,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
                clip_grad=1.0,
            ),
            [model],
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        self._hook(model)
        generator = torch.Generator().manual_seed(SEED + parallel_state.get_data_parallel_rank())
        tokens = synthetic_batch(generator, torch).cuda()
        batch = {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ).contiguous(),
        }
        self.state = {"model": model, "optimizer": optimizer, "batch": batch, "schedule": get_forward_backward_func()}
        torch.cuda.reset_peak_memory_stats()
        checksum = sum(float(p.detach().double().square().sum()) for p in model.parameters())
        return {"init_checksum": checksum, "parameters": sum(p.numel() for p in model.parameters())}

    def _config(self, run: str, recipe: str) -> Any:
        import torch
        from megatron.core.transformer.enums import AttnBackend
        from megatron.core.transformer.transformer_config import TransformerConfig

        layout = self.layout
        return TransformerConfig(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=HEADS,
            kv_channels=HIDDEN // HEADS,
            tensor_model_parallel_size=layout["tp"],
            sequence_parallel=layout["tp"] > 1,
            expert_model_parallel_size=layout["ep"],
            expert_tensor_parallel_size=layout["etp"],
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            bf16=True,
            normalization="LayerNorm",
            qk_layernorm=True,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,  # FlashAttention 3 has no dropout: TE would pick another backend
            init_method_std=0.02,
            attention_backend=AttnBackend.flash,
            num_moe_experts=layout["experts"],
            moe_layer_freq=2,
            moe_ffn_hidden_size=MOE_FFN,
            moe_router_topk=TOPK,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
            moe_use_legacy_grouped_gemm=True,  # GroupedMLP: grouped_gemm.ops.gmm (TEGroupedMLP is TE's own)
            fp8="hybrid" if run == "fp8" else None,
            fp8_recipe=recipe,
        )

    @staticmethod
    def _block_spec(config: Any) -> Any:
        """megatron_core's TE block spec, its q/k layer norms on megatron_core's apex-backed FusedLayerNorm."""
        import copy

        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=True))
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm = FusedLayerNorm
            attention.k_layernorm = FusedLayerNorm
        return spec

    def _hook(self, model: Any) -> None:
        """Forward hooks that count what ran: TE's linear layers (in FP8 or not), its attention backend, the
        experts' grouped GEMMs, apex's layer norm."""
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
        from transformer_engine.pytorch import LayerNormLinear, LayerNormMLP, Linear

        chosen = importlib.import_module(DPA_PACKAGE)._attention_backends

        def linear(module: Any, _inputs: Any, _output: Any) -> None:
            self.counts["te_linear_forwards"] += 1
            if getattr(module, "fp8", False):
                self.counts["fp8_forwards"] += 1
                recipe = getattr(module, "fp8_meta", {}).get("recipe")
                if recipe is not None:
                    fmt = getattr(getattr(recipe, "fp8_format", None), "name", "")
                    self.recipes.add(f"{type(recipe).__name__} {fmt}".strip())

        def attention(_module: Any, _inputs: Any, _output: Any) -> None:
            self.counts["attention_forwards"] += 1
            if chosen.get("use_flash_attention"):
                name = f"FlashAttention ({chosen.get('flash_attention_backend')})"
            elif chosen.get("use_fused_attention"):
                name = f"FusedAttention (sub-backend {chosen.get('fused_attention_backend')})"
            elif chosen.get("use_unfused_attention"):
                name = "UnfusedDotProductAttention"
            else:
                name = "none"
            self.backends[name] += 1

        def experts(_module: Any, _inputs: Any, output: Any) -> None:
            self.counts["expert_forwards"] += 1
            out = output[0] if isinstance(output, tuple) else output
            if type(getattr(out, "grad_fn", None)).__name__ == "GroupedGemmBackward":
                self.counts["grouped_gemm_forwards"] += 1

        def layernorm(_module: Any, _inputs: Any, output: Any) -> None:
            self.counts["layernorm_forwards"] += 1
            if type(getattr(output, "grad_fn", None)).__name__ == "FusedLayerNormAffineFunctionBackward":
                self.counts["apex_layernorm_forwards"] += 1

        for module in model.modules():
            if isinstance(module, (Linear, LayerNormLinear, LayerNormMLP)):
                self.hooks.append(module.register_forward_hook(linear))
            elif isinstance(module, TEDotProductAttention):
                self.hooks.append(module.register_forward_hook(attention))
            elif isinstance(module, FusedLayerNorm):
                self.counts["apex_layernorm_modules"] += 1
                self.hooks.append(module.register_forward_hook(layernorm))
            if isinstance(module, (GroupedMLP, TEGroupedMLP, SequentialMLP)):
                self.expert_modules.add(type(module).__name__)
                self.counts["local_experts"] = int(getattr(module, "num_local_experts", 0))
                self.counts["moe_layers"] += 1
                self.hooks.append(module.register_forward_hook(experts))

    def step(self, job: Job, run: str, step: int) -> tuple[float, float]:
        import torch

        if step != PROFILE_STEP:
            return self._train_step()
        try:
            profiler: Any = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        except Exception as exc:  # no CUPTI: the step runs unprofiled
            self.kernels = {"error": f"{type(exc).__name__}: {exc}"}
            return self._train_step()
        try:
            result = self._train_step()
        finally:
            try:
                profiler.__exit__(None, None, None)
                self.kernels = self._kernel_evidence(profiler)
            except Exception as exc:
                self.kernels = {"error": f"{type(exc).__name__}: {exc}"}
        return result

    def _train_step(self) -> tuple[float, float]:
        import torch
        from megatron.core import parallel_state

        model, optimizer, batch = self.state["model"], self.state["optimizer"], self.state["batch"]
        dp_group = parallel_state.get_data_parallel_group()
        dp_size = parallel_state.get_data_parallel_world_size()

        def forward_step(data_iterator: Iterator[dict[str, Any]], module: Any) -> tuple[Any, Any]:
            data = next(data_iterator)
            output = module(data["input_ids"], data["position_ids"], None, labels=data["labels"])

            def loss_func(output_tensor: Any) -> tuple[Any, dict[str, Any]]:
                loss = output_tensor.float().mean()
                averaged = loss.detach().clone()
                torch.distributed.all_reduce(averaged, group=dp_group)
                return loss, {"lm loss": averaged / dp_size}

            return output, loss_func

        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = self.state["schedule"](
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        updated, grad_norm, _zeros = optimizer.step()
        torch.cuda.synchronize()
        with contextlib.suppress(ImportError, AttributeError):
            importlib.import_module("megatron.core.transformer.moe.moe_utils").clear_aux_losses_tracker()
        if not updated:
            raise FloatingPointError(f"the optimizer skipped the update (grad norm {grad_norm})")
        return float(losses[0]["lm loss"]), float(grad_norm) if grad_norm is not None else math.nan

    @staticmethod
    def _kernel_evidence(profiler: Any) -> dict[str, Any]:
        names: Counter[str] = Counter()
        for event in profiler.events():
            if "CUDA" in str(getattr(event, "device_type", "")):
                names[event.name] += 1
        found: dict[str, Any] = {
            key: sum(n for k, n in names.items() if pattern.search(k)) for key, pattern in KERNELS.items()
        }
        found["kernels"] = len(names)
        found["top"] = [name[:120] for name, _n in names.most_common(8)]
        return found

    def peak_bytes(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated())

    def facts(self, job: Job, run: str) -> dict[str, Any]:
        optimizer = self.state["optimizer"]
        parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        inner = sorted(
            {
                f"{type(p.optimizer).__module__}.{type(p.optimizer).__name__}"
                for p in parts
                if getattr(p, "optimizer", None) is not None
            }
        )
        updated = sum(
            q.numel()
            for p in parts
            if getattr(p, "optimizer", None) is not None
            for group in p.optimizer.param_groups
            for q in group["params"]
        )
        total = sum(q.numel() for q in self.state["model"].parameters())
        c = self.counts
        return {
            "te": {
                "linear_forwards": c["te_linear_forwards"],
                "fp8_forwards": c["fp8_forwards"],
                "recipes": sorted(self.recipes),
            },
            "attention": {
                "forwards": c["attention_forwards"],
                "backends": dict(self.backends),
                "fa3_calls": c["fa3_calls"],
            },
            "experts": {
                "modules": sorted(self.expert_modules),
                "moe_layers": c["moe_layers"],
                "local_experts": c["local_experts"],
                "forwards": c["expert_forwards"],
                "grouped_gemm_forwards": c["grouped_gemm_forwards"],
            },
            "layernorm": {
                "apex_modules": c["apex_layernorm_modules"],
                "forwards": c["layernorm_forwards"],
                "apex_forwards": c["apex_layernorm_forwards"],
            },
            "optimizer": {
                "name": type(optimizer).__name__,
                "parts": [type(p).__name__ for p in parts],
                "inner": inner,
                "shard_fraction": round(updated / total, 4) if total else None,
            },
            "kernels": self.kernels,
        }

    def teardown(self, job: Job, run: str) -> None:
        import torch

        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.state.clear()
        gc.collect()
        torch.cuda.empty_cache()

    def finish(self, job: Job) -> None:
        import torch
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
