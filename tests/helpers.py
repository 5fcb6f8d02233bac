"""Small fakes and the golden helper shared by the tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import torch
import torch.utils.data

if TYPE_CHECKING:
    from nostall._tools.diagnosis import Diagnosis
    from nostall._tools.tune import Setting

#: The repository root: scripts and examples are named from it, and subprocesses run in it.
ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


@overload
def as_dataset(items: torch.Tensor) -> torch.utils.data.Dataset[torch.Tensor]: ...
@overload
def as_dataset(items: Sequence[T]) -> torch.utils.data.Dataset[T]: ...
def as_dataset(items: Sequence[T] | torch.Tensor) -> torch.utils.data.Dataset[Any]:
    """``items`` (a list, a range, a tensor) as the ``Dataset`` DataLoader's annotation asks for.

    A DataLoader indexes any sequence (``len(items)``, ``items[i]``), a tensor by its first
    dimension; only torch's type hints want a ``Dataset`` subclass. The same object is
    returned, unchanged: only its type is cast.
    """
    return cast("torch.utils.data.Dataset[Any]", items)


def nostall_threads() -> list[threading.Thread]:
    """The live threads nostall started."""
    return [t for t in threading.enumerate() if t.name.startswith("nostall-")]


def wait_for_no_nostall_threads(timeout: float = 3.0) -> list[threading.Thread]:
    """Wait until no nostall thread is alive; return those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (alive := nostall_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds; fail naming ``what`` after ``timeout`` seconds.

    For a condition that must come true: a loaded machine only makes it come later, never
    makes the test fail (unlike ``sleep(); assert``).
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout} s")
        time.sleep(0.005)


def settle() -> None:
    """Give a background thread a moment to do what it must not (an overshoot, say).

    Only ever before asserting that something did *not* happen: on a loaded machine the check
    may miss a violation, but it can never fail a correct program.
    """
    time.sleep(0.1)


def assert_same_batches(expected: Iterable[Any], actual: Iterable[Any]) -> None:
    """The golden check: same values, same order, same count, same structure and dtypes."""
    expected, actual = list(expected), list(actual)
    assert len(expected) == len(actual), f"{len(expected)} batches expected, {len(actual)} seen"
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert_same_tree(e, a, where=f"batch {i}")


def assert_same_tree(expected: Any, actual: Any, where: str = "batch") -> None:
    """Recursively compare two batches; tensors compared on the CPU, exactly."""
    assert type(expected) is type(actual), f"{where}: {type(expected)} != {type(actual)}"
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype, f"{where}: {expected.dtype} != {actual.dtype}"
        assert torch.equal(expected.cpu(), actual.cpu()), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), f"{where}: keys differ"
        for k in expected:
            assert_same_tree(expected[k], actual[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{where}: lengths differ"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_tree(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


class SleepingSource:
    """A re-iterable source of ``n`` batches, each ``delay`` seconds late: a slow loader.

    Batch ``i`` is ``torch.full(shape, i, dtype=dtype)`` (``tensor([i])`` by default), made
    after its sleep, so a consumer that pulls it waits the whole delay. ``len()`` is ``n``;
    ``iter(SleepingSource(...))`` is the one-shot generator, without ``len``, of a plain
    ``def source(): ... yield``.
    """

    def __init__(
        self,
        n: int,
        delay: float,
        shape: tuple[int, ...] = (1,),
        dtype: torch.dtype = torch.int64,
    ) -> None:
        self.n, self.delay, self.shape, self.dtype = n, delay, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            yield torch.full(self.shape, i, dtype=self.dtype)


class CountingSource(SleepingSource):
    """A re-iterable source of ``n`` int tensors that counts what was pulled from it."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        super().__init__(n, delay)
        self.iters = 0
        self.pulled = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.iters += 1
        for batch in super().__iter__():
            self.pulled += 1
            yield batch


class RaisingSource:
    """Yields ``k`` batches, then raises ``error``."""

    def __init__(self, k: int, error: BaseException) -> None:
        self.k, self.error = k, error

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.k):
            yield torch.tensor([i])
        raise self.error


class BrokenIter:
    """An iterable whose ``__iter__`` raises."""

    def __iter__(self) -> Iterator[Any]:
        raise OSError("cannot open the shards")


class MultiArgError(Exception):
    """An exception that cannot be rebuilt from its message alone."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


class Unmovable:
    """An object whose ``.to()`` raises, as a broken custom batch type would."""

    def to(self, device: Any, non_blocking: bool = False) -> Unmovable:
        raise RuntimeError(f"Unmovable cannot go to {device}")


def cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes held by CPU allocations made while ``fn`` runs, and its result.

    Read from the profiler's raw memory records (every allocation and free, in time order),
    so temporaries an op allocates and frees before returning count too.
    """
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # torch 2.11 warns that a profiler keeps one cycle's events; one cycle is all we read.
        # Its message starts "Warning: Profiler clears ...", and a filter's message must match
        # from the start.
        warnings.filterwarnings("ignore", r".*Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    assert prof.profiler is not None
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak, result


def cuda_peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes the caching allocator handed out on the GPU while ``fn`` ran, and its result."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


class SqliteRows(torch.utils.data.Dataset[torch.Tensor]):
    """A map dataset over an sqlite3 connection opened in ``__init__``.

    sqlite3 refuses a connection in any thread but the one that made it, so every sample
    loaded in another thread raises ``sqlite3.ProgrammingError``.
    """

    def __init__(self, n: int = 64) -> None:
        import sqlite3

        self.connection = sqlite3.connect(":memory:")
        self.connection.execute("create table rows (i integer, x real)")
        rows = [(i, i / 2) for i in range(n)]
        self.connection.executemany("insert into rows values (?, ?)", rows)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        (x,) = self.connection.execute("select x from rows where i = ?", (i,)).fetchone()
        return torch.tensor([x])


def sqlite_loader(
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> torch.utils.data.DataLoader[torch.Tensor]:
    """A factory for ``tune`` and the doctor: a DataLoader over a fresh :class:`SqliteRows`."""
    return torch.utils.data.DataLoader(
        SqliteRows(),
        batch_size=4,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


class CountingTransform:
    """A stateful transform: adds the number of batches it saw before this one."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        out = batch + self.seen
        self.seen += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


#: The smallest ``nostall bench`` run that still exercises every trial: seconds on the CPU.
TINY_BENCH: dict[str, Any] = dict(
    batches=4,
    batch_size=8,
    image_size=16,
    width=4,
    ratios=(0.5, 1.0),
    repeats=2,
    jpeg_images=8,
    jpeg_size=32,
    regime_batches=4,
    regime_batch_size=4,
    launch_ops=20,
    handoff_batches=50,
    convoy_batches=20,
    min_run_time=0.01,
    device="cpu",
)


def assert_honest(diagnosis: Diagnosis) -> None:
    """A speed-up only beyond the spread, always > 1, never infinite; else said plainly."""
    text = diagnosis.summary()
    assert "inf" not in text
    speedup = diagnosis.speedup
    if speedup is None:
        assert not any(line.startswith("measurably faster:") for line in text.splitlines())
        assert "change your code" not in text
        assert diagnosis.to_dict()["code"] is None
    else:
        assert diagnosis.best[1].low > diagnosis.as_built.high
        assert speedup > 1
        assert f"{speedup:.2f}x yours" in text
        assert diagnosis.code in text


def scripted(monkeypatch: Any, runs: dict[Setting, list[float]]) -> list[Setting]:
    """Make every run nostall.tune measures of a setting give its next value in ``runs``.

    ``monkeypatch`` is pytest's fixture. A setting not listed gives 10 samples/s; past its
    list, a setting repeats its last value. Returns the settings in the order they were run.
    """
    from nostall._tools import tune as _tune

    order: list[Setting] = []

    def fake_measure(
        factory: Any, setting: Setting, device: torch.device, *, batches: int, **_: Any
    ) -> tuple[float, int]:
        values = runs.get(setting, [10.0])
        order.append(setting)
        return values[min(order.count(setting), len(values)) - 1], batches + 2

    monkeypatch.setattr(_tune, "measure", fake_measure)
    return order


def bench_result(values: dict[tuple[str, str, str, str], list[float]], load: float = 0.2) -> Any:
    """A hand-made ``BenchResult``: each (trial, setting, contender, metric) with its values."""
    from nostall.bench import BenchConfig, BenchResult
    from nostall.bench._records import Record

    machine = {"device": "cpu", "torch": "x", "cores": 2, "cpu": "test", "workers": 1}
    result = BenchResult(BenchConfig(repeats=3), {**machine, "compute_threads": 1})
    result.load_average = {"start": [load, load, load], "end": [load, load, load]}
    for key, measured in values.items():
        result.records.extend(Record(*key, v, i) for i, v in enumerate(measured))
    return result


#: What torch's own gloo teardown prints when it aborts a rank at interpreter exit: its worker
#: threads still free tensors after the interpreter began finalising (pytorch/pytorch#179291).
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_process_group(
    command: list[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command``, which starts processes of its own (ranks), from the repository root.

    The ranks import this checkout's nostall (its ``src`` first on ``PYTHONPATH``). The command
    runs in a new session, so the processes it starts share its process group: if it has not
    finished after ``timeout`` seconds the whole group is stopped (SIGTERM, which torchrun
    passes on to its workers, then SIGKILL) and the test fails with the output so far, leaving
    no rank behind.
    """
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
            raise AssertionError(
                f"{' '.join(command)} still running after {timeout} s:\n"
                f"{stdout[-2000:]}\n{stderr[-3000:]}"
            ) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_torchrun(
    script: str | Path,
    *args: str,
    timeout: float,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc script *args``.

    Run by :func:`run_process_group`: from the repository root (``script`` may be named from
    it), this checkout's nostall, and no rank left behind after ``timeout`` seconds. ``env``
    replaces the inherited environment. Check the result with
    :func:`assert_torchrun_finished`, or its return code.
    """
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*runner, "--nproc-per-node", str(nproc), str(script), *args]
    return run_process_group(command, timeout=timeout, env=env)


def assert_torchrun_finished(done: Any, finished: Iterable[str]) -> None:
    """Every line of ``finished`` was printed; torchrun exited 0, or torch's teardown aborted.

    Accepted only as torch's gloo teardown aborting a rank at interpreter exit after all the
    lines were printed. That abort is torch's: on a loaded 2-core machine it ended 6 of 41
    runs of the DDP example with a plain DataLoader and no nostall object (nostall only
    imported), after every rank printed its last line.
    """
    for line in finished:
        assert line in done.stdout, (
            f"{line!r} not printed\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    if done.returncode != 0:
        assert GLOO_TEARDOWN_ABORT in done.stderr, done.stderr[-3000:]


@contextlib.contextmanager
def lightning_seed_unset() -> Iterator[None]:
    """Run without Lightning's seed variables, and put them back as they were afterwards.

    ``seed_everything()`` exports PL_GLOBAL_SEED and PL_SEED_WORKERS; other tests must not
    inherit them (monkeypatch.delenv of a name not yet set records nothing to undo).
    """
    names = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    before = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def refused_thread_starts(prefix: str, refusals: int | None = None) -> Iterator[list[str]]:
    """Make the OS refuse to start threads named ``prefix...``: the first ``refusals`` (all).

    Yields the names refused, as they are. Raises what ``Thread.start`` raises when the OS has
    no thread left ("can't start new thread").
    """
    refused: list[str] = []
    start = threading.Thread.start

    def refusing_start(thread: threading.Thread) -> None:
        if thread.name.startswith(prefix) and (refusals is None or len(refused) < refusals):
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    threading.Thread.start = refusing_start  # type: ignore[method-assign,assignment]
    try:
        yield refused
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]


class Blocking(torch.utils.data.Dataset[torch.Tensor]):
    """Sample 5 blocks (in C: a lock) until ``release`` is set, the first time it is loaded."""

    def __init__(self, n: int = 16) -> None:
        self.n = n
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5 and not self.blocked.is_set():
            self.blocked.set()
            self.release.wait()
        return torch.tensor(i)


class Hidden:
    """Its ``.to()`` returns an object that keeps the tensor in a closure, out of sight."""

    def __init__(self, x: torch.Tensor, hide: bool = False) -> None:
        self.get: Callable[[], torch.Tensor]
        if hide:
            self.get = lambda: x
        else:
            self.x = x
            self.get = lambda: self.x

    def to(self, device: Any, non_blocking: bool = False) -> Hidden:
        return Hidden(self.get().to(device, non_blocking=non_blocking), hide=True)

    def pin_memory(self) -> Hidden:
        return Hidden(self.get().pin_memory())


class HiddenEpoch(torch.utils.data.Sampler[int]):
    """A sampler of 4 whose ``set_epoch`` keeps no readable ``epoch``."""

    def __init__(self) -> None:
        self._e = 0

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))

    def __len__(self) -> int:
        return 4

    def set_epoch(self, epoch: int) -> None:
        self._e = epoch


class OneBadSample(torch.utils.data.Dataset[int]):
    """``length`` samples (40 by default); sample 6 raises every time, as a corrupt file."""

    def __init__(self, length: int = 40) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        if i == 6:
            raise ValueError("sample 6 is corrupt")
        return i


def seed_all(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators, as a training script does."""
    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def global_states() -> tuple[Any, ...]:
    """torch's, Python's and NumPy's global generators' states, as a checkpoint saves them."""
    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def set_global_states(states: tuple[Any, ...]) -> None:
    """Set the generators back to :func:`global_states`' ``states``, as a resumed run does."""
    import numpy as np

    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


class LoaderWrapper:
    """A class whose ``__iter__`` yields from a DataLoader it holds: timm's ``PrefetchLoader``."""

    def __init__(self, loader: torch.utils.data.DataLoader[Any]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        yield from self.loader

    def __len__(self) -> int:
        return len(self.loader)
