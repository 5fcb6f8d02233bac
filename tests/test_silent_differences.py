"""Where a framework's loop over nostall differs from the same loop without it (open defects).

Found by running users' loops twice, without nostall and with it, and comparing what the model
received. Each test states what the plain loop gives; each is ``xfail(strict=True)`` until the
difference is fixed (or turned into an error or a warning naming the fix).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from helpers import wait_until
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SubsetRandomSampler,
    get_worker_info,
)

import nostall

ITEMS = 10  # batches of 3: 3, 3, 3 and 1
BATCH = 3


class Stream(IterableDataset[torch.Tensor]):
    """Items 0..9 in order; ``finished`` once an iteration ran to its end."""

    def __init__(self) -> None:
        self.finished = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(ITEMS):
            yield torch.tensor([float(i)])
        self.finished = True


# -- accelerate's DataLoaderDispatcher on one process ------------------------------------------


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """A fresh accelerate: its Accelerator and GradientState are process-wide singletons."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def dispatcher(stream: Stream, stateful: bool) -> tuple[Any, Any]:
    """An Accelerator and what its ``prepare`` makes of a loader over ``stream``.

    On one process accelerate prepares a loader over an ``IterableDataset`` as a
    ``DataLoaderDispatcher`` by default, as Trainer's does over a streaming train set.
    """
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderDispatcher
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(stream, batch_size=BATCH))
    assert isinstance(loader, DataLoaderDispatcher)
    return accelerator, loader


@pytest.mark.usefixtures("accelerate_state")
def test_a_dispatcher_over_a_stream_gives_its_batches() -> None:
    """Without use_stateful_dataloader its state_dict() raises: nostall must never call it."""
    _, loader = dispatcher(Stream(), stateful=False)
    expected = [b.clone() for b in loader]
    seen = [b.clone() for b in nostall.prefetch(loader)]
    assert [b.tolist() for b in expected] == [b.tolist() for b in seen]


@pytest.mark.usefixtures("accelerate_state")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_stateful_dispatcher_keeps_the_end_of_the_data_for_its_last_batch() -> None:
    """The producer's pulls move a shadow's end flag; the real one moves at hand-out.

    Else accelerator.accumulate() would sync and step at the wrong micro-batch, silently.
    """
    pytest.importorskip("torchdata.stateful_dataloader")  # accelerate's stateful loader's
    stream = Stream()
    accelerator, loader = dispatcher(stream, stateful=True)
    with nostall.prefetch(loader) as prefetcher:
        batches = iter(prefetcher)
        next(batches), next(batches)  # 2 of 4: the plain dispatcher's end_of_dataloader is False
        wait_until(lambda: stream.finished, "pulled to the stream's end by the producer")
        # The dispatcher marks the end right after its source ended; a correct program never
        # does before the last batch is handed out, and only waits.
        deadline = time.monotonic() + 0.5
        while not accelerator.gradient_state.end_of_dataloader and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not accelerator.gradient_state.end_of_dataloader
        assert 2 == len(list(batches))


# -- across_epochs: an epoch opened after the last one ------------------------------------------


class Counted(Dataset[int]):
    """Twenty numbers; counts the samples loaded."""

    def __init__(self) -> None:
        self.loads = 0

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        self.loads += 1
        return i


def opened_ahead(batches: nostall.Prefetcher[Any]) -> None:
    """Wait until the producer has begun opening the next epoch, ahead of the loop.

    As in training, where validation or a checkpoint follows each epoch: the producer opens the
    next one meanwhile. (An epoch it has not begun to open when the loop starts it again is
    opened at that pass's first pull, with nothing of the loop's running: not ahead.)
    """

    def opening() -> bool:
        ahead = batches._lineage._ahead
        return ahead is not None and (ahead.batches is not None or ahead.epoch in ahead.open_marks)

    wait_until(opening, "the producer to open the next epoch ahead")


def two_epochs_opened_ahead(batches: nostall.Prefetcher[Any]) -> None:
    """Two epochs, the second opened ahead while the loop's own code runs after the first."""
    for epoch in range(2):
        for _ in batches:  # <- warns in the second: it was opened ahead
            pass
        if not epoch:
            opened_ahead(batches)


def test_an_epoch_opened_ahead_from_the_global_generator_is_warned_of() -> None:
    """across_epochs=True over an unseeded loader: warned at the loop's line, with the fix.

    The producer opens each next epoch in its thread, drawing the order and the workers' base
    seed from torch's global generator at a moment that depends on the threads (after the
    last epoch too): what the step draws around the epoch's end no longer matches a plain loop.
    """
    batches = nostall.prefetch(
        DataLoader(Counted(), batch_size=4, shuffle=True), across_epochs=True
    )

    with pytest.warns(UserWarning, match=r"generator=torch\.Generator\(\)") as caught:
        two_epochs_opened_ahead(batches)
    batches.close()
    ours = [w for w in caught if "opened this epoch ahead" in str(w.message)]
    assert [__file__] == [w.filename for w in ours]


def test_a_seeded_loader_draws_nothing_from_the_global_generator_after_the_last_epoch() -> None:
    """With the fix (its own generator), the epochs opened ahead leave torch's generator alone."""

    def loader(dataset: Dataset[int]) -> DataLoader[int]:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=generator)

    torch.manual_seed(0)
    for _ in range(2):
        for _ in loader(Counted()):
            pass
    expected = torch.get_rng_state()

    torch.manual_seed(0)
    dataset = Counted()
    batches = nostall.prefetch(loader(dataset), across_epochs=True)
    for _ in range(2):
        for _ in batches:
            pass
    # The producer opens a third epoch after the loop: wait until it has loaded from it.
    deadline = time.monotonic() + 30.0
    while dataset.loads <= 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataset.loads > 40, "the producer never opened the epoch after the last"
    later = torch.get_rng_state()
    batches.close()
    assert torch.equal(expected, later)


# -- a mid-epoch resume over samples drawn from torch's global generator ---------------------------


class NoisyRows(Dataset[torch.Tensor]):
    """Row i is i plus a draw from torch's global generator (an augmentation, num_workers=0)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


class NoisyStream(IterableDataset[torch.Tensor]):
    """The same rows as a stream."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(12):
            yield torch.tensor([float(i)]) + torch.rand(1)


@pytest.mark.filterwarnings("ignore::nostall._sources.global_draws.GlobalDrawsWarning")
@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "iterable"])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew(stream: bool) -> None:
    def loader() -> DataLoader[torch.Tensor]:
        return DataLoader(NoisyStream() if stream else NoisyRows(), batch_size=3)

    torch.manual_seed(0)
    uninterrupted = nostall.prefetch(loader())
    seen = []
    for epoch in range(2):
        for k, batch in enumerate(uninterrupted):
            seen.append(batch.flatten().tolist())
            if (epoch, k) == (1, 1):
                state, rng = uninterrupted.state_dict(), torch.get_rng_state()
    uninterrupted.close()

    torch.manual_seed(99)  # a fresh process
    resumed = nostall.prefetch(loader())
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # the training checkpoint restores it
    rest = [batch.flatten().tolist() for batch in resumed]
    resumed.close()
    assert seen[6:] == rest


# -- Lightning Fabric: the threads route under fabric.seed_everything ----------------------------


class Drawing(IterableDataset[torch.Tensor]):
    """A shard reader split by worker, each item augmented from the loading worker's generator."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        generator = torch.thread_safe_generator()  # None in a worker process: its global one
        for i in range(worker, 8, workers):
            yield torch.rand(2, generator=generator) + i


#: Drawing's draws need torch.thread_safe_generator() (torch 2.11 has none).
needs_thread_safe_generator = pytest.mark.skipif(
    not hasattr(torch, "thread_safe_generator"),
    reason=f"torch {torch.__version__} has no torch.thread_safe_generator()",
)


@needs_thread_safe_generator
@pytest.mark.filterwarnings("ignore:The dataloader, .*, does not have many workers")
def test_fabric_threads_draw_what_fabrics_worker_processes_draw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    # seed_everything exports these; monkeypatch puts them back as they were after the test.
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0, verbose=False)
    loader = DataLoader(Drawing(), batch_size=2, num_workers=2)
    torch.manual_seed(0)  # the epoch's base seed comes from torch's global generator
    fabric_loader = cast("DataLoader[torch.Tensor]", fabric.setup_dataloaders(loader))
    expected = [b.clone() for b in fabric_loader]

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = nostall.prefetch(DataLoader(Drawing(), batch_size=2), fabric.device, threads=2)
        seen = [b.clone() for b in batches]
    warned = any("nostall" in str(w.message) for w in caught)
    assert warned or all(torch.equal(e, s) for e, s in zip(expected, seen, strict=True))


@needs_thread_safe_generator
def test_a_worker_init_fn_lightning_adds_after_prefetch_is_warned_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn

    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # what seed_everything(workers=True) exports
    loader = DataLoader(Drawing(), batch_size=2)
    batches = nostall.prefetch(loader, threads=2)
    _auto_add_worker_init_fn(batches, 0)  # Lightning's data connector, given the train loader
    assert loader.worker_init_fn is not None
    with pytest.warns(UserWarning, match="worker_init_fn"):
        list(batches)


def test_an_unseeded_subset_sampler_opened_ahead_is_warned_of() -> None:
    """Any of torch's random samplers without a generator draws from torch's at iter()."""
    generator = torch.Generator().manual_seed(0)
    sampler = SubsetRandomSampler(range(8))  # no generator: torch's global one
    loader = DataLoader(Counted(), batch_size=2, sampler=sampler, generator=generator)
    batches = nostall.prefetch(loader, across_epochs=True)

    with pytest.warns(UserWarning, match="opened this epoch ahead"):
        two_epochs_opened_ahead(batches)
    batches.close()


def test_a_seeded_loader_with_a_sequential_sampler_is_not_warned_of() -> None:
    """Nothing is drawn from torch's generator there: the epochs opened ahead are exact."""
    loader = DataLoader(Counted(), batch_size=4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nostall.prefetch(loader, across_epochs=True) as batches:
            for _ in range(3):
                for _ in batches:
                    pass
    assert [] == [str(w.message) for w in caught if "opened this epoch ahead" in str(w.message)]


def test_a_distributed_sampler_opened_ahead_is_said_to_draw_only_the_base_seed() -> None:
    """Its order comes from its own seed: the warning says only the base seed was drawn."""
    sampler: DistributedSampler[int] = DistributedSampler(Counted(), num_replicas=1, rank=0, seed=0)
    batches = nostall.prefetch(
        DataLoader(Counted(), batch_size=4, sampler=sampler), across_epochs=True
    )

    with pytest.warns(UserWarning, match="opened this epoch ahead|never set") as caught:
        two_epochs_opened_ahead(batches)  # also said: the loop never sets the epoch
    batches.close()
    message = next(str(w.message) for w in caught if "opened this epoch ahead" in str(w.message))
    assert "drew its base seed (for its workers' seeds) from torch's" in message
    assert "its order" not in message


def distributed(shuffle: bool = True) -> DataLoader[int]:
    """One rank of one: a DistributedSampler without a process group."""
    sampler: DistributedSampler[int] = DistributedSampler(
        Counted(), num_replicas=1, rank=0, shuffle=shuffle, seed=0
    )
    return DataLoader(Counted(), batch_size=5, sampler=sampler)


def orders(batches: Any, epochs: int, set_epoch: bool = False) -> list[list[int]]:
    seen = []
    for epoch in range(epochs):
        if set_epoch:
            batches.set_epoch(epoch)
        seen.append([int(x) for batch in batches for x in batch])
    return seen


def test_a_distributed_sampler_never_set_to_a_new_epoch_is_warned_of_once() -> None:
    """Every epoch repeats the first's order, as a plain DataLoader does: said, with the fix."""
    plain = orders(distributed(), 3)
    assert plain[0] == plain[1] == plain[2]  # the silent difference a user does not see
    batches = nostall.prefetch(distributed())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plain == orders(batches, 3)
    said = [w for w in caught if "set_epoch() was not called" in str(w.message)]
    assert 1 == len(said), [str(w.message) for w in caught]
    assert "prefetcher.set_epoch(epoch)" in str(said[0].message)
    assert __file__ == said[0].filename  # at the user's line


@pytest.mark.parametrize("how", ["set_epoch", "across_epochs", "no shuffle"])
def test_a_distributed_sampler_set_each_epoch_is_not_warned_of(how: str) -> None:
    loader = distributed(shuffle=how != "no shuffle")
    batches = nostall.prefetch(loader, across_epochs=how == "across_epochs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = orders(batches, 3, set_epoch=how == "set_epoch")
    batches.close()
    assert [] == [str(w.message) for w in caught if "set_epoch() was not called" in str(w.message)]
    assert (seen[0] != seen[1]) == (how != "no shuffle")


@pytest.mark.parametrize("shuffle", [True, False])
def test_across_epochs_setting_an_epoch_the_loop_never_sets_is_said_once(shuffle: bool) -> None:
    """Counted by nostall, each epoch gets a new order, where the plain loop repeats one: said.

    Once, at the user's line, as the loop starts the first such epoch (epoch 1); nothing is
    lost when it is raised as an error. Not for a sampler whose order ignores the epoch.
    """
    plain = orders(distributed(shuffle), 3)
    batches = nostall.prefetch(distributed(shuffle), across_epochs=True)
    first = orders(batches, 1)
    if shuffle:
        with pytest.raises(UserWarning, match="your loop never set the epoch") as raised:
            iter(batches).__next__()
        assert "prefetcher.set_epoch(epoch)" in str(raised.value)
        assert "across_epochs=False" in str(raised.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = orders(batches, 2)
    batches.close()
    assert [] == [str(w.message) for w in caught if "never set the epoch" in str(w.message)]
    assert first[0] == plain[0]
    assert (rest[0] != plain[1]) == shuffle  # the difference said


def test_across_epochs_under_a_loop_that_takes_len_batches_is_said_too() -> None:
    """A loop that never asks for an epoch's end (Lightning's way) and never sets the epoch."""
    loader = distributed()
    batches = nostall.prefetch(loader, across_epochs=True)
    it = iter(batches)
    [next(it) for _ in range(len(batches))]
    with pytest.raises(UserWarning, match="your loop never set the epoch"):
        next(iter(batches))
    it = iter(batches)
    rest = [next(it) for _ in range(len(batches))]  # said once: the epoch goes on
    batches.close()
    assert len(rest) == len(batches)
    assert type(loader.sampler.epoch) is int  # type: ignore[attr-defined]  # no mark left


@pytest.mark.parametrize("how", ["prefetcher", "sampler"])
def test_across_epochs_with_a_loop_that_sets_the_epoch_says_nothing(how: str) -> None:
    """A loop that sets each epoch asked for the orders nostall draws: nothing to say.

    On the prefetcher, or on the sampler as Ignite's handler and Lightning do.
    """
    loader = distributed()
    plain = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        plain.append([int(x) for batch in loader for x in batch])
    loader = distributed()
    batches = nostall.prefetch(loader, across_epochs=True)
    seen = []
    for epoch in range(3):  # warnings are errors here
        (batches if how == "prefetcher" else loader.sampler).set_epoch(epoch)  # type: ignore[attr-defined]
        seen.append([int(x) for batch in batches for x in batch])
    batches.close()
    assert plain == seen


def test_across_epochs_with_the_epoch_set_before_the_last_end_is_taken_says_nothing() -> None:
    """Ignite's order: its handler sets the next epoch, then the loop asks for the last end.

    An ``Engine`` takes ``len()`` batches per epoch; at the next epoch's start its
    ``EPOCH_STARTED`` handler sets the sampler's epoch, and only then does its ``next()`` get
    the previous epoch's end, where nostall sets the same epoch: the loop asked for it.
    """
    loader = distributed()
    batches = nostall.prefetch(loader, across_epochs=True)
    it, seen = iter(batches), []
    for epoch in range(3):  # warnings are errors here
        if epoch:
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            with pytest.raises(StopIteration):
                next(it)  # the last epoch's end, asked for after the handler ran
            it = iter(batches)
        seen.append([int(x) for _ in range(len(batches)) for x in next(it)])
    batches.close()
    assert seen[0] != seen[1] != seen[2]


class Shard(torch.utils.data.BatchSampler):
    """A BatchSampler subclass without ``.sampler``, as accelerate's shards are."""

    def __init__(self, inner: torch.utils.data.BatchSampler) -> None:
        self.inner = inner  # no super().__init__: no .sampler, no .batch_size

    def __iter__(self) -> Any:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def test_a_batch_sampler_without_a_sampler_attribute_is_looked_past() -> None:
    """The check reads the DataLoader's own sampler then: no AttributeError, no warning."""
    inner = torch.utils.data.BatchSampler(range(len(Counted())), batch_size=5, drop_last=False)
    loader = DataLoader(Counted(), batch_sampler=Shard(inner))
    batches = nostall.prefetch(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert orders(loader, 2) == orders(batches, 2)
    batches.close()
    assert [] == [str(w.message) for w in caught if "set_epoch() was not called" in str(w.message)]


def _said_same_epoch(run: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "set_epoch() was not called" in str(w.message)]


def test_a_batch_peeked_before_training_is_not_taken_for_an_epoch() -> None:
    """next(iter(p)) to look at a batch, then set_epoch before each epoch: nothing to say."""
    batches = nostall.prefetch(distributed())

    def run() -> None:
        next(iter(batches))
        orders(batches, 3, set_epoch=True)

    assert [] == _said_same_epoch(run)
    batches.close()


def test_a_state_loaded_again_in_the_same_run_is_not_taken_for_a_repeat() -> None:
    """Saved at an epoch's end and loaded back (a rollback): the epochs before are forgotten."""
    batches = nostall.prefetch(distributed())

    def run() -> None:
        for epoch in range(3):
            batches.set_epoch(epoch)
            for _ in batches:
                pass
            if epoch == 1:
                batches.load_state_dict(batches.state_dict())

    assert [] == _said_same_epoch(run)
    batches.close()


class SetsTheEpochLazily(DataLoader[int]):
    """Sets its sampler's epoch at the first next() (a generator __iter__, as accelerate's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epochs_started = 0

    def __iter__(self) -> Any:
        time.sleep(0.05)  # later than the loop's open: the producer runs this
        sampler = self.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(self.epochs_started)
        self.epochs_started += 1
        yield from super().__iter__()


def test_a_loader_that_sets_its_epoch_at_its_first_batch_is_not_warned_of() -> None:
    """The epoch is read as the order was drawn, not as the epoch was opened."""
    sampler: DistributedSampler[int] = DistributedSampler(Counted(), num_replicas=1, rank=0, seed=0)
    loader = SetsTheEpochLazily(Counted(), batch_size=5, sampler=sampler)
    batches = nostall.prefetch(loader)
    seen: list[list[int]] = []
    assert [] == _said_same_epoch(lambda: seen.extend(orders(batches, 3)))
    batches.close()
    assert seen[0] != seen[1]  # it did shuffle each epoch anew
