"""nostall doctor: the diagnosis of a user's loader, its reports, and bad input."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

from nostall._cli import main
from nostall._doctor import diagnose, load_callable
from nostall._exceptions import ConfigurationError

_names = itertools.count()

USER_MODULE = """
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 20_000

    def __getitem__(self, i):
        time.sleep(0.001)  # a slow read
        return torch.full((16,), float(i % 7)), i % 3

def make_loader(num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False):
    return DataLoader(Slow(), batch_size=8, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)

model = torch.nn.Linear(16, 3)

def step(batch):
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()

CONSTANT = 3

def returns_int():
    return 42

def decode_sample(i):
    raise ValueError("bad sample")  # the user's own bug, met while the doctor measures

class Broken(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return decode_sample(i)

def make_broken_loader(num_workers=0):
    return DataLoader(Broken(), batch_size=2, num_workers=num_workers)

def make_loader_that_refuses():
    raise ValueError("no such split: 'trian'")

def failing_step(batch):
    raise ValueError("bad step")
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's training module in the current directory, under a fresh name."""
    name = f"user_train_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_diagnosis_has_every_part(user_module: str) -> None:
    """Whatever the machine's load: a verdict, both rates, a best setting and its summary."""
    factory = load_callable(f"{user_module}:make_loader", "factory")
    step = load_callable(f"{user_module}:step", "--step")
    lines: list[str] = []
    diagnosis = diagnose(factory, step=step, device="cpu", max_batches=120, progress=lines.append)
    assert diagnosis.bound in ("input-bound", "compute-bound", "balanced")
    assert diagnosis.step_rate is not None
    assert diagnosis.step_rate > 0
    assert diagnosis.load_rate > 0
    assert diagnosis.best[0].num_workers in (0, 1, 2)
    text = diagnosis.summary()
    assert text.startswith(f"{diagnosis.bound}: loading ")
    assert f"best found: num_workers={diagnosis.best[0].num_workers}" in text
    assert 5 == len(lines)  # a progress line per phase


@pytest.mark.perf
def test_diagnosis_of_a_slow_loader(user_module: str) -> None:
    """Input-bound, a faster setting found and measured (a timing claim: ``make test-perf``)."""
    factory = load_callable(f"{user_module}:make_loader", "factory")
    step = load_callable(f"{user_module}:step", "--step")
    diagnosis = diagnose(factory, step=step, device="cpu", max_batches=120)
    assert "input-bound" == diagnosis.bound
    assert diagnosis.step_rate is not None
    assert diagnosis.load_rate < diagnosis.step_rate
    assert diagnosis.speedup > 1.3  # two workers where the factory used none
    assert 2 == diagnosis.best[0].num_workers


def test_reports(user_module: str, tmp_path: Path) -> None:
    """--json holds the figures; --html is one offline page with a chart."""
    json_path, html_path = tmp_path / "d.json", tmp_path / "d.html"
    argv = [
        "doctor",
        f"{user_module}:make_loader",
        "--step",
        f"{user_module}:step",
        "--device",
        "cpu",
        "--max-batches",
        "80",
        "--json",
        str(json_path),
        "--html",
        str(html_path),
        "--no-progress",
    ]
    assert 0 == main(argv)
    figures = json.loads(json_path.read_text())
    assert {
        "bound",
        "load_samples_per_s",
        "step_samples_per_s",
        "loop_samples_per_s",
        "best",
        "speedup",
        "tune",
        "summary",
    } <= set(figures)
    page = html_path.read_text()
    assert "<svg" in page
    assert "<script" not in page
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")


def test_without_a_step_the_bound_is_unknown(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --step the doctor still measures loading and says what it cannot judge."""
    assert 0 == main(
        [
            "doctor",
            f"{user_module}:make_loader",
            "--device",
            "cpu",
            "--max-batches",
            "60",
            "--no-progress",
        ]
    )
    assert "pass --step" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon", "must be MODULE:FUNCTION"),
        ("no_such_module_nostall:make", "cannot import module"),
        ("{m}:missing", "has no attribute 'missing'"),
        ("{m}:CONSTANT", "is a int, not a function"),
        ("{m}:returns_int", "returned a int, not an iterable loader"),
    ],
)
def test_bad_factory_exits_two(
    target: str, message: str, user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad MODULE:FACTORY: a clear message and exit status 2."""
    assert 2 == main(["doctor", target.format(m=user_module), "--device", "cpu", "--no-progress"])
    assert message in capsys.readouterr().err


def test_bad_step_exits_two(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--step is checked the same way."""
    assert 2 == main(
        ["doctor", f"{user_module}:make_loader", "--step", f"{user_module}:nope", "--no-progress"]
    )
    assert "--step" in capsys.readouterr().err


def test_doctor_help(capsys: pytest.CaptureFixture[str]) -> None:
    """doctor --help documents its arguments."""
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--help"])
    assert 0 == info.value.code
    out = capsys.readouterr().out
    for flag in ("MODULE:FACTORY", "--step", "--device", "--max-batches", "--json", "--html"):
        assert flag in out


def _user_frames(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


@pytest.mark.parametrize(
    ("argv", "message", "frame"),
    [
        (["{m}:make_broken_loader"], "bad sample", "decode_sample"),
        (["{m}:make_loader_that_refuses"], "no such split", "make_loader_that_refuses"),
        (["{m}:make_loader", "--step", "{m}:failing_step"], "bad step", "failing_step"),
    ],
    ids=["dataset", "factory", "step"],
)
def test_a_value_error_in_user_code_keeps_its_traceback(
    argv: list[str], message: str, frame: str, user_module: str
) -> None:
    """A ValueError raised by the user's own code is no usage error: it propagates, itself.

    Its traceback reaches down to the user's function, which is the line they need to see.
    """
    full = ["doctor", *(a.format(m=user_module) for a in argv), "--device", "cpu"]
    with pytest.raises(ValueError, match=message) as info:
        main([*full, "--max-batches", "20", "--no-progress"])
    assert not isinstance(info.value, ConfigurationError)
    assert frame in _user_frames(info.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nope:missing", "cannot import module 'nope'"),
        ("{m}:returns_int", "returned a int, not an iterable loader"),
    ],
)
def test_a_configuration_error_is_one_line_and_status_two(
    target: str, message: str, user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What was typed wrong: one line on stderr, naming the command, and exit status 2."""
    argv = ["doctor", target.format(m=user_module), "--device", "cpu", "--no-progress"]
    assert 2 == main(argv)
    err = capsys.readouterr().err
    assert 1 == len(err.strip().splitlines()), err
    assert err.startswith("nostall doctor: error: ")
    assert message in err
    assert "Traceback" not in err


def test_a_bad_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--device that names no device: one line and status 2, before the factory is imported."""
    assert 2 == main(["doctor", "nope:missing", "--device", "nonsense", "--no-progress"])
    err = capsys.readouterr().err
    assert 1 == len(err.strip().splitlines()), err
    assert "device='nonsense' does not name a device" in err


def test_a_users_module_that_fails_to_import_keeps_its_traceback(
    tmp_path: Path, user_module: str
) -> None:
    """The module exists but its own import fails: the user's error, not a bad spec."""
    (tmp_path / f"{user_module}_deps.py").write_text("import no_such_dependency_of_nostall\n")
    (tmp_path / f"{user_module}_top.py").write_text("raise ValueError('bad config file')\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_nostall"):
        main(["doctor", f"{user_module}_deps:make", "--device", "cpu", "--no-progress"])
    with pytest.raises(ValueError, match="bad config file") as info:
        main(["doctor", f"{user_module}_top:make", "--device", "cpu", "--no-progress"])
    assert not isinstance(info.value, ConfigurationError)


def test_load_callable_raises_configuration_errors(user_module: str) -> None:
    """A bad spec is a ConfigurationError, still a ValueError for Python callers."""
    for spec in ("no_colon", ".relative:make", "nope:missing", f"{user_module}:missing"):
        with pytest.raises(ConfigurationError):
            load_callable(spec, "factory")
    assert issubclass(ConfigurationError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_batches": "300"}, TypeError, "diagnose(max_batches=...) must be an int >= 1"),
        ({"max_batches": 0}, ValueError, "diagnose(max_batches=...) must be >= 1"),
        ({"step": "train:step"}, TypeError, "diagnose(step=...) must be a function or None"),
        ({"progress": 3}, TypeError, "diagnose(progress=...) must be a function or None"),
    ],
)
def test_diagnose_checks_its_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Wrong types raise TypeError, wrong values ValueError, naming the argument."""
    with pytest.raises(error) as info:
        diagnose(lambda: [], device="cpu", **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_diagnose_refuses_a_loader_in_place_of_its_factory() -> None:
    """The loader itself where its factory is wanted: a TypeError saying what to pass."""
    with pytest.raises(TypeError, match=r"diagnose\(factory=...\) must be a function"):
        diagnose([1, 2, 3], device="cpu")  # type: ignore[arg-type]


def _command(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nostall", "doctor", *args, "--device", "cpu", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )


def test_the_command_shows_the_users_traceback(user_module: str, tmp_path: Path) -> None:
    """The real command: the user's ValueError printed by Python with their frame, status 1."""
    done = _command(tmp_path, f"{user_module}:make_broken_loader", "--max-batches", "20")
    assert done.returncode not in (0, 2), done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert "in decode_sample" in done.stderr
    assert "ValueError: bad sample" in done.stderr
    assert "nostall doctor: error" not in done.stderr


def test_the_command_reports_a_bad_spec_in_one_line(user_module: str, tmp_path: Path) -> None:
    """The real command: a spec that cannot be loaded is one line and status 2."""
    done = _command(tmp_path, "nope:missing")
    assert 2 == done.returncode
    assert [
        "nostall doctor: error: cannot import module 'nope' for the loader factory: "
        "No module named 'nope'"
    ] == done.stderr.strip().splitlines()
