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


def test_gpu_check_without_a_gpu_skips_what_needs_one(tmp_path: Path) -> None:
    """`make gpu-check` on a machine without CUDA: GPU steps skipped, exit 0, a summary."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: gpu-check runs those steps")
    done = run("gpu_check.py", "--out", str(tmp_path), "--only", "cuda-tests,h2d,bench-cuda,suite")
    assert 0 == done.returncode, done.stdout + done.stderr
    summary = (tmp_path / "summary.md").read_text()
    for step in ("cuda-tests", "h2d", "bench-cuda", "suite"):
        assert f"| {step} | skipped (no CUDA device" in summary


def test_gpu_check_fails_when_a_step_fails(tmp_path: Path) -> None:
    """A step that fails makes the whole check exit 1, and the summary names it."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPTS))
    step = gpu_check.Step("boom", ("-c", "raise SystemExit(3)"), 30, False, "exits 3")
    outcome = gpu_check.run_step(step, tmp_path / "steps.log")
    assert ("failed", 3) == (outcome.status, outcome.returncode)
    slow = gpu_check.Step("slow", ("-c", "import time; time.sleep(60)"), 0.5, False, "sleeps")
    assert "timed out" == gpu_check.run_step(slow, tmp_path / "steps.log").status
