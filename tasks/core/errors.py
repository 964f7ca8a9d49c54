"""The one exception hierarchy of the project.

Every expected failure raises a subclass of :class:`ReproError`. Its message
says what failed, why, and what to do next; ``exit_code`` tells scripts apart
the kinds of failure. Tracebacks are shown only when ``REPRO_DEBUG=1``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit


class ReproError(Exception):
    """Base class of all expected failures."""

    exit_code = 10

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class LockError(ReproError):
    """The lock file is missing, malformed or inconsistent."""

    exit_code = 11


class FetchError(ReproError):
    """A source could not be downloaded."""

    exit_code = 12


#: What git (curl) and requests say when no connection can be made at all: no name resolution, or no
#: network, a closed port.
_NO_NAME = re.compile(
    r"Could not resolve (?:host|proxy)|Temporary failure in name resolution|Name or service not known|Failed to resolve"
)
_NO_CONNECTION = re.compile(
    r"Failed to connect|Couldn't connect to server|Connection refused|Network is unreachable|No route to host"
    r"|Failed to establish a new connection"
)


def unreachable(url: str, detail: str) -> FetchError | None:
    """The error for a host this machine cannot connect to (``detail``, a tool's output, says so), else None.

    It names the host, not the source, its log or the tool: every source of that host fails the same way at
    once, git's and the package index's alike, and a run says the same error once (tasks/cli/graph.py).
    """
    host = urlsplit(url).hostname or url
    if _NO_NAME.search(detail):
        what = f"cannot resolve the name {host}"
    elif _NO_CONNECTION.search(detail):
        what = f"cannot connect to {host}"
    else:
        return None
    return FetchError(
        f"{what}: no network to it from here. Without network, build from a mirror made where there is one: "
        "`doit mirror mirror=DIR` there, then `doit wheels mirror=DIR` here (docs/offline.md); behind a proxy, "
        "set https_proxy."
    )


class VerificationError(ReproError):
    """Downloaded or cached content does not match its pinned hash."""

    exit_code = 13


class PatchError(ReproError):
    """A patch does not apply."""

    exit_code = 14


class BuildError(ReproError):
    """A package build failed."""

    exit_code = 15


class ToolchainError(ReproError):
    """The build toolchain does not match what the lock expects."""

    exit_code = 16


class VerifyFailed(ReproError):
    """`doit verify` found at least one failing check."""

    exit_code = 17


class ReproMismatch(ReproError):
    """`doit repro` rebuilt at least one wheel with different bytes."""

    exit_code = 18


class ImageError(ReproError):
    """Docker, a registry or a container image (runtime, builder, export) failed."""

    exit_code = 19


class BundleError(ReproError):
    """An air-gapped bundle cannot be written, or was altered, incomplete or unreadable."""

    exit_code = 20


class Interrupted(ReproError):
    """The run was stopped by a signal while this work ran (a download, a fetch): it stopped cleanly.

    The run's status is 128 + the signal's number, as a shell reports a process the signal ended:
    130 for Ctrl-C (SIGINT, the class's own), 143 for SIGTERM, 129 for SIGHUP.
    """

    exit_code = 130

    def __init__(self, message: str, signum: int = 2) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def debug_enabled() -> bool:
    """True when the user asked for tracebacks of expected failures."""
    return os.environ.get("REPRO_DEBUG", "") not in ("", "0")


class PreflightFailed(ReproError):
    """`doit preflight`: the node lacks what the wheels need (a driver, a GPU, glibc, Python or torch)."""

    exit_code = 21
