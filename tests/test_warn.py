"""Every warning nostall gives names the user's line (nostall._warn).

One table here rather than a test in each raising module's file: the property is the same for
every warning (the line reported is the first outside nostall), a row per warning shows at a
glance that none is missing, and a test checks that no warning bypasses the helper. Each row
does what a user does, through ``nostall.prefetch(...)`` and through ``nostall.Prefetcher(...)``
built directly (one frame apart, so a counted ``stacklevel`` is wrong on one of them), and
marks the line the warning must name with ``# <- warns``.
"""

from __future__ import annotations

import ast
import linecache
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    Blocking,
    Hidden,
    HiddenEpoch,
    as_dataset,
    refused_thread_starts,
    wait_for_no_nostall_threads,
    wait_until,
)
from simcuda import simulated_cuda
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import nostall
from nostall import PrefetchTimeoutError, _device
from nostall._engine import latest_producer as _latest_producer
from nostall._epochs.epochs import EpochSource
from nostall._loading import pool as _pool
from nostall._sources import checks as _source_checks
from nostall._sources import sharding as _sharding
from nostall._sources.global_draws import GlobalDrawsWarning, unwatched
from nostall._staging import cuda as _staging_cuda
from nostall._warn import warn

Entry = Callable[..., nostall.Prefetcher[Any]]
Run = Callable[[Entry, pytest.MonkeyPatch], None]

MARK = "# <- warns"
ENTRIES = {"prefetch": nostall.prefetch, "Prefetcher": nostall.Prefetcher}
SRC = Path(nostall.__file__).parent


# Sources and batches the rows need.


class Stream(IterableDataset[int]):
    """An iterable-style dataset without state_dict."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


class Jittered(Dataset[torch.Tensor]):
    """Draws from torch's global generator, as torchvision's v2 augmentations do."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i)) + torch.randn(2)


class Unpinnable:
    """Has ``.to()`` but no ``.pin_memory()``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> Unpinnable:
        return Unpinnable(self.x.to(device, non_blocking=non_blocking))


class StuckAt:
    """Yields 0..7, but the first pass blocks before item ``at`` until ``release`` is set."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(8):
            if i == self.at and not self.blocked.is_set():
                self.blocked.set()
                self.release.wait()
            yield torch.tensor(i)


def open_per_worker(worker_id: int) -> None:
    """A worker_init_fn (threads= does not call it)."""


def numbers(n: int = 8) -> DataLoader[int]:
    return DataLoader(as_dataset(list(range(n))), batch_size=2)


def stateful_loader(dataset: Any, **kwargs: Any) -> Any:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful.StatefulDataLoader(dataset, batch_size=2, **kwargs)


def as_rank_0_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch.distributed is initialised with two ranks, this one rank 0."""
    monkeypatch.setattr(_sharding, "distributed_world", lambda: (0, 2))
    monkeypatch.setattr(_source_checks, "distributed_world", lambda: (0, 2))


# The rows: each does what a user does; the line marked is the one the warning must name.


def local_rank_guess(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(_device, "_local_rank_guess_announced", False)
    with simulated_cuda(device_count=4):
        entry([torch.ones(2)]).close()  # <- warns


def workers_restarted(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = DataLoader(as_dataset(list(range(4))), num_workers=1)
    entry(loader, "cpu", across_epochs=True).close()  # <- warns


def unreadable_set_epoch(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = DataLoader(as_dataset(list(range(4))), sampler=HiddenEpoch())
    entry(loader, "cpu", across_epochs=True).close()  # <- warns


def unsharded(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    as_rank_0_of_2(monkeypatch)
    with entry(numbers(), "cpu") as p:
        next(iter(p))  # <- warns


def unprepared_under_accelerate(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_source_checks, "accelerate_is_active", lambda: True)
    with entry(numbers(), "cpu") as p:
        next(iter(p))  # <- warns


def unseeded_webdataset_shuffle(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    # What finds the shuffle is tested in test_streaming; here only where the warning points.
    monkeypatch.setattr(_source_checks, "unreplayable_shuffles", lambda *_: ["shuffle(8)"])
    state = entry(numbers(), "cpu").state_dict()
    entry(numbers(), "cpu").load_state_dict(state)  # <- warns


def stateful_loader_generator(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    data = list(range(8))
    state = entry(stateful_loader(data, generator=torch.Generator()), "cpu").state_dict()
    p = entry(stateful_loader(data, generator=torch.Generator()), "cpu")
    p.load_state_dict(state)  # <- warns


def iterable_dataset_without_state(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    state = entry(stateful_loader(Stream()), "cpu").state_dict()
    entry(stateful_loader(Stream()), "cpu").load_state_dict(state)  # <- warns


def worker_init_fn_not_called(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = DataLoader(as_dataset(list(range(4))), batch_size=2, worker_init_fn=open_per_worker)
    entry(loader, "cpu", threads=2).close()  # <- warns


def global_draws(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in entry(DataLoader(Jittered(), batch_size=2), "cpu"):  # <- warns
        torch.rand(())  # the step draws from the dataset's generator too


def unpinnable_objects(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_staging_cuda, "_WARNED", set())
    with simulated_cuda():
        for _ in entry([Unpinnable(torch.ones(2)) for _ in range(3)], "cuda"):  # <- warns
            pass


def hidden_tensors(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_staging_cuda, "_WARNED", set())
    with simulated_cuda():
        for _ in entry([Hidden(torch.ones(2)) for _ in range(3)], "cuda"):  # <- warns
            pass


def close_while_stuck(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_latest_producer, "CLOSE_JOIN_S", 0.05)
    source = StuckAt(1)
    try:
        with unwatched():  # the producer runs ahead from the first batch, not in step
            p = entry(source, "cpu", timeout=60)  # a timeout: the consumer never pulls itself
        it = iter(p)
        next(it)
        wait_until(source.blocked.is_set, "the producer blocked in the source")
        p.close()  # <- warns
    finally:
        source.release.set()


def with_block_ends_while_stuck(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_latest_producer, "CLOSE_JOIN_S", 0.05)
    source = StuckAt(1)
    with unwatched():
        p = entry(source, "cpu", timeout=60)
    try:
        with p:  # <- warns
            it = iter(p)
            next(it)
            wait_until(source.blocked.is_set, "the producer blocked in the source")
    finally:
        source.release.set()


def epoch_after_a_stuck_producer(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    # As a DataLoader with workers whose producer stays in the worker queue's poll: here a
    # producer blocked in the dataset itself, deterministically (the release is never set
    # before the next epoch starts).
    monkeypatch.setattr(EpochSource, "independent_epochs", lambda self: True)
    data = Blocking(8)
    p = entry(DataLoader(data, batch_size=2), "cpu", timeout=2.0)  # only sample 5 takes this long
    try:
        with pytest.raises(PrefetchTimeoutError):
            list(p)
        next(iter(p))  # <- warns
    finally:
        data.release.set()
        p.close()


def one_shot_exhausted(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    p = entry(iter([torch.tensor(0)]), "cpu")
    list(p)
    list(p)  # <- warns


def state_for_epoch_1(entry: Entry, loader: DataLoader[Any]) -> dict[str, Any]:
    p = entry(loader, "cpu")
    p.set_epoch(1)
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    return state


def set_epoch_drops_a_loaded_state(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_for_epoch_1(entry, numbers())
    p = entry(numbers(), "cpu")
    p.load_state_dict(state)
    p.set_epoch(4)  # <- warns


def lightning_fetched_ahead(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning over a stateful loader without a length, its state read in the user's hook."""
    lightning: Any = pytest.importorskip("lightning")

    class Stream:
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter([torch.ones(2, 1)] * 4)

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    class Model(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch).sum()
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                p.state_dict()  # <- warns

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    p = entry(Stream(), "cpu")
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # its advice on loaders, here
        trainer.fit(Model(), p)
    p.close()


def sampler_set_epoch_drops_a_loaded_state(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    def loader() -> DataLoader[int]:
        data = as_dataset(list(range(8)))
        sampler: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=False
        )
        return DataLoader(data, batch_size=2, sampler=sampler)

    state = state_for_epoch_1(entry, loader())
    with entry(loader(), "cpu") as p:
        p.load_state_dict(state)
        p.sampler.set_epoch(5)  # as Lightning does
        next(iter(p))  # <- warns


@dataclass(frozen=True)
class Row:
    """One warning: the user's steps that raise it, and its category and text."""

    run: Run
    category: type[Warning]
    match: str


ROWS = {
    "local-rank-guess": Row(local_rank_guess, UserWarning, r"from LOCAL_RANK=3"),
    "workers-restarted": Row(workers_restarted, UserWarning, "persistent_workers=True"),
    "unreadable-set-epoch": Row(unreadable_set_epoch, UserWarning, "no readable 'epoch'"),
    "unsharded": Row(unsharded, UserWarning, "no DistributedSampler"),
    "accelerate": Row(unprepared_under_accelerate, UserWarning, "was not prepared by it"),
    "webdataset-shuffle": Row(unseeded_webdataset_shuffle, UserWarning, "shuffles with"),
    "stateful-generator": Row(stateful_loader_generator, UserWarning, "its generator="),
    "iterable-dataset": Row(iterable_dataset_without_state, UserWarning, "without state_dict"),
    "worker-init-fn": Row(worker_init_fn_not_called, UserWarning, "is not called"),
    "global-draws": Row(global_draws, GlobalDrawsWarning, "torch's global generator"),
    "unpinnable": Row(unpinnable_objects, UserWarning, "no .pin_memory()"),
    "hidden-tensors": Row(hidden_tensors, UserWarning, "nostall cannot find"),
    "close-stuck": Row(close_while_stuck, RuntimeWarning, "after close"),
    "with-stuck": Row(with_block_ends_while_stuck, RuntimeWarning, "after close"),
    "stuck-producer": Row(epoch_after_a_stuck_producer, RuntimeWarning, "new iterator"),
    "one-shot": Row(one_shot_exhausted, UserWarning, "one-shot iterator that is exhausted"),
    "set-epoch": Row(set_epoch_drops_a_loaded_state, UserWarning, "state is dropped"),
    "sampler-epoch": Row(sampler_set_epoch_drops_a_loaded_state, UserWarning, "state is dropped"),
    "lightning-ahead": Row(lightning_fetched_ahead, UserWarning, "fetched ahead of its step"),
}


def raised(
    run: Callable[[], object], category: type[Warning], match: str
) -> warnings.WarningMessage:
    """Run ``run``; return the one warning of ``category`` matching ``match`` it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    ours = [w for w in caught if w.category is category and re.search(match, str(w.message))]
    assert 1 == len(ours), f"{len(ours)} warnings matched {match!r}: {caught}"
    return ours[0]


@pytest.mark.parametrize("entry", list(ENTRIES.values()), ids=list(ENTRIES))
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_each_warning_names_the_users_line(
    row: Row, entry: Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warning names this file, at the line marked in its row."""
    seen = raised(lambda: row.run(entry, monkeypatch), row.category, row.match)
    where = f"named {seen.filename}:{seen.lineno}"
    assert __file__ == seen.filename, where
    assert MARK in linecache.getline(__file__, seen.lineno), where


def test_a_warning_in_a_loading_thread_names_nostalls_line() -> None:
    """No user frame in a thread nostall started: the line in nostall that raised it."""
    loader = DataLoader(as_dataset(list(range(24))), batch_size=4)
    p = nostall.prefetch(loader, "cpu", threads=2, timeout=30)  # a timeout: loaded in threads
    with refused_thread_starts("nostall-load-1"):
        seen = raised(lambda: list(p), RuntimeWarning, "could not start loading thread")
    assert _pool.__file__ == seen.filename
    p.close()
    assert [] == wait_for_no_nostall_threads(timeout=10)


def test_warn_outside_nostall_names_its_callers_line() -> None:
    """Called from user code, the helper names that line."""
    with pytest.warns(UserWarning, match="hello") as caught:
        warn("hello")  # <- warns
    assert MARK in linecache.getline(caught[0].filename, caught[0].lineno)


def test_every_warning_in_nostall_goes_through_warn() -> None:
    """No ``warnings.warn`` in src/nostall but the helper's own: nothing counts stacklevel."""
    calls = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "warn"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "warnings"
            ):
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert ["_warn.py"] == sorted({c.split(":")[0] for c in calls}), calls
