"""Smoke test of megatron-core (CPU): the C++ dataset helpers came with the wheel and compute.

``helpers_cpp`` must import without compiling anything (our patch builds it
with the wheel; upstream compiles it with `make` at first use), and
``compile_helpers()`` must return at once. The sample index of three
documents of 5, 3 and 7 tokens, sequence length 4, one epoch, one extra
token per sample (GPT-style), is worked out by hand from the algorithm in
helpers.cpp: samples start at (document, offset) (0, 0), (0, 4), (2, 0),
(2, 4); each spans 5 tokens and the next starts on its last token.
"""

from __future__ import annotations

import importlib

from _harness import Result, run, verdict  # first: see _harness.py

EXPECTED = [[0, 0], [0, 4], [2, 0], [2, 4]]


def sample_index() -> Result:
    numpy = importlib.import_module("numpy")
    helpers = importlib.import_module("megatron.core.datasets.helpers_cpp")
    sizes = numpy.array([5, 3, 7], dtype=numpy.int32)
    documents = numpy.array([0, 1, 2], dtype=numpy.int32)
    got = helpers.build_sample_idx_int32(sizes, documents, 4, 1, 15, True, 1)
    ok = got.dtype == numpy.int32 and got.tolist() == EXPECTED
    return verdict(ok, f"build_sample_idx_int32 -> {got.tolist()} {got.dtype} (expected {EXPECTED} int32, exact)")


def no_runtime_compile() -> Result:
    utils = importlib.import_module("megatron.core.datasets.utils")
    utils.compile_helpers()  # would run `make` (and fail: no Makefile in a wheel) without the patch
    return "PASS", "compile_helpers() returned without compiling: helpers_cpp was built with the wheel"


if __name__ == "__main__":
    run("sample_index", sample_index)
    run("no_runtime_compile", no_runtime_compile)
