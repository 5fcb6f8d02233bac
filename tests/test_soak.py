"""The short soak (benchmarks/soak.py): lifecycles over and over, nothing grows or is lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


@pytest.mark.perf
def test_a_short_soak_stays_flat() -> None:
    """30 s of epochs, breaks, errors, closes, resumes: exact; memory, threads, files flat."""
    done = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "30"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert 0 == done.returncode, done.stdout + done.stderr[-3000:]
    assert ": flat" in done.stdout
