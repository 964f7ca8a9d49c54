"""Console lines stay whole when threads print at once (doit runs tasks in threads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, threading
from tasks.core import console
console.install()
def go(n):
    for i in range(500):
        print(f"thread {n} line {i} " + "x" * 40, flush=True)
        print("partial", end="", flush=True)
        print(" and its end", flush=True)
threads = [threading.Thread(target=go, args=(n,)) for n in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_lines_from_many_threads_stay_whole() -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert len(lines) == 6 * 500 * 2
    bad = [line for line in lines if not re.fullmatch(r"thread \d line \d+ x{40}|partial and its end", line)]
    assert not bad, bad[:5]
