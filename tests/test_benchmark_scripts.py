"""The study scripts in benchmarks/ run on the CPU, with tiny settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_gpu_transforms_agree_and_are_measured() -> None:
    """Both ways of normalising give the same numbers (exit 0) and a rate per worker count."""
    done = run("gpu_transforms.py", "--batches", "2", "--batch-size", "4", "--image-size", "16")
    assert 0 == done.returncode, done.stderr
    assert "device-side normalise" in done.stdout
    assert "largest difference between the two ways' first batches" in done.stdout


def test_epoch_boundaries_measures_every_way() -> None:
    """The four ways of crossing an epoch boundary, each with its ratio to the steady interval."""
    done = run("epoch_boundaries.py", "--epochs", "2", "--batches", "3", "--batch-size", "4")
    assert 0 == done.returncode, done.stderr
    for way in ("workers restarted", "persistent workers", "nostall across_epochs"):
        assert way in done.stdout


def test_h2d_refuses_without_a_gpu() -> None:
    """Host-to-device rates need CUDA: without it, a clear line and exit status 1."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA suite measures it")
    done = run("h2d.py")
    assert 1 == done.returncode
    assert "needs a CUDA device" in done.stderr
