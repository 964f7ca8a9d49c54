"""Everything one doit run shares: settings, the parsed lock, the cache, the toolchain.

Loading the context parses the lock only (milliseconds); the toolchain is
probed on first use, never while doit merely lists tasks.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tasks import builder as builder_mod
from tasks import toolchain
from tasks.cache import Cache
from tasks.keys import action_key, key_document
from tasks.lockfile import Lock, Package, arch_env, expand_env, load_lock
from tasks.settings import Settings, load_settings
from tasks.timeline import Outcome
from tasks.treehash import file_sha256


@dataclass
class Context:
    settings: Settings
    lock: Lock
    cache: Cache
    _keys: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, doit_vars: dict[str, str] | None = None) -> Context:
        settings = load_settings(doit_vars)
        lock = load_lock(settings.lock, require_pins=False)
        lock.resolve(settings.profile)  # reject an unknown profile now
        return cls(settings=settings, lock=lock, cache=Cache(settings.cache))

    @cached_property
    def packages(self) -> tuple[Package, ...]:
        return self.lock.resolve(self.settings.profile)

    def package(self, name: str) -> Package:
        for pkg in self.packages:
            if pkg.name == name:
                return pkg
        raise KeyError(name)

    @cached_property
    def builder(self) -> builder_mod.Builder | None:
        """The builder image wheels build in (builder=, the lock's [builder]), or None: this host."""
        return builder_mod.resolve(self.settings, self.lock.builder, lock=self.lock.path)

    @cached_property
    def toolchain(self) -> dict[str, Any]:
        """The probed toolchain (this host's or the builder image's), checked against the lock's expectations."""
        info = toolchain.detect(self.cache) if self.builder is None else builder_mod.detect(self.cache, self.builder)
        toolchain.check_expectations(self.lock.toolchain, info, lock=self.lock.path)
        return info

    def patches(self, pkg: Package) -> list[tuple[str, Path]]:
        return [(p, self.lock.patch_path(pkg.name, p)) for p in pkg.patches]

    def key(self, pkg: Package) -> tuple[str, dict[str, Any]]:
        """The action key of ``pkg`` and the document it hashes."""
        if pkg.name not in self._keys:
            info = self.toolchain
            requires = toolchain.check_build_requires(pkg.build_requires, info, package=pkg.name)
            doc = key_document(
                pkg,
                sources=self.lock.sources,
                patches=[(name, file_sha256(path)) for name, path in self.patches(pkg)],
                toolchain=toolchain.fingerprint(info, extras=pkg.toolchain_extras, cuda=pkg.cuda),
                archs=self.lock.toolchain.archs,
                build_requires=requires,
                builder=self.builder.pin if self.builder is not None else None,
            )
            self._keys[pkg.name] = (action_key(doc), doc)
        return self._keys[pkg.name]

    def placeholder_values(self) -> dict[str, str]:
        info = self.toolchain
        values = arch_env(self.lock.toolchain.archs)
        values["cudnn_path"] = info["cudnn"]["path"]
        values["cuda_home"] = info["cuda_home"]
        return values

    def recipe_env(self, pkg: Package) -> dict[str, str]:
        return expand_env(dict(pkg.env), self.placeholder_values())

    def record(self, outcome: Outcome) -> None:
        """Remember what happened to a package in this run (builds may run in threads)."""
        with self._lock:
            self.outcomes[outcome.package] = outcome

    def jobs_for(self, pkg: Package) -> int:
        """Compiler jobs for one package: the budget, lowered to what memory allows."""
        budget = self.settings.jobs or os.cpu_count() or 1
        avail = available_memory_gb()
        if avail is not None:
            budget = min(budget, max(1, int(avail // pkg.mem_per_job_gb)))
        return max(1, budget)


def available_memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        return None
    return None
