"""Process set-up: glibc's allocator keeps a round's freed buffers for the next round.

Counted in minor page faults (deterministic for a fixed pattern), never in seconds: a fresh process
allocates eight 8 MiB arrays and frees them, four times, as a round allocates and frees its cohort's
buffers. With dpfl's set-up only the first pass maps new pages; with glibc's defaults every pass does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PASSES = """
import json, resource
import numpy as np
import fl_app  # noqa: F401  (the process set-up)
from fl_app.engine import process_setup

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

counts = []
for _ in range(4):
    before = faults()
    blocks = [np.ones(1 << 20) for _ in range(8)]
    del blocks
    counts.append(faults() - before)
print(json.dumps({"counts": counts, "applied": process_setup.keep_freed_memory()}))
"""


def faults_per_pass(**env: str) -> dict[str, object]:
    """Run :data:`PASSES` in a fresh interpreter with ``env`` added; its page faults per pass."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run(
        [sys.executable, "-c", PASSES], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_rounds_freed_buffers_are_reused_without_new_page_faults() -> None:
    kept = faults_per_pass()
    assert kept["applied"] is True
    first, *later = kept["counts"]  # (the kernel may map several pages a fault: compared, not counted)
    assert first > 1000 and max(later) < first * 0.05, kept

    default = faults_per_pass(DPFL_KEEP_FREED_MEMORY="0")  # the test can fail: glibc's own behaviour
    assert default["applied"] is False
    assert min(default["counts"][1:]) > first * 0.5, default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibcs_own_settings_in_the_environment_are_left_alone() -> None:
    own = faults_per_pass(MALLOC_TRIM_THRESHOLD_="131072")
    assert own["applied"] is False
