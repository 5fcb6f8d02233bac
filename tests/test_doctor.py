"""nostall doctor: measuring a user's loader, the code it recommends, its reports, bad input.

What the figures say (the verdict, the speed-up, the summary's lines) is tested in
test_diagnosis.py, on figures made by hand.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import as_dataset, assert_honest

from nostall._exceptions import ConfigurationError
from nostall._tools import doctor as _doctor
from nostall._tools import tune as _tune
from nostall._tools.cli import main
from nostall._tools.doctor import diagnose, recommend
from nostall._tools.specs import load_callable
from nostall._tools.tune import Setting

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

def make_worker_loader(num_workers=2, pin_memory=False, prefetch_factor=2, persistent_workers=True):
    # Defaults for worker processes: a DataLoader refuses prefetch_factor=2 with num_workers=0.
    return DataLoader(Slow(), batch_size=8, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)

CONSTANT = 3

def returns_int():
    return 42

def returns_tensor(num_workers=0):
    return torch.zeros(64, 16)

def returns_string():
    return "train.csv"

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

def make_empty_loader(num_workers=0):
    return DataLoader([], batch_size=4, num_workers=num_workers)

def make_tiny_loader(num_workers=0):
    return DataLoader(list(range(8)), batch_size=4, num_workers=num_workers)

transformed = []

def halve(batch):
    transformed.append(1)
    x, y = batch
    return x / 2, y

def failing_transform(batch):
    raise ValueError("bad transform")

class SqliteRows(Dataset):
    # An sqlite3 connection opened in __init__: it works only in the thread that made it.
    def __init__(self):
        import sqlite3
        self.connection = sqlite3.connect(":memory:")
        self.connection.execute("create table rows (i integer)")
        self.connection.executemany("insert into rows values (?)", [(i,) for i in range(64)])

    def __len__(self):
        return 64

    def __getitem__(self, i):
        row = self.connection.execute("select i from rows where i = ?", (i,)).fetchone()
        return torch.tensor(row)

def make_sqlite_loader(num_workers=0):
    return DataLoader(SqliteRows(), batch_size=4, num_workers=num_workers)
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
    """Whatever the machine's load: a verdict, every rate with its runs, and an honest summary."""
    factory = load_callable(f"{user_module}:make_loader", "factory")
    step = load_callable(f"{user_module}:step", "--step")
    seen: list[tuple[str, float]] = []
    diagnosis = diagnose(
        factory,
        step=step,
        device="cpu",
        max_batches=40,
        repeats=2,
        progress=lambda phase, done: seen.append((phase, done)),
    )
    verdicts = ("input-bound", "compute-bound", "balanced", "too busy to judge")
    assert diagnosis.bound in verdicts
    assert diagnosis.step_rate is not None
    assert 2 == diagnosis.step_rate.n  # the step alone, measured as often as the loader
    assert diagnosis.step_rate.low > 0
    assert torch.get_num_threads() == diagnosis.threads
    assert diagnosis.cores == os.cpu_count()
    assert diagnosis.load_average is not None
    assert f"load average up to {diagnosis.load_average:.1f}" in diagnosis.summary()
    rates = (diagnosis.load, diagnosis.as_built, diagnosis.with_nostall[1])
    for rate in (*rates, diagnosis.without_nostall[1]):
        assert len(rate.runs) == 2
        assert 0 < rate.low <= rate.median <= rate.high
    assert diagnosis.best[0].num_workers in (0, 1, 2)
    text = diagnosis.summary()
    assert text.startswith(f"{diagnosis.bound}: loading ")
    assert_honest(diagnosis)
    phases = [phase for phase, _ in seen]
    assert phases[0].startswith("load only")
    assert any(p.startswith("searching") for p in phases)
    assert phases[-1] == "done"
    shares = [done for _, done in seen]
    assert shares == sorted(shares)  # the bar only moves forward
    assert shares[-1] == 1.0


def test_the_doctor_tries_num_workers_zero_on_a_factory_with_worker_defaults(
    user_module: str,
) -> None:
    """A factory whose defaults are for worker processes is measured at num_workers=0 too."""
    factory = load_callable(f"{user_module}:make_worker_loader", "factory")
    diagnosis = diagnose(factory, device="cpu", max_batches=30, repeats=1)
    assert Setting(0, 2) == diagnosis.search.curve[0][0]
    # Code only for a measurably faster setting: never with one run each (repeats=1), however
    # fast num_workers=0 ran. What code it gives then: test_tune's scripted runs.
    if diagnosis.best[0].num_workers == 0 and diagnosis.code:
        assert "prefetch_factor=None" in diagnosis.code


def test_loading_alone_and_the_step_alone_take_turns_at_the_loops_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run for run, the loader alone then the step alone, with the caller's intra-op threads."""
    events: list[object] = []
    inside = []
    real = _tune.measure

    def measure(*args: Any, **kwargs: Any) -> tuple[float, int]:
        inside.append(1)
        try:
            if kwargs.get("step") is None:
                events.append("load")
            return real(*args, **kwargs)
        finally:
            inside.pop()

    def step(batch: Any) -> None:
        if not inside:
            events.append(("step", torch.get_num_threads()))

    def make_loader(num_workers: int = 0) -> torch.utils.data.DataLoader[torch.Tensor]:
        return torch.utils.data.DataLoader(as_dataset(torch.zeros(64, 4)), batch_size=4)

    monkeypatch.setattr(_doctor, "measure", measure)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the user's loop runs with one intra-op thread
    try:
        diagnosis = diagnose(make_loader, step=step, device="cpu", max_batches=20, repeats=3)
    finally:
        torch.set_num_threads(before)
    turns = [e if e == "load" else "step" for e in events]
    runs = [e for i, e in enumerate(turns) if i == 0 or turns[i - 1] != e]
    assert ["load", "step"] * 3 == runs[:6]
    assert {("step", 1)} == {e for e in events if e != "load"}
    assert 1 == diagnosis.threads
    assert diagnosis.step_rate is not None
    assert 3 == diagnosis.step_rate.n


def test_the_recommendation_is_the_code_to_write() -> None:
    def make_loader(num_workers: int = 0, persistent_workers: bool = False) -> list[Any]:
        return []

    def normalize(batch: Any) -> Any:
        return batch

    cpu = torch.device("cpu")
    assert recommend(make_loader, Setting(4, 8), cpu, normalize) == (
        "    loader = make_loader(num_workers=4, persistent_workers=True)\n"
        "    for batch in nostall.prefetch(loader, 'cpu', depth=8, transform=normalize):"
    )
    assert recommend(make_loader, Setting(0, None), cpu, None).splitlines() == [
        "    loader = make_loader(num_workers=0, persistent_workers=False)",
        "    for batch in loader:  # move each batch to the device in the loop",
    ]


def test_the_recommendation_names_the_loading_threads() -> None:
    def make_loader(num_workers: int = 0) -> list[Any]:
        return []

    code = recommend(make_loader, Setting(0, 2, 4), torch.device("cpu"), None)
    assert code.splitlines() == [
        "    loader = make_loader(num_workers=0)",
        "    for batch in nostall.prefetch(loader, 'cpu', depth=2, threads=4):",
    ]


def test_the_transform_is_measured_with_the_pipeline(user_module: str) -> None:
    factory = load_callable(f"{user_module}:make_loader", "factory")
    halve = load_callable(f"{user_module}:halve", "--transform")
    diagnosis = diagnose(factory, device="cpu", max_batches=20, repeats=1, transform=halve)
    module = sys.modules[user_module]
    assert len(module.transformed) > 0  # the runs and the search applied it
    if diagnosis.code and diagnosis.best[0].depth is not None:
        assert "transform=halve" in diagnosis.code


@pytest.mark.perf
def test_diagnosis_of_a_slow_loader(user_module: str) -> None:
    """Input-bound, a faster setting found and measured (a timing claim: ``make test-perf``)."""
    factory = load_callable(f"{user_module}:make_loader", "factory")
    step = load_callable(f"{user_module}:step", "--step")
    diagnosis = diagnose(factory, step=step, device="cpu", max_batches=120)
    assert "input-bound" == diagnosis.bound
    assert diagnosis.step_rate is not None
    assert diagnosis.load.median < diagnosis.step_rate.median
    assert diagnosis.speedup is not None
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
        "40",
        "--repeats",
        "2",
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
        "code",
        "tune",
        "summary",
    } <= set(figures)
    assert {"median", "low", "high", "runs"} <= set(figures["loop_samples_per_s"])
    page = html_path.read_text()
    assert "<svg" in page
    assert "<script" not in page
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert [] == list(tmp_path.glob("*.nostall"))  # the write checks left nothing behind


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
        ("{m}:CONSTANT", "is an int, not a function"),
        ("{m}:returns_int", "returned an int, not an iterable loader"),
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
    flags = ("MODULE:FACTORY", "--step", "--transform", "--repeats", "--max-batches", "--json")
    for flag in (*flags, "--device", "--html"):
        assert flag in out


def _user_frames(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


@pytest.mark.parametrize(
    ("argv", "message", "frame"),
    [
        (["{m}:make_broken_loader"], "bad sample", "decode_sample"),
        (["{m}:make_loader_that_refuses"], "no such split", "make_loader_that_refuses"),
        (["{m}:make_loader", "--step", "{m}:failing_step"], "bad step", "failing_step"),
        (["{m}:make_loader", "--transform", "{m}:failing_transform"], "bad transform", "failing_"),
    ],
    ids=["dataset", "factory", "step", "transform"],
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
        ("{m}:returns_int", "returned an int, not an iterable loader"),
        ("{m}:returns_tensor", "returned a Tensor, whose iteration yields its rows, not a loader"),
        ("{m}:returns_string", "returned a str, whose iteration yields its characters"),
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


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("nonsense", "--device nonsense does not name a device"),
        ("meta", "--device meta holds no data"),
    ],
)
def test_a_bad_device_is_a_usage_error(
    device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device that names no device (or one without data): one line and status 2, at once."""
    assert 2 == main(["doctor", "nope:missing", "--device", device, "--no-progress"])
    err = capsys.readouterr().err
    assert 1 == len(err.strip().splitlines()), err
    assert message in err


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


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_batches": "300"}, TypeError, "diagnose(max_batches=...) must be an int >= 1"),
        ({"max_batches": 0}, ValueError, "diagnose(max_batches=...) must be >= 1"),
        ({"step": "train:step"}, TypeError, "diagnose(step=...) must be a function or None"),
        ({"progress": 3}, TypeError, "diagnose(progress=...) must be a function or None"),
        ({"repeats": 0}, ValueError, "diagnose(repeats=...) must be >= 1"),
        ({"repeats": 1.5}, TypeError, "diagnose(repeats=...) must be an int >= 1"),
        ({"transform": "x"}, TypeError, "diagnose(transform=...) must be a function or None"),
        ({"device": "meta"}, ValueError, "device='meta' holds no data"),
    ],
)
def test_diagnose_checks_its_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Wrong types raise TypeError, wrong values ValueError, naming the argument."""
    with pytest.raises(error) as info:
        diagnose(lambda: [], **{"device": "cpu", **kwargs})  # type: ignore[arg-type]
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


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("make_empty_loader", "the loader that make_empty_loader() builds yields no batches"),
        ("make_tiny_loader", "yields only 2 batches: the doctor needs at least 3"),
    ],
)
def test_a_loader_with_nothing_to_time_is_one_line_and_status_two(
    factory: str, message: str, user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert 2 == main(["doctor", f"{user_module}:{factory}", "--device", "cpu", "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("nostall doctor: error: ")
    assert message in lines[0]


def test_a_dataset_bound_to_its_thread_is_one_line_and_status_two(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Loads in the plain loop, not in nostall's thread: the reason and the fix, no traceback."""
    argv = ["doctor", f"{user_module}:make_sqlite_loader", "--device", "cpu", "--no-progress"]
    assert 2 == main([*argv, "--repeats", "1", "--max-batches", "20"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert 1 == len(lines), lines
    assert lines[0].startswith(
        "nostall doctor: error: the loader that make_sqlite_loader() builds loads in this "
        "thread, but raised ProgrammingError (SQLite objects created in a thread"
    )
    assert "works only in the thread that built it" in lines[0]
    assert "check_same_thread=False" in lines[0]


@pytest.mark.parametrize(
    ("flag", "path", "message"),
    [
        ("--json", "{tmp}/no/such/folder/d.json", "does not exist"),
        ("--html", "{tmp}", "is a folder"),
        ("--json", "", "--json was given an empty path, so nothing would be written"),
        pytest.param(
            "--json",
            "/dev/full",
            "/dev/full cannot be written (No space left on device)",
            marks=pytest.mark.skipif(not Path("/dev/full").exists(), reason="Linux's /dev/full"),
            id="dev-full",
        ),
    ],
)
def test_output_paths_are_checked_before_measuring(
    flag: str,
    path: str,
    message: str,
    user_module: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A factory that raises when called shows that nothing was measured first."""
    argv = ["doctor", f"{user_module}:make_loader_that_refuses", flag, path.format(tmp=tmp_path)]
    assert 2 == main([*argv, "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert 1 == len(err.strip().splitlines()), err
    assert message in err
    assert "no such split" not in err


def test_a_recommendation_that_changes_the_draws_says_so_in_the_code() -> None:
    def make_loader(num_workers: int = 0) -> list[Any]:
        return []

    cpu = torch.device("cpu")
    drew = ("torch's global generator",)
    code = recommend(make_loader, Setting(2, 4), cpu, None, drew, 0).splitlines()
    assert code[0].startswith("    # NOTE: this changes the random draws your model sees:")
    assert "draws from torch's global generator, which with num_workers=2" in code[0]
    assert "give the draws a seeded generator of their own" in code[0]
    assert "    loader = make_loader(num_workers=2)" == code[1]
    same = recommend(make_loader, Setting(0, 4), cpu, None, drew, 0).splitlines()
    assert not any("NOTE" in line for line in same)  # in step with the loop: the same draws


class _Jittered(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i)) + torch.randn(16)  # a v2-style augmentation


def _jittered(num_workers: int = 0) -> torch.utils.data.DataLoader[torch.Tensor]:
    return torch.utils.data.DataLoader(_Jittered(), batch_size=8, num_workers=num_workers)


def test_the_doctor_tries_threads_for_a_loader_drawing_from_the_global_generator() -> None:
    """It says what drew, what nostall.prefetch does then, and checks threads as usual.

    Under threads= each sample's draws go to a generator of its own: the check agrees, and
    code that loads with threads says that the draws change.
    """
    diagnosis = diagnose(_jittered, device="cpu", max_batches=60, repeats=1)
    summary = diagnosis.summary()
    assert "random draws: your dataset or collate_fn draws from torch's global generator" in (
        summary
    )
    assert "under threads= each sample draws from a generator of its own" in summary
    assert "thread safety: not checked" not in summary
    if diagnosis.code and diagnosis.best[0].threads is not None:
        assert "which under threads= each sample draws from a generator of its own" in (
            diagnosis.code
        )
    elif diagnosis.code and diagnosis.best[0].num_workers not in (None, 0):
        assert "# NOTE: this changes the random draws your model sees" in diagnosis.code


def test_tune_says_the_load_and_what_a_busy_machine_means(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nostall tune's last line: the load at its start and end; on a busy machine, the rule."""
    from nostall._tools import doctor

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    quiet = doctor.tune_machine_line(0.4, 1.1)
    assert quiet == "machine: load average 0.4 at the start, 1.1 at the end on 2 cores."
    busy = doctor.tune_machine_line(1.5, 14.0)
    assert busy is not None
    assert busy.startswith("machine: load average 1.5 at the start, 14.0 at the end on 2 cores.")
    assert "called faster only where every run of it beat every run of yours" in busy
    assert doctor.tune_machine_line(None, None) is None
