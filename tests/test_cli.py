"""The nostall command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nostall._cli import main


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents the commands and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert 0 == info.value.code
    out = capsys.readouterr().out
    for command in ("bench", "doctor", "devices"):
        assert command in out


def test_bench_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """bench --help documents each flag."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    flags = [
        "--batches",
        "--batch-size",
        "--image-size",
        "--width",
        "--ratios",
        "--depths",
        "--io-share",
        "--workers",
        "--compute-threads",
        "--repeats",
        "--device",
        "--contenders",
        "--handoff-batches",
        "--h2d-mb",
        "--epochs",
        "--epochs-ratio",
        "--gpu-transforms",
        "--transform-image-size",
        "--json",
        "--plot",
        "--no-progress",
    ]
    for flag in flags:
        assert flag in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--no-such-flag"],
        ["bench", "--batches", "0"],
        [],
        ["bench", "--ratios", "1,x"],
        ["bench", "--ratios", "-1"],
        ["bench", "--io-share", "-0.5"],
        ["bench", "--depths", "0"],
    ],
)
def test_bad_usage_exits_two_with_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad flags and values exit 2 with the usage line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert 2 == info.value.code
    assert "usage: nostall" in capsys.readouterr().err


def test_bad_config_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """A value argparse accepts but the bench refuses: exit 2 with the reason."""
    assert 2 == main(["bench", "--io-share", "2", "--no-progress"])
    assert "io_share must be between 0 and 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_on_missing_cuda_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """A device that is not here: exit 2 and a message saying what to pass."""
    assert 2 == main(["bench", "--device", "cuda", "--batches", "2"])
    assert "device='cpu'" in capsys.readouterr().err


def test_tiny_bench_prints_the_table_and_writes_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bench of a few batches runs on the CPU, prints the table, writes JSON and a chart."""
    argv = [
        "bench",
        "--batches",
        "4",
        "--batch-size",
        "4",
        "--image-size",
        "8",
        "--width",
        "2",
        "--ratios",
        "1",
        "--repeats",
        "1",
        "--handoff-batches",
        "20",
        "--device",
        "cpu",
        "--contenders",
        "serial DataLoader,nostall",
        "--json",
        str(tmp_path / "b.json"),
        "--plot",
        str(tmp_path / "b.png"),
        "--no-progress",
        "--epochs",
        "0",
    ]
    assert 0 == main(argv)
    out = capsys.readouterr().out
    assert "serial DataLoader" in out
    assert "winner:" in out
    assert (tmp_path / "b.json").is_file()
    assert (tmp_path / "b.png").is_file()


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
