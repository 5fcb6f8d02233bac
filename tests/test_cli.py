"""The nostall command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import scripted

from nostall._tools.cli import main
from nostall._tools.tune import YOURS, Setting


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents the commands and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert 0 == info.value.code
    out = capsys.readouterr().out
    for command in ("bench", "doctor", "devices", "memory"):
        assert command in out


def test_bench_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """bench --help documents each flag: one per BenchConfig field, and the output flags."""
    import dataclasses

    from nostall.bench import BenchConfig

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    fields = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(BenchConfig)]
    for flag in [*fields, "--check", "--json", "--plot", "--no-progress"]:
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
        ["bench", "--depth", "0"],
        ["bench", "--gpu-transforms"],
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contenders", "no such contender"], "unknown contenders ['no such contender']"),
        (["--device", "nonsense"], "--device nonsense does not name a device"),
        (["--device", "cuda:x"], "--device cuda:x does not name a device"),
        (["--device", "meta"], "--device meta holds no data"),
    ],
)
def test_bench_configuration_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the bench refuses before measuring: one line naming the command, exit status 2."""
    assert 2 == main(["bench", *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert 1 == len(err.strip().splitlines()), err
    assert err.startswith("nostall bench: error: ")
    assert message in err


def test_an_error_while_benchmarking_is_not_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError raised while measuring propagates with its traceback, not as exit 2."""

    def run_bench_that_fails(config: object, progress: object) -> None:
        raise ValueError("a figure went wrong")

    monkeypatch.setattr("nostall.bench.run_bench", run_bench_that_fails)
    with pytest.raises(ValueError, match="a figure went wrong") as info:
        main(["bench", "--device", "cpu", "--no-progress"])
    assert "run_bench_that_fails" in [entry.name for entry in info.traceback]


@pytest.mark.parametrize(("speedups", "status"), [([1.5, 1.6], 0), ([0.6, 0.7], 1)])
def test_bench_check_exits_non_zero_when_a_claim_fails(
    speedups: list[float],
    status: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--check prints each claim; a failed one makes the exit status 1, never 0."""
    from helpers import bench_result

    values = {
        ("synthetic", "1", "serial DataLoader", "speedup"): [1.0, 1.0],
        ("synthetic", "1", "nostall", "speedup"): speedups,
    }
    monkeypatch.setattr("nostall.bench.run_bench", lambda config, progress: bench_result(values))
    assert status == main(["bench", "--device", "cpu", "--no-progress", "--check"])
    out = capsys.readouterr().out
    assert ("[FAILED]" in out) == bool(status)
    assert "[held]" in out or "[FAILED]" in out


def test_bench_check_exits_3_when_the_machine_is_too_busy_to_judge(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """At load 6 on 2 cores --check judges nothing: "[not judged]", the load, status 3."""
    from helpers import bench_result

    values = {
        ("synthetic", "1", "serial DataLoader", "speedup"): [1.0, 1.0],
        ("synthetic", "1", "nostall", "speedup"): [0.99, 0.99],
    }
    result = bench_result(values, load=6.0)
    monkeypatch.setattr("nostall.bench.run_bench", lambda config, progress: result)
    assert 3 == main(["bench", "--device", "cpu", "--no-progress", "--check"])
    out = capsys.readouterr().out
    assert "[not judged]" in out
    assert "too busy to check: load average 6.0" in out
    assert "FAILED" not in out


def test_bench_without_check_exits_zero_and_prints_no_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Measure and state: without --check nothing is judged and the status is 0."""
    from helpers import bench_result

    values = {("synthetic", "1", "nostall", "speedup"): [0.6, 0.7]}
    monkeypatch.setattr("nostall.bench.run_bench", lambda config, progress: bench_result(values))
    assert 0 == main(["bench", "--device", "cpu", "--no-progress"])
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert "[held]" not in out


def test_bench_output_paths_are_checked_before_measuring(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --json path in a missing folder is refused at once (exit 2), nothing measured."""

    def never(config: object, progress: object) -> None:
        raise AssertionError("measured before checking the output path")

    monkeypatch.setattr("nostall.bench.run_bench", never)
    missing = tmp_path / "no" / "bench.json"
    assert 2 == main(["bench", "--no-progress", "--json", str(missing)])
    assert "does not exist" in capsys.readouterr().err


def test_help_states_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    """--help says which errors are usage errors (2) and which keep their traceback."""
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "2 bad usage" in out
    assert "shown with its traceback" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_on_missing_cuda_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """A device that is not here: exit 2 and a message saying what to pass."""
    assert 2 == main(["bench", "--device", "cuda", "--batches", "2"])
    err = capsys.readouterr().err
    assert "pass --device cpu instead, or no --device to pick the best one" in err  # the flag
    assert "device='" not in err  # not the Python argument's spelling
    assert 1 == len(err.strip().splitlines()), err


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
        "--jpeg-images",
        "0",
        "--min-run-time",
        "0.01",
    ]
    assert 0 == main(argv)
    out = capsys.readouterr().out
    assert "serial DataLoader" in out
    assert "conclusion:" in out
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


THREAD_BOUND_LOADER = """
import sqlite3
import torch
from torch.utils.data import DataLoader, Dataset

class Rows(Dataset):
    def __init__(self):
        self.connection = sqlite3.connect(":memory:")  # usable in this thread only
        self.connection.execute("create table rows (i integer)")
        self.connection.executemany("insert into rows values (?)", [(i,) for i in range(64)])

    def __len__(self):
        return 64

    def __getitem__(self, i):
        row = self.connection.execute("select i from rows where i = ?", (i,)).fetchone()
        return torch.tensor(row)

def make_loader(num_workers=0):
    return DataLoader(Rows(), batch_size=4, num_workers=num_workers)
"""


def test_doctor_on_a_dataset_bound_to_its_thread_says_why_in_one_line(tmp_path: Path) -> None:
    """The real command: exit status 2 and one line naming the thread and the fix, no traceback."""
    import nostall

    (tmp_path / "rows_train.py").write_text(THREAD_BOUND_LOADER)
    env = {**os.environ, "PYTHONPATH": str(Path(nostall.__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "nostall", "doctor", "rows_train:make_loader", "--device", "cpu",
         "--no-progress", "--repeats", "1", "--max-batches", "20"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert 2 == done.returncode, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert 1 == len(lines), done.stderr[-3000:]
    assert lines[0].startswith(
        "nostall doctor: error: the loader that make_loader() builds loads in this thread, "
        "but raised ProgrammingError"
    )
    assert "check_same_thread=False" in lines[0]


STREAM_LOADER = """
import torch
from torch.utils.data import DataLoader, IterableDataset

class Stream(IterableDataset):
    def __iter__(self):
        return (torch.zeros(4) for _ in range(10_000))

def make_loader(num_workers=0, prefetch_factor=None, persistent_workers=False):
    return DataLoader(Stream(), batch_size=2, num_workers=num_workers,
                      prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
"""


@pytest.fixture
def stream_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's module with a streaming loader (no threads tried), importable as stream_train."""
    (tmp_path / "stream_train.py").write_text(STREAM_LOADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stream_train", raising=False)
    return "stream_train:make_loader"


def test_tune_prints_the_best_setting_as_code_beside_yours(
    stream_module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """nostall tune: the best with its spread, yours with its spread, the code to paste."""
    scripted(
        monkeypatch,
        {Setting(0, 2): [100.0, 150.0, 140.0, 160.0], YOURS: [80.0, 70.0, 90.0]},
    )
    argv = ["tune", stream_module, "--device", "cpu", "--no-progress"]
    assert 0 == main(argv)
    out = capsys.readouterr().out.splitlines()
    assert [
        "best found: num_workers=0, nostall.prefetch depth=2, 150 samples/s (140-160 over 3 runs).",
        "yours, as built (the factory's num_workers, no prefetcher): 80 samples/s (70-90 over 3 "
        "runs).",
        "measurably faster: 1.88x yours. change your code to:",
        "    loader = make_loader(num_workers=0, persistent_workers=False, prefetch_factor=None)",
        "    for batch in nostall.prefetch(loader, 'cpu', depth=2):",
    ] == out[:5]
    assert out[-1].startswith("machine: load average ")  # as the doctor says it


def test_tune_with_one_repeat_says_it_cannot_tell(
    stream_module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--repeats 1: the best found in one run, no code, and why."""
    scripted(monkeypatch, {Setting(0, 2): [150.0], YOURS: [80.0]})
    assert 0 == main(["tune", stream_module, "--device", "cpu", "--no-progress", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "150 samples/s (one run)" in out
    assert "cannot tell whether the best found is faster" in out
    assert "change your code" not in out


def test_tune_says_when_yours_ran_faster(
    stream_module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scripted(monkeypatch, {Setting(0, 2): [100.0, 50.0, 55.0, 60.0], YOURS: [200.0, 210.0, 190.0]})
    assert 0 == main(["tune", stream_module, "--device", "cpu", "--no-progress"])
    out = capsys.readouterr().out
    assert "your loop as built ran faster than every setting tried: keep it." in out
    assert "change your code" not in out


def test_tune_help_and_json(
    stream_module: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tune --help lists its flags; --json holds the best with its runs and yours."""
    import json

    with pytest.raises(SystemExit) as info:
        main(["tune", "--help"])
    assert 0 == info.value.code
    text = capsys.readouterr().out
    for flag in ("MODULE:FACTORY", "--step", "--transform", "--repeats", "--max-batches", "--json"):
        assert flag in text
    scripted(monkeypatch, {Setting(0, 2): [100.0, 150.0, 140.0, 160.0], YOURS: [80.0]})
    path = tmp_path / "tune.json"
    assert 0 == main(
        ["tune", stream_module, "--device", "cpu", "--no-progress", "--json", str(path)]
    )
    figures = json.loads(path.read_text())
    assert [140.0, 150.0, 160.0] == sorted(figures["rate"]["runs"])
    assert {"start", "end"} == set(figures["load_average"])
    assert 80.0 == figures["yours"]["median"]
