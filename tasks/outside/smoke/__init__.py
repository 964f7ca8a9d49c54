"""Smoke scripts run by the verify stage, one per package (``verify.smoke`` in the lock).

Each ``<name>.py`` here is a standalone script (standard library, torch and
the package under test only) that the verify stage copies into a scratch
directory and runs with the verification venv's interpreter. It prints one
JSON line per sub-check::

    {"check": "fwd-bwd", "status": "PASS" | "FAIL" | "SKIP", "detail": "..."}

and states its tolerances in the code and in ``detail``. GPU sub-checks
honour ``REPRO_VERIFY_GPU`` (``0``: skip, ``1``: a GPU is required, unset:
skip when ``torch.cuda.is_available()`` is false) and never PASS without a
GPU. Any exception becomes a FAIL line with its text.

The helpers every script needs live between the ``--- harness`` markers;
``_harness.py`` holds the reference copy and the unit tests keep the copies
identical.
"""
