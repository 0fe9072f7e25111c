"""A trainer's freed host memory serves its next iteration (engine/host_memory.py): no page faults once warm.

Each case runs in a fresh process (malloc's thresholds are per process): eight "iterations" each allocate three
touched blocks of 20 MiB and free them, and every iteration's minor page faults are counted. glibc by default
trims the heap's free top after each (its trim threshold, twice the 20 MiB the mmap threshold rose to, is below
the 60 MiB freed), so every iteration faults its pages in again; with :func:`keep_freed_memory` the heap keeps
them and iterations after the first take none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ITERATIONS = """
import json, resource, sys
import numpy as np
from jabascli.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("null")
    sys.exit()
counts = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(20 * 2**20 // 8) for _ in range(3)]
    del blocks
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(counts))
"""


def faults_per_iteration(mode: str) -> list[int] | None:
    done = subprocess.run([sys.executable, "-c", ITERATIONS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_kept_heap_faults_no_page_in_again_after_the_first_iteration() -> None:
    default, kept = faults_per_iteration("default"), faults_per_iteration("keep")
    if kept is None:
        pytest.skip("this C library takes no mallopt thresholds (not glibc)")
    assert default is not None
    pages = 3 * 20 * 2**20 // 4096  # what an iteration touches, in 4 KiB pages
    # By default every iteration faults in a good part of its 60 MiB again (huge pages and fault-around make
    # it fewer faults than pages); kept, only the first iteration does.
    assert all(count > pages // 20 for count in default[2:]), default
    assert kept[0] > pages // 20 and all(count < 20 for count in kept[1:]), kept
