"""`doit verify_image`: the checks of `doit verify`, run inside a container of the runtime image.

The container runs the image as built (its venv, its base's torch and CUDA
libraries), with no network, as the calling user, and with ``--gpus all``
where a GPU and the NVIDIA container runtime are there (``gpu=off`` never
passes one). Without a GPU the GPU smoke checks are reported as SKIP, never
PASS, and the report says why no GPU was passed. With ``train=on`` the
training check runs in the container too (tasks/verify/train.py): torchrun
with one rank per GPU passed, over loopback only (the container has no
network), with a larger ``/dev/shm`` for NCCL.

The verification code is not part of the image: this package, its three
pure-Python dependencies and cuobjdump are mounted read-only (the "kit",
under ``build/verify-image/kit``). The wheelhouse and the work directory
are mounted at their own host paths, so every path in the report and its
logs is valid on the host too.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import site
import sysconfig
from pathlib import Path

from tasks.core import proc
from tasks.core.errors import ImageError, VerifyFailed
from tasks.core.fsutil import rmtree, write_atomic
from tasks.env import docker
from tasks.image.image import KEY_LABEL, require_image
from tasks.stages.context import Context
from tasks.verify.cuda import find_cuobjdump
from tasks.verify.report import Report, Row

KIT_MOUNT = "/opt/reprostack-verify"
#: What tasks.verify.checks imports beyond the standard library (pure Python, copied into the kit).
KIT_DEPENDENCIES = ("elftools", "filelock", "pathspec")
TASKS_DIR = Path(__file__).resolve().parents[1]
#: /dev/shm of the container for the training check: NCCL's shared-memory transport between the ranks.
SHM_TRAIN = "8g"


def gpu_decision(mode: str) -> tuple[bool, str]:
    """Whether to pass ``--gpus all``, and why (or why not)."""
    if mode == "off":
        return False, "gpu=off: no GPU passed to the container"
    smi = shutil.which("nvidia-smi")
    listed = proc.query([smi, "-L"], timeout=120, text=True, tolerant=True) if smi else None
    out = listed.stdout if listed is not None and listed.returncode == 0 else ""
    gpus = [ln for ln in out.splitlines() if ln.startswith("GPU ")]
    if not gpus:
        return False, "no NVIDIA GPU on this host (nvidia-smi lists none): GPU checks skipped"
    runtimes = docker.runtimes()
    hook = shutil.which("nvidia-container-cli") or shutil.which("nvidia-container-runtime-hook")
    if "nvidia" not in runtimes and hook is None:
        return False, (
            f"{len(gpus)} GPU(s) here, but docker has no NVIDIA runtime (install nvidia-container-toolkit "
            "and run `nvidia-ctk runtime configure --runtime=docker`): GPU checks skipped"
        )
    return True, f"--gpus all ({len(gpus)} GPU(s): {gpus[0]})"


def make_kit(dest: Path) -> list[str]:
    """Copy the verification code, its dependencies and cuobjdump into ``dest``; return notes."""
    rmtree(dest)
    shutil.copytree(TASKS_DIR, dest / "tasks", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in KIT_DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ImageError(f"verify_image: {name} is not importable here; run scripts/bootstrap.sh")
        shutil.copytree(locations[0], dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    notes = []
    cuobjdump = find_cuobjdump(_site_dirs())
    if cuobjdump is not None:
        (dest / "bin").mkdir()
        shutil.copy2(cuobjdump, dest / "bin" / "cuobjdump")
        notes.append(f"cuobjdump from {cuobjdump} (used where the image has none)")
    return notes


def _site_dirs() -> list[str]:
    return [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]


def verify_in_image(ctx: Context) -> Report:
    plan, info = require_image(ctx)
    wheels = ctx.settings.wheels.resolve()
    root = (ctx.settings.builddir / "verify-image").absolute()
    work = root / "work"
    rmtree(work)
    work.mkdir(parents=True)
    make_kit(root / "kit")
    use_gpus, gpu_note = gpu_decision(ctx.settings.gpu)
    log = (ctx.settings.logs / "verify-image.log").absolute()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# doit verify_image: {plan.tag} ({info['Id']})\n")
    print(f"verify inside {plan.tag} ({gpu_note}), log: {log}", flush=True)
    env = {"PYTHONPATH": KIT_MOUNT, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    if ctx.settings.gpu == "off":
        env["REPRO_VERIFY_GPU"] = "0"
    train = ["train"] if ctx.settings.train else []
    docker.run_container(
        str(info["Id"]),
        [
            f"{plan.spec.prefix}/bin/python",
            "-m",
            "tasks.verify.incontainer",
            str(wheels),
            str(work),
            ctx.settings.gpu,
            *train,
        ],
        log=log,
        what=f"verification inside {plan.tag}",
        mounts=[(root / "kit", KIT_MOUNT, True), (wheels, str(wheels), True), (work, str(work), False)],
        env=env,
        gpus=use_gpus,
        user=docker.current_user(),
        extra=["--shm-size", SHM_TRAIN if train else "1g"],
    )
    try:
        inner = Report.from_dict(_read_json(work / "report.json"))
    except (OSError, ValueError, KeyError) as exc:
        raise ImageError(f"verification inside {plan.tag} wrote no readable report ({exc}); see {log}") from None
    rows = [
        Row(package="image", check="image", status="PASS", detail=f"{plan.tag} ({info['Id']}), key label {KEY_LABEL}"),
        Row(package="image", check="gpu", status="PASS" if use_gpus else "SKIP", detail=gpu_note),
        *inner.rows,
    ]
    report = Report(rows=tuple(rows), wheel_dir=inner.wheel_dir, archs=inner.archs)
    write_atomic(root / "report.json", report.to_json())
    write_atomic(root / "report.txt", report.render())
    print(report.render(), end="", flush=True)
    if not report.ok:
        failed = "\n".join(
            f"  {row.package} {row.check}: {row.detail.splitlines()[0][:160]}" for row in report.failures()
        )
        raise VerifyFailed(
            f"verify_image: {report.summary()} in {plan.tag}\n{failed}\n"
            f"Full report: {root / 'report.txt'}; logs: {work / 'logs'}/ and {log}. "
            "Fix the wheel or the base, rebuild with `doit image`, then rerun `doit verify_image`."
        )
    return report


def _read_json(path: Path) -> dict[str, object]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data
