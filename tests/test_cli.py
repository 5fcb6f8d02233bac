"""The nostall command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nostall._cli import main


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents the commands and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert 0 == info.value.code
    assert "bench" in capsys.readouterr().out


def test_bench_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """bench --help names each flag."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for flag in [
        "--batches",
        "--batch-size",
        "--load-ms",
        "--step-ms",
        "--depth",
        "--repeats",
        "--device",
    ]:
        assert flag in out


@pytest.mark.parametrize(
    "argv", [["--no-such-flag"], ["bench", "--depth", "0"], [], ["bench", "--load-ms", "-1"]]
)
def test_bad_usage_exits_two_with_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad flags and values exit 2 with the usage line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert 2 == info.value.code
    assert "usage: nostall" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_on_missing_cuda_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """A device that is not here: exit 2 and a message saying what to pass."""
    assert 2 == main(["bench", "--device", "cuda", "--batches", "2"])
    assert "device='cpu'" in capsys.readouterr().err


def test_tiny_bench_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    """A bench of a few batches runs on the CPU and prints both ways."""
    assert 0 == main(
        [
            "bench",
            "--batches",
            "4",
            "--load-ms",
            "2",
            "--step-ms",
            "2",
            "--repeats",
            "1",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert "serial DataLoader" in out
    assert "nostall.prefetch" in out


def test_python_dash_m() -> None:
    """python -m nostall is the same command."""
    done = subprocess.run(
        [sys.executable, "-m", "nostall", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert 0 == done.returncode
    assert done.stdout.startswith("nostall ")
