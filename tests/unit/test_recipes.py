"""recipes/: every lock loads, every profile resolves, and each pin still open is listed in its page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.image.image import INSTALL_SCRIPT
from tasks.lock.lockfile import load_lock

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LOCKS = sorted(RECIPES.glob("*.lock"))


def open_section(page: Path) -> str:
    """The text of the page's "## Open here" section."""
    text = page.read_text()
    match = re.search(r"^## Open here\n(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{page} has no '## Open here' section"
    return match["body"]


def test_the_four_reference_recipes_are_here() -> None:
    assert [p.stem for p in LOCKS] == ["improve-muon", "infir2", "megatron-aks", "trinity-rft-megatron"]
    index = (RECIPES / "README.md").read_text()
    for lock in LOCKS:
        assert f"]({lock.name})" in index and f"]({lock.stem}.md)" in index, f"README.md does not list {lock.name}"


@pytest.mark.parametrize("lock_path", LOCKS, ids=[p.stem for p in LOCKS])
def test_recipe_lock_loads_resolves_and_lists_what_is_open(lock_path: Path) -> None:
    lock = load_lock(lock_path, require_pins=False)
    for profile in ["default", *lock.profiles]:
        packages = lock.resolve(profile)
        assert packages or lock.runtime_for(profile), f"{lock_path.name}: profile {profile} builds nothing"
        for pkg in packages:  # patch files exist (ours) or name a source of the lock (another's)
            for name in pkg.patch_sources():
                assert name in lock.sources
    page = lock_path.with_suffix(".md")
    assert page.is_file(), f"{lock_path.name} has no page {page.name}"
    listed = open_section(page)
    missing = sorted({f"[{where}]" for where in lock.unpinned_where} - set(re.findall(r"`(\[[^\]`]+\])`", listed)))
    if lock.image is not None and not lock.image.digest:
        missing += [] if "`[image]`" in listed else ["[image]"]
    if lock.builder is not None and not lock.builder.digest:
        missing += [] if "`[builder]`" in listed else ["[builder]"]
    assert not missing, f"{page.name}: pins open in the lock but not listed under 'Open here': {missing}"


@pytest.mark.parametrize("lock_path", LOCKS, ids=[p.stem for p in LOCKS])
def test_recipe_image_definition_is_there(lock_path: Path) -> None:
    """`doit image lock=recipes/NAME.lock` finds the install script: docker_dir is relative to the lock."""
    image = load_lock(lock_path, require_pins=False).image
    if image is None:
        return
    assert (image.docker_dir / INSTALL_SCRIPT).is_file(), (
        f'{lock_path.name}: [image] docker_dir {image.docker_dir} has no {INSTALL_SCRIPT}: set docker_dir = "../docker"'
    )
