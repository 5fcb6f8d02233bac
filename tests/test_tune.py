"""nostall.tune, and the loader factories it takes (depth="auto": test_autodepth.py)."""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest
import torch
from helpers import as_dataset, scripted, sqlite_loader
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._tools.tune import YOURS, Setting, accepted_knobs, loader_kwargs, measure
from nostall.cuda._timing import Measured


class Sleepy(Dataset[torch.Tensor]):
    """Each sample waits ``delay`` seconds (I/O-like), so parallel loading pays."""

    def __init__(self, n: int = 20_000, delay: float = 0.001) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((16,), float(i))


def factory(
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader[torch.Tensor]:
    return DataLoader(
        Sleepy(),
        batch_size=8,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


# -- factories -----------------------------------------------------------------------------------


def test_accepted_knobs() -> None:
    """Only the settings a factory names (or all, with **kwargs) are passed."""

    def named(num_workers: int = 0) -> list[int]:
        return []

    def anything(**kwargs: Any) -> list[int]:
        return []

    assert {"num_workers"} == accepted_knobs(named)
    assert {"num_workers", "pin_memory", "prefetch_factor", "persistent_workers"} == (
        accepted_knobs(anything)
    )
    assert set() == accepted_knobs(lambda: [])


def worker_defaults(
    num_workers: int = 2,
    pin_memory: bool = False,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = True,
) -> DataLoader[torch.Tensor]:
    """An ordinary factory whose defaults are for worker processes."""
    return DataLoader(
        Sleepy(400, delay=0.0),
        batch_size=8,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


def test_num_workers_zero_resets_the_arguments_a_dataloader_forbids_without_workers() -> None:
    """num_workers=0 goes with prefetch_factor=None and persistent_workers=False."""
    cpu = torch.device("cpu")
    assert {
        "num_workers": 0,
        "persistent_workers": False,
        "prefetch_factor": None,
        "pin_memory": False,
    } == loader_kwargs(worker_defaults, Setting(0, 2), cpu)
    assert {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 2} == {
        k: v
        for k, v in loader_kwargs(worker_defaults, Setting(2, 2), cpu).items()
        if k != "pin_memory"
    }


def test_tune_tries_num_workers_zero_on_a_factory_with_worker_defaults() -> None:
    """The num_workers=0 trial builds a loader the DataLoader accepts (no prefetch_factor=2)."""
    result = nostall.tune(worker_defaults, max_batches=40, device="cpu", max_workers=0)
    assert Setting(0, 2) == result.curve[0][0]
    assert result.curve[0][1] > 0


def test_measure_skips_start_up_and_counts_samples() -> None:
    """A trial times the batches after the warm-up, in samples/s, and says what it used."""
    rate, used = measure(factory, Setting(0, 2), torch.device("cpu"), batches=5)
    assert 7 == used
    assert rate > 0


@pytest.mark.perf
def test_measure_gives_the_loaders_rate() -> None:
    """One sample per ms (sleeps), give or take half (a timing claim: ``make test-perf``)."""
    rate, _ = measure(factory, Setting(0, 2), torch.device("cpu"), batches=5)
    assert 8 / 0.008 * 0.5 < rate < 8 / 0.008 * 1.5


# -- tune ----------------------------------------------------------------------------------------


def test_tune_stays_within_max_batches() -> None:
    """Few batches spent, starting from the plain setting; the best is one it tried."""
    result = nostall.tune(factory, max_batches=300, device="cpu", max_workers=2)
    long_epoch = len(factory())  # 2,500 batches
    assert result.batches_spent <= 0.03 * long_epoch * 4  # 300: 3% of a 10,000-batch epoch
    assert result.batches_spent <= 300
    assert result.curve[0][0] == Setting(0, 2)
    assert result.best in [setting for setting, _ in result.curve]


@pytest.mark.perf
def test_tune_finds_parallel_loading_within_max_batches() -> None:
    """Against a grid of every setting, tune gets close to the best (``make test-perf``)."""
    cpu = torch.device("cpu")
    grid = {
        s: measure(factory, s, cpu, batches=12)[0]
        for s in (Setting(w, d) for w in (0, 2) for d in (2, 4, 8))
    }
    best_grid = max(grid.values())
    result = nostall.tune(factory, max_batches=300, device="cpu", max_workers=2)
    assert result.samples_per_s >= 0.8 * best_grid, (result, grid)  # 95% in quiet conditions
    assert 2 == result.best.num_workers or (result.best.threads or 0) >= 2  # loads in parallel


def test_tune_tries_loading_threads_where_the_loader_allows_them() -> None:
    """After the worker processes, threads=2, 4, ... over num_workers=0, measured as they run."""
    result = nostall.tune(factory, max_batches=300, device="cpu", max_workers=1)
    threaded = [s for s, _ in result.curve if s.threads is not None]
    assert threaded, result.curve
    assert all(0 == s.num_workers for s in threaded)
    assert 2 == threaded[0].threads
    assert "threads=2" in threaded[0].describe()
    rate, used = measure(factory, Setting(0, 2, 2), torch.device("cpu"), batches=3)
    assert rate > 0
    assert 5 == used


def test_tune_leaves_threads_out_where_the_loader_cannot_use_them() -> None:
    """Over an IterableDataset a thread count changes the data (N workers' split): no trial."""

    class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self) -> Any:
            return (torch.zeros(4) for _ in range(10_000))

    def streaming(num_workers: int = 0) -> DataLoader[torch.Tensor]:
        return DataLoader(Stream(), batch_size=2, num_workers=num_workers)

    result = nostall.tune(streaming, max_batches=60, device="cpu", max_workers=0)
    assert all(s.threads is None for s, _ in result.curve)


def test_tune_without_a_num_workers_knob_tunes_depth_only() -> None:
    """A factory that takes no settings still gets a depth."""
    result = nostall.tune(
        lambda: DataLoader(Sleepy(400), batch_size=8), max_batches=60, device="cpu"
    )
    assert result.best.num_workers is None
    assert result.best.depth is not None


@pytest.mark.parametrize("max_batches", [14, 15, 16, 29, 30])
def test_tune_never_spends_more_than_max_batches(max_batches: int) -> None:
    """Once the first trial (14 batches here) fits, every batch pulled counts and fits.

    The batch that weighs a batch for the depth limit included: it is pulled only when a depth
    trial can follow within ``max_batches``.
    """

    def quick() -> DataLoader[torch.Tensor]:
        return DataLoader(Sleepy(400, delay=0.0), batch_size=8)

    result = nostall.tune(quick, max_batches=max_batches, device="cpu", repeats=1)
    assert 14 <= result.batches_spent <= max_batches
    assert len(result.curve) == 1 + (max_batches >= 14 + 1 + 14)


class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    """A stream: threads are not tried on it, so the search is workers and depth only."""

    def __iter__(self) -> Any:
        return (torch.zeros(4) for _ in range(10_000))


def streaming(num_workers: int = 0) -> DataLoader[torch.Tensor]:
    return DataLoader(Stream(), batch_size=2, num_workers=num_workers)


def test_tune_picks_on_the_medians_of_the_leading_settings_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lucky single trial (300, then 90-100) loses to a setting that holds 150 run after run."""
    order = scripted(
        monkeypatch,
        {
            Setting(0, 2): [100.0, 150.0, 150.0, 150.0],
            Setting(2, 2): [300.0, 90.0, 100.0, 95.0],
            YOURS: [80.0, 70.0, 90.0],
        },
    )
    result = nostall.tune(streaming, max_batches=300, device="cpu", max_workers=2)
    assert Setting(0, 2) == result.best
    assert Measured((150.0, 150.0, 150.0)) == result.rate
    assert 150.0 == result.samples_per_s
    assert Measured((80.0, 70.0, 90.0)) == result.yours
    assert Measured((90.0, 100.0, 95.0)) == result.measured(Setting(2, 2))
    assert [Setting(2, 2), Setting(0, 2), YOURS] * 3 == order[-9:]  # taking turns
    assert result.batches_spent <= 300


def test_tune_with_one_repeat_picks_on_single_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """repeats=1: nothing measured again; the rate is the one trial, and says so."""
    scripted(monkeypatch, {Setting(0, 2): [100.0], Setting(2, 2): [300.0]})
    result = nostall.tune(streaming, max_batches=300, device="cpu", max_workers=2, repeats=1)
    assert Setting(2, 2) == result.best
    assert [] == result.confirmed
    assert result.yours is None
    assert 1 == result.rate.n


def test_tune_keeps_room_in_max_batches_for_measuring_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search stops early enough for 3 settings x 3 runs x 14 batches within max_batches."""
    scripted(monkeypatch, {Setting(0, 2): [100.0], Setting(2, 2): [200.0], Setting(4, 2): [400.0]})
    result = nostall.tune(streaming, max_batches=14 + 14 + 126, device="cpu", max_workers=4)
    assert [Setting(0, 2), Setting(2, 2)] == [s for s, _ in result.curve]
    assert 3 == len(result.confirmed)
    assert 14 + 14 + 126 == result.batches_spent


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_batches": 300.0}, TypeError, "nostall.tune(max_batches=...) must be an int >= 1"),
        ({"max_batches": True}, TypeError, "nostall.tune(max_batches=...) must be an int >= 1"),
        ({"max_batches": 0}, ValueError, "nostall.tune(max_batches=...) must be >= 1"),
        ({"max_workers": -1}, ValueError, "nostall.tune(max_workers=...) must be >= 0"),
        ({"max_workers": "2"}, TypeError, "nostall.tune(max_workers=...) must be an int >= 0"),
        ({"batches_per_trial": 0}, ValueError, "nostall.tune(batches_per_trial=...) must be >= 1"),
        ({"threshold": "5%"}, TypeError, "nostall.tune(threshold=...) must be a number"),
        ({"threshold": -0.1}, ValueError, "nostall.tune(threshold=...) must be a number >= 0"),
        ({"threshold": float("nan")}, ValueError, "nostall.tune(threshold=...) must be"),
        ({"step": "train:step"}, TypeError, "nostall.tune(step=...) must be a function or None"),
        ({"device": "nonsense"}, ValueError, "device='nonsense' does not name a device"),
        ({"repeats": 0}, ValueError, "nostall.tune(repeats=...) must be >= 1"),
        ({"repeats": 2.0}, TypeError, "nostall.tune(repeats=...) must be an int >= 1"),
    ],
)
def test_tune_checks_its_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Wrong types raise TypeError, wrong values ValueError, naming the argument and the value."""
    with pytest.raises(error) as info:
        nostall.tune(factory, **kwargs)
    assert message in str(info.value)


def test_tune_refuses_the_meta_device_before_building_a_loader() -> None:
    """device='meta' holds no data to time: refused at once, not by the first trial's prefetch."""
    built = []

    def make_loader(num_workers: int = 0) -> DataLoader[Any]:
        built.append(num_workers)
        return DataLoader(as_dataset(range(64)), batch_size=4, num_workers=num_workers)

    with pytest.raises(ValueError, match="device='meta' holds no data"):
        nostall.tune(make_loader, device="meta")
    assert [] == built


def test_tune_refuses_a_loader_in_place_of_its_factory() -> None:
    """The loader itself where its factory is wanted: a TypeError saying what to pass."""
    with pytest.raises(
        TypeError,
        match=r"nostall.tune\(factory=...\) must be a function .*make_loader, not make_loader\(\)",
    ):
        nostall.tune(factory(), max_batches=20, device="cpu")  # type: ignore[arg-type]


def decode_sample(i: int) -> torch.Tensor:
    raise ValueError(f"bad sample {i}")


class Broken(Dataset[torch.Tensor]):
    """Every sample fails, as a corrupt file would, in the user's own function."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return decode_sample(i)


def test_an_error_in_the_users_dataset_reaches_the_caller_itself() -> None:
    """Raised in the prefetcher's thread during a trial: the same ValueError, with its frame."""
    with pytest.raises(ValueError, match="bad sample 0") as info:
        nostall.tune(lambda: DataLoader(Broken(), batch_size=2), max_batches=20, device="cpu")
    text = "".join(traceback.format_exception(info.type, info.value, info.tb))
    assert "in decode_sample" in text


def test_a_dataset_bound_to_its_thread_is_refused_with_the_fix() -> None:
    """Loads here, raises in nostall's thread: one ValueError naming the fix, sqlite3's as cause."""
    import sqlite3

    with pytest.raises(ValueError, match="works only in the thread that built it") as info:
        nostall.tune(sqlite_loader, max_batches=40, device="cpu")
    assert "sqlite_loader() builds loads in this thread, but raised ProgrammingError" in str(
        info.value
    )
    assert "check_same_thread=False" in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.ProgrammingError)


def test_tune_reports_each_trial_and_applies_the_transform() -> None:
    """on_trial sees every trial in order; the transform runs as the pipeline runs it."""
    trials: list[tuple[Setting, float, int]] = []
    seen = []

    def double(batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.shape[0])
        return batch * 2

    def loader(num_workers: int = 0) -> DataLoader[torch.Tensor]:
        return DataLoader(Sleepy(64, 0.0), batch_size=8, num_workers=num_workers)

    result = nostall.tune(
        loader,
        max_batches=40,
        device="cpu",
        transform=double,
        on_trial=lambda s, r, spent: trials.append((s, r, spent)),
    )
    assert [(s, r) for s, r, _ in trials] == result.curve
    spent = [n for _, _, n in trials]
    assert spent == sorted(spent)
    assert spent[-1] <= result.batches_spent
    assert len(seen) >= len(trials)  # every trial's batches went through it
    assert set(seen) == {8}


@pytest.mark.parametrize("depth", [None, 2])
def test_measure_applies_the_transform_with_and_without_the_prefetcher(depth: int | None) -> None:
    seen: list[float] = []

    def mark(batch: torch.Tensor) -> torch.Tensor:
        seen.append(float(batch[0, 0]))
        return batch

    def loader() -> DataLoader[torch.Tensor]:
        return DataLoader(Sleepy(40, 0.0), batch_size=4)

    measure(loader, Setting(None, depth), torch.device("cpu"), batches=3, transform=mark)
    assert seen[:3] == [0.0, 4.0, 8.0]  # the batches in order, each once


class Jittered(Sleepy):
    """An augmentation that draws from torch's global generator, as torchvision's v2 ones do."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return super().__getitem__(i) + torch.randn(16)


def jittered(num_workers: int = 0) -> DataLoader[torch.Tensor]:
    return DataLoader(Jittered(delay=0.0005), batch_size=8, num_workers=num_workers)


class EscapingJitter(Sleepy):
    """Draws through a torch function that takes no generator=: not each sample's own."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.nn.functional.dropout(super().__getitem__(i) + 1, 0.5)


def test_tune_tries_threads_for_a_loader_drawing_from_the_global_generator() -> None:
    """Under threads= each sample draws from its own generator: tried, the draws named."""
    result = nostall.tune(jittered, max_batches=80, device="cpu", max_workers=1)
    assert ("torch's global generator",) == result.drew
    assert any(s.threads is not None for s, _ in result.curve), result.curve
    safety = result.thread_safety
    assert safety is not None
    assert "agreed" == safety.verdict
    assert ["torch's global generator"] == result.to_dict()["drew"]


def test_tune_never_tries_threads_where_the_draws_escape_the_samples_generators() -> None:
    """Threads would share those draws: never tried, so never recommended."""

    def escaping(num_workers: int = 0) -> DataLoader[torch.Tensor]:
        return DataLoader(EscapingJitter(delay=0.0005), batch_size=8, num_workers=num_workers)

    result = nostall.tune(escaping, max_batches=80, device="cpu", max_workers=1)
    assert all(s.threads is None for s, _ in result.curve), result.curve
    assert result.best.threads is None
    safety = result.thread_safety
    assert safety is not None
    assert ("random", ("torch's global generator",)) == (safety.verdict, safety.drew)
    assert "torch.thread_safe_generator()" in safety.describe()


def test_tune_sees_no_draws_in_a_loader_that_makes_none() -> None:
    result = nostall.tune(factory, max_batches=40, device="cpu", max_workers=1)
    assert () == result.drew
