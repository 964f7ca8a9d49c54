"""What goes to a site without network (docs/offline.md): `doit mirror`'s directory (also a bundle's
``mirror/``: the profile's sources, the wheels of the hermetic toolchain, the build closures and the runtime
closure) and
`doit bundle`'s one file (tasks/image/bundle.py writes it)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.errors import BundleError
from tasks.core.fsutil import copy_atomic
from tasks.image.bundle import write_bundle
from tasks.lock.lockfile import WheelPin
from tasks.stages.context import Context

if TYPE_CHECKING:
    from tasks.env.closure import Target


def write_mirror(ctx: Context, dest: Path, *, source: Path | None) -> Iterator[str]:
    """Write what `doit mirror` writes into ``dest`` (also the bundle's ``mirror/``): the profile's sources,
    the wheels of the hermetic toolchain, of the build closures and of the runtime closure; yield one line per item.
    A closure wheel comes from the cache, else ``source`` (a mirror's ``wheels/``), else the package index."""
    from tasks.env.hermetic import mirror_wheels
    from tasks.lock.fetch import export_mirror

    sources = [ctx.lock.sources[n] for n in ctx.lock.sources_for(ctx.settings.profile)]
    for line in export_mirror(sources, cache=ctx.cache, mirror=dest):
        yield f"  {line}"
    pins = ctx.lock.toolchain.hermetic
    if pins:
        yield f"hermetic toolchain: the wheels of {len(pins)} pins into {dest / 'wheels'}"
        if source is not None and source != dest and (source / "wheels").is_dir():
            copy_pinned_wheels(source / "wheels", dest / "wheels", {h for pin in pins for h in pin.hashes})
        for line in mirror_wheels(pins, python=ctx.lock.toolchain.python, mirror=dest):
            yield f"  {line}"
    from tasks.env import closure

    build = build_pins(ctx)
    if build:
        pythons = sorted({closure.host_target().python, *tool_pythons(ctx)})
        # the file of each pin for each Python the mirror serves, on this machine's CPU
        files = _carry(ctx, build, [closure.host_target(p) for p in pythons], dest, source=source, section="build")
        yield (f"  build closures: {len(files)} wheels of {len(build)} pins in {dest / 'wheels'} for CPython "
               f"{', '.join(pythons)} ({sum(files.values()) / 1e6:.1f} MB)")  # fmt: skip
    runtime = ctx.runtime
    if runtime is not None and runtime.resolved:
        files = _carry(ctx, runtime.resolved, [closure.target_of(runtime)], dest, source=source, section="runtime")
        yield f"  runtime closure: {len(files)} wheels in {dest / 'wheels'} ({sum(files.values()) / 1e6:.1f} MB)"


def _carry(
    ctx: Context, pins: Sequence[WheelPin], targets: Sequence[Target], dest: Path, *, source: Path | None, section: str
) -> dict[str, int]:
    """One file of each pin for each target in ``dest/wheels`` (through the cache: closure.fetch checks each
    sha256), file name -> size."""
    from tasks.env import closure

    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    files: dict[str, int] = {}
    for target in targets:
        for pin in pins:
            path = closure.fetch(closure.Pin(pin.name, pin.version, pin.hashes), ctx.cache.fetched,
                                 mirror=source, indexes=None, target=target, section=section)  # fmt: skip
            if not (wheels / path.name).is_file():
                copy_atomic(path, wheels / path.name)
            files[path.name] = path.stat().st_size
    return files


def build_pins(ctx: Context) -> list[WheelPin]:
    """Every pin of the build closures of the profile's packages built from source, once each."""
    pins: dict[str, WheelPin] = {}
    for pkg in ctx.packages:
        if not pkg.prebuilt:
            for pin in ctx.build_closure(pkg):
                pins.setdefault(pin.requirement(), pin)
    return [pins[k] for k in sorted(pins)]


def tool_pythons(ctx: Context) -> tuple[str, ...]:
    """The CPythons the tool's wheels are written for besides this one: ``tool_python=``, else the lock's
    ``[runtime] python`` (the node's)."""
    runtime = ctx.runtime
    return ctx.settings.tool_python or ((runtime.python,) if runtime is not None and runtime.python else ())


def tool_wheels(ctx: Context, dest: Path) -> list[str]:
    """The tool's own wheels in ``dest`` (tasks/image/selfwheels.py) for this Python and :func:`tool_pythons`, on
    the lock's ``[runtime] platforms`` (else this machine's manylinux tags); lines to print."""
    from tasks.image.selfwheels import write_tool_wheels

    runtime = ctx.runtime
    return write_tool_wheels(
        dest,
        pythons=tool_pythons(ctx),
        platforms=runtime.platforms if runtime is not None else (),
        store=ctx.cache.fetched,
        log=ctx.settings.logs / "tool-wheels.log",
    )


def copy_pinned_wheels(src: Path, dest: Path, hashes: set[str]) -> None:
    """Copy the wheels of ``src`` whose sha256 is one of ``hashes`` into ``dest`` (so none is downloaded again)."""
    from tasks.core.treehash import file_sha256

    for path in sorted(src.glob("*.whl")):
        if not (dest / path.name).is_file() and file_sha256(path) in hashes:
            dest.mkdir(parents=True, exist_ok=True)
            copy_atomic(path, dest / path.name)


def make_bundle(ctx: Context) -> Iterator[str]:
    """`doit bundle`: the wheelhouse, the exported image (``bundle_image=on``), the mirror (``bundle_mirror=on``),
    the lock and the tool's own wheels in one file; one line per step, then what to run on the other side."""
    from tasks.outside.unbundle import instruction

    st = ctx.settings
    out = st.bundle or st.builddir / "bundle" / f"reprostack-{ctx.lock.sha256[:12]}-{st.profile}.tar"
    image = None
    if st.bundle_image:
        from tasks.image.export import stem
        from tasks.image.image import make_plan

        name = stem(make_plan(ctx))
        export = st.export_dir
        image = [p for p in (export / f"{name}.docker.tar", export / f"{name}.oci", export / f"{name}.json")]
        missing = [p.name for p in image if not p.exists()]
        if missing:
            raise BundleError(f"the exported image is missing from {export} ({', '.join(missing)}): run `doit export`")
    mirror_dir = None
    with tempfile.TemporaryDirectory(prefix="bundle-mirror-") as tmp:
        if st.bundle_mirror:  # what `doit mirror` writes for this profile
            mirror_dir = Path(tmp) / "mirror"
            yield f"the bundle's mirror/, as `doit mirror` writes it for profile {st.profile}:"
            yield from write_mirror(ctx, mirror_dir, source=st.mirror)
        tool_dir = Path(tmp) / "tool"  # the tool's own wheels: it installs offline on the other side
        for line in tool_wheels(ctx, tool_dir):
            if line.startswith("note:"):  # (the install command for the other side is printed below)
                yield line
        info = {"lock": ctx.lock.path.name, "lock_sha256": ctx.lock.sha256, "profile": st.profile}
        path, digest = write_bundle(
            out, wheels=st.wheels, image=image, mirror=mirror_dir, lock=ctx.lock.path, tool=tool_dir, info=info
        )
    yield f"bundle {path} ({path.stat().st_size / 1e6:.1f} MB), sha256 {digest}; also {path.name}.sha256"
    yield f"on the other side, with only python3 (3.8 or newer): {instruction(path.name, 'DIR')}"
    yield (
        f"  (it checks {path.name}.sha256 when it lies beside the bundle, then every file; then install the tool "
        f"with: python3 -m venv .venv && .venv/bin/pip install --no-index --find-links DIR/tool --require-hashes "
        f"-r DIR/tool/requirements.txt; where the tool is installed: reprostack unbundle bundle={path.name} dest=DIR)"
    )
