"""Epochs without seams (across_epochs), set_epoch, and resumable mid-epoch state."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import (
    CountingSource,
    HiddenEpoch,
    OneBadSample,
    as_dataset,
    nostall_threads,
    settle,
    wait_for_no_nostall_threads,
    wait_until,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

import nostall

Batches = list[list[int]]


def ran_ahead(it: Any, handed_out: int) -> bool:
    """The iteration's producer fetched batches beyond those handed out (or had none left)."""
    puller = it._puller
    return puller is None or puller.finished or puller.pulled > handed_out


class Indices(Dataset[int]):
    """Item i is i; counts every load, so that skipped samples show."""

    def __init__(self, n: int = 48) -> None:
        self.n = n
        self.loads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loads += 1
        return i


class Stream(IterableDataset[int]):
    """An iterable-style dataset of 0..n-1."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def distributed_loader(workers: int = 0, **kwargs: Any) -> DataLoader[int]:
    sampler: DistributedSampler[int] = DistributedSampler(
        Indices(), num_replicas=2, rank=1, shuffle=True, seed=5
    )
    return DataLoader(sampler.dataset, batch_size=3, sampler=sampler, num_workers=workers, **kwargs)


def seeded_loader(workers: int = 0, **kwargs: Any) -> DataLoader[int]:
    return DataLoader(
        Indices(),
        batch_size=3,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(11),
        **kwargs,
    )


def plain_loader(workers: int = 0, **kwargs: Any) -> DataLoader[int]:
    return DataLoader(Indices(), batch_size=3, num_workers=workers, **kwargs)


def epoch_lists(batches: Any) -> list[int]:
    return [int(x) for batch in batches for x in batch]


def reference_orders(make: Callable[[], DataLoader[int]], epochs: int) -> list[list[int]]:
    """The plain loop: sampler.set_epoch(e) each epoch, no nostall."""
    loader = make()
    out = []
    for e in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(e)
        out.append(epoch_lists(loader))
    return out


class _RepeatSampler(Sampler[Any]):
    """The seed documents' trick: a batch sampler that never ends."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from iter(self.sampler)


class MultiEpochsDataLoader(DataLoader[Any]):
    """The seed documents' MultiEpochsDataLoader, written here as a test fixture.

    One iterator for the whole run, so worker processes are never restarted; each epoch takes
    ``len(self)`` batches from it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "batch_sampler", _RepeatSampler(self.batch_sampler))
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        assert isinstance(self.batch_sampler, _RepeatSampler)
        return len(self.batch_sampler.sampler)

    # One generator over the endless iterator, not torch's per-epoch iterator type: the
    # fixture as its users write it.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for _ in range(len(self)):
            yield next(self.iterator)


def repeat_sampler_orders(epochs: int) -> list[list[int]]:
    """What the seed pattern delivers with workers, set_epoch(e) called before each epoch."""
    sampler: DistributedSampler[int] = DistributedSampler(
        Indices(), num_replicas=2, rank=1, shuffle=True, seed=5
    )
    loader = MultiEpochsDataLoader(sampler.dataset, batch_size=3, sampler=sampler, num_workers=2)
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)  # too late: the endless iterator drew this epoch's order already
        out.append(epoch_lists(loader))
    return out


# -- the seed defect, proven and fixed -----------------------------------------------------------


def test_repeat_sampler_pattern_repeats_the_first_order() -> None:
    """The seed's _RepeatSampler ignores set_epoch: every epoch has epoch 0's order."""
    reference = reference_orders(distributed_loader, 3)
    assert reference[0] != reference[1]  # set_epoch does change the order in a plain loop
    seed = repeat_sampler_orders(3)
    assert reference[0] == seed[0]
    assert reference[0] == seed[1]  # epoch 1 repeats epoch 0's order
    assert reference[1] != seed[1]


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_sampler_order_per_epoch(across: bool, workers: int) -> None:
    """Each epoch through nostall equals the plain loop with set_epoch(e)."""
    reference = reference_orders(
        lambda: distributed_loader(workers, persistent_workers=bool(workers)), 3
    )
    p = nostall.prefetch(
        distributed_loader(workers, persistent_workers=bool(workers)), "cpu", across_epochs=across
    )
    for e in range(3):
        p.set_epoch(e)
        assert reference[e] == epoch_lists(p)
    p.close()


def test_across_epochs_advances_set_epoch_by_itself() -> None:
    """Without set_epoch calls, across_epochs still gives each epoch its own order."""
    reference = reference_orders(distributed_loader, 3)
    p = nostall.prefetch(distributed_loader(), "cpu", across_epochs=True)
    with pytest.warns(UserWarning, match="your loop never set the epoch"):
        assert reference == [epoch_lists(p) for _ in range(3)]
    assert 3 == p.epoch
    p.close()


# -- across_epochs: the pipeline stays full --------------------------------------------------------


def test_next_epoch_is_fetched_before_the_consumer_asks() -> None:
    """When epoch 0 ends, epoch 1's first batches are pulled without waiting for iter()."""
    source = CountingSource(5)
    p = nostall.prefetch(source, "cpu", depth=3, across_epochs=True)
    assert list(range(5)) == [int(t) for t in p]
    wait_until(lambda: source.iters == 2 and source.pulled >= 5 + 3, "epoch 1 started ahead")
    settle()
    assert 5 + 3 == source.pulled  # its first batches, no more than depth
    assert list(range(5)) == [int(t) for t in p]
    p.close()


def test_each_iter_yields_exactly_one_epoch() -> None:
    """across_epochs never lets one iteration run into the next epoch."""
    p = nostall.prefetch(plain_loader(), "cpu", across_epochs=True)
    for _ in range(3):
        assert list(range(48)) == epoch_lists(p)
    p.close()


def test_set_epoch_matching_the_epoch_ahead_is_a_no_op() -> None:
    """The classic loop calls set_epoch(e) for the epoch already started: nothing is redone."""
    source = CountingSource(4)
    p = nostall.prefetch(source, "cpu", across_epochs=True)
    for e in range(3):
        p.set_epoch(e)
        assert list(range(4)) == [int(t) for t in p]
    assert source.iters in (3, 4)  # one iterator per epoch, plus the one started ahead
    assert 3 * 4 <= source.pulled <= 3 * 4 + 2
    p.close()


def test_set_epoch_to_another_epoch_discards_what_was_fetched_ahead() -> None:
    """Jumping to epoch 5 restarts there; the batches fetched for epoch 1 are dropped."""
    reference = reference_orders(distributed_loader, 6)
    p = nostall.prefetch(distributed_loader(), "cpu", across_epochs=True)
    assert reference[0] == epoch_lists(p)
    p.set_epoch(5)
    assert reference[5] == epoch_lists(p)
    assert 6 == p.epoch
    p.close()


def test_breaking_mid_epoch_with_across_epochs_stops_the_producer() -> None:
    """An abandoned epoch stops its producer; the next iter() starts the next epoch afresh."""
    p = nostall.prefetch(CountingSource(100), "cpu", across_epochs=True)
    for _ in p:
        break
    assert not wait_for_no_nostall_threads(timeout=10)
    assert list(range(100)) == [int(t) for t in p]
    p.close()


def test_dropped_prefetcher_stops_the_producer_running_ahead() -> None:
    """Once nobody can start another epoch, the producer fetching ahead stops."""
    p = nostall.prefetch(CountingSource(5), "cpu", across_epochs=True)
    list(p)
    assert nostall_threads()
    del p
    assert not wait_for_no_nostall_threads(timeout=10)


def test_for_loop_over_a_temporary_prefetcher_with_across_epochs() -> None:
    """``for b in prefetch(..., across_epochs=True)`` finishes its epoch and leaves nothing."""
    assert list(range(6)) == [
        int(t) for t in nostall.prefetch(CountingSource(6), "cpu", across_epochs=True)
    ]
    assert not wait_for_no_nostall_threads(timeout=10)


def test_warns_about_workers_restarted_every_epoch() -> None:
    """A DataLoader with workers but without persistent_workers gets a one-time warning."""
    with pytest.warns(UserWarning, match="persistent_workers=True"):
        p = nostall.prefetch(plain_loader(2), "cpu", across_epochs=True)
    p.close()


def test_bad_across_epochs_and_epoch() -> None:
    """across_epochs is a bool; set_epoch takes an int >= 0."""
    with pytest.raises(TypeError, match=r"across_epochs=\.\.\.\) must be True or False"):
        nostall.prefetch([1], across_epochs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_epoch\(epoch\) takes an int >= 0 \(got epoch=-1"):
        nostall.prefetch([1]).set_epoch(-1)
    with pytest.raises(TypeError, match=r"takes an int >= 0 \(got 1.0, a float"):
        nostall.prefetch([1]).set_epoch(1.0)  # type: ignore[arg-type]


# -- resumable state -------------------------------------------------------------------------------


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Through torch.save and a weights-only torch.load, as a checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def check_resume(
    make: Callable[[], Any],
    *,
    across: bool,
    epochs: int = 2,
    reseed: int | None = None,
    midpoints: tuple[int | str, ...] = (0, 1, 7, "last", "end"),
) -> None:
    """The golden check: save after k batches of epoch e, resume on fresh objects, compare.

    The resumed run must yield exactly the rest of epoch e and then the following epochs of the
    uninterrupted run. "last" saves after the last batch (before the epoch's end is seen),
    "end" after the epoch's end; both are the start of the next epoch. With ``reseed``, the
    global generator is seeded before each original run and set elsewhere before each resumed
    one, so only the state can carry it.
    """
    if reseed is not None:
        torch.manual_seed(reseed)
    p = nostall.prefetch(make(), "cpu", across_epochs=across)
    full = []
    for e in range(epochs):
        p.set_epoch(e)
        full.append([b.tolist() for b in p])
    p.close()
    for e in range(epochs):
        for k in midpoints:
            if reseed is not None:
                torch.manual_seed(reseed)
            p = nostall.prefetch(make(), "cpu", across_epochs=across, depth=3)
            for earlier in range(e):
                p.set_epoch(earlier)
                list(p)
            p.set_epoch(e)
            it = iter(p)
            count = len(full[e]) if k in ("last", "end") else int(k)
            for _ in range(count):
                next(it)
            if k == "end":
                assert [] == list(it)
            state = roundtrip(p.state_dict())
            checkpoint_rng = torch.get_rng_state()  # a training checkpoint saves it too
            p.close()
            # After the last batch the epoch is complete, its end asked for or not (Lightning
            # never asks): the state is the next epoch's start.
            complete = k in ("last", "end")
            assert (e + 1 if complete else e) == state["epoch"]
            assert (0 if complete else count) == state["batches_yielded"]

            if reseed is not None:
                torch.manual_seed(reseed + 1000)
            resumed = nostall.prefetch(make(), "cpu", across_epochs=across)
            resumed.load_state_dict(state)
            torch.set_rng_state(checkpoint_rng)  # ... and restores it on resume
            rest = []
            for later in range(state["epoch"], epochs):
                resumed.set_epoch(later)
                rest.append([b.tolist() for b in resumed])
            resumed.close()
            expected = full[e + 1 :] if complete else [full[e][count:], *full[e + 1 :]]
            assert expected == rest, f"epoch {e}, saved after {k}"


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "make",
    [plain_loader, seeded_loader, distributed_loader],
    ids=["no-shuffle", "seeded-generator", "distributed-sampler"],
)
def test_resume_mid_epoch(
    make: Callable[[int], DataLoader[int]], workers: int, across: bool
) -> None:
    """Midpoints 0, 1, 7, the last batch and the end; workers 0 and 2; across on and off."""
    kwargs = {"persistent_workers": True} if workers and across else {}
    check_resume(lambda: make(workers, **kwargs), across=across)


@pytest.mark.parametrize("across", [False, True])
def test_resume_with_global_random_state(across: bool) -> None:
    """shuffle=True without a generator: the order is drawn from the global generator."""

    def make() -> DataLoader[int]:
        return DataLoader(Indices(), batch_size=3, shuffle=True)

    check_resume(make, across=across, epochs=2, midpoints=(0, 4, "end"), reseed=3)


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_a_stateful_dataloader(workers: int, across: bool) -> None:
    """A source with its own state_dict (torchdata's StatefulDataLoader) is delegated to.

    The resumed run equals what the StatefulDataLoader's own resume gives, from a state saved
    after the same batches, though nostall fetched further ahead. (Its own resume draws the
    following epoch differently from an uninterrupted run: nostall says so when it loads.)
    """
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    def make() -> Any:  # a StatefulDataLoader, imported only when torchdata is there
        return StatefulDataLoader(
            Indices(),
            batch_size=3,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(4),
            persistent_workers=bool(workers),
        )

    uninterrupted = make()
    full = [epoch_lists(uninterrupted), epoch_lists(uninterrupted)]
    for k in (0, 1, 7):
        plain = make()
        it = iter(plain)
        for _ in range(k):
            next(it)
        own = make()
        own.load_state_dict(plain.state_dict())  # at k == 0 too: the state it had then
        expected = [full[0][: 3 * k] + epoch_lists(own), epoch_lists(own)]
        del it, plain, own

        p = nostall.prefetch(make(), "cpu", depth=4, across_epochs=across)
        ours = iter(p)
        for _ in range(k):
            next(ours)
        if workers or k >= 2:  # without workers, two batches come in step (test_global_draws)
            wait_until(functools.partial(ran_ahead, ours, k), "the producer fetched ahead")
        state = roundtrip(p.state_dict())
        p.close()
        resumed = nostall.prefetch(make(), "cpu", across_epochs=across)
        with pytest.warns(UserWarning, match="following epochs draw other orders"):
            resumed.load_state_dict(state)
        got = [full[0][: 3 * k] + epoch_lists(resumed), epoch_lists(resumed)]
        assert expected == got, f"after {k} batches"
        resumed.close()


def test_resume_an_iterable_dataset_by_consuming() -> None:
    """An iterable-style dataset cannot skip through a sampler: its batches are pulled."""
    check_resume(
        lambda: DataLoader(Stream(), batch_size=4), across=False, epochs=1, midpoints=(0, 2, "end")
    )


def test_fast_forward_loads_no_skipped_sample() -> None:
    """Resuming a map-style loader after 5 batches loads only the samples still to come."""
    source = plain_loader()
    p = nostall.prefetch(source, "cpu")
    it = iter(p)
    for _ in range(5):
        next(it)
    state = p.state_dict()
    p.close()
    fresh = plain_loader()
    resumed = nostall.prefetch(fresh, "cpu")
    resumed.load_state_dict(state)
    assert list(range(15, 48)) == epoch_lists(resumed)
    assert 48 - 15 == fresh.dataset.loads  # type: ignore[attr-defined]


def test_state_counts_batches_yielded_not_fetched() -> None:
    """With a deep prefetch queue, the state still says how many batches the user has."""
    p = nostall.prefetch(plain_loader(), "cpu", depth=5)
    it = iter(p)
    next(it)
    next(it)
    wait_until(lambda: it._puller.pulled >= 5, "the producer ran ahead")
    state = p.state_dict()
    assert (0, 2) == (state["epoch"], state["batches_yielded"])
    p.close()


def test_state_of_a_fresh_prefetcher_starts_at_its_epoch() -> None:
    """Before any batch, the state is the start of the current epoch."""
    p = nostall.prefetch(seeded_loader(), "cpu")
    p.set_epoch(3)
    state = p.state_dict()
    assert (3, 0) == (state["epoch"], state["batches_yielded"])


def test_loaded_state_is_returned_until_iterated() -> None:
    """save -> load -> save gives the same position."""
    p = nostall.prefetch(plain_loader(), "cpu")
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    q = nostall.prefetch(plain_loader(), "cpu")
    q.load_state_dict(state)
    assert 1 == q.state_dict()["batches_yielded"]


def test_state_for_another_length_is_refused() -> None:
    """A state saved for 7 batches does not fit a loader of 4."""
    state = nostall.prefetch(plain_loader(), "cpu").state_dict()
    other = nostall.prefetch(DataLoader(Indices(), batch_size=5), "cpu")
    with pytest.raises(ValueError, match="saved for a source of 16 batches, this one has 10"):
        other.load_state_dict(state)


def test_state_for_another_sampler_is_refused() -> None:
    """A state saved with a DistributedSampler does not fit a RandomSampler."""
    state = nostall.prefetch(distributed_loader(), "cpu").state_dict()
    other = nostall.prefetch(DataLoader(Indices(24), batch_size=3, shuffle=True), "cpu")
    with pytest.raises(ValueError, match="saved for samplers"):
        other.load_state_dict(state)


def test_state_from_a_stateful_source_needs_one() -> None:
    """A StatefulDataLoader's state does not fit a plain DataLoader."""
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    p = nostall.prefetch(StatefulDataLoader(Indices(), batch_size=3), "cpu")
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    with pytest.raises(ValueError, match="source here has none"):
        nostall.prefetch(plain_loader(), "cpu").load_state_dict(state)


@pytest.mark.parametrize(
    "bad", [None, {}, {"nostall": 99}, {"nostall": 1, "epoch": -1, "batches_yielded": 0}]
)
def test_garbage_state_is_refused(bad: Any) -> None:
    """Anything that is not a nostall state is a clear ValueError."""
    with pytest.raises(ValueError, match=r"nostall Prefetcher state|must be an int >= 0"):
        nostall.prefetch(plain_loader(), "cpu").load_state_dict(bad)


def test_set_epoch_to_another_epoch_drops_a_loaded_state() -> None:
    """Loading a state for epoch 1 and then asking for epoch 4 warns and starts epoch 4."""
    p = nostall.prefetch(plain_loader(), "cpu")
    p.set_epoch(1)
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    q = nostall.prefetch(plain_loader(), "cpu")
    q.load_state_dict(state)
    with pytest.warns(UserWarning, match="the loaded state is dropped"):
        q.set_epoch(4)
    assert list(range(48)) == epoch_lists(q)


# -- epochs set from outside (Lightning's pattern) ---------------------------------------------


def set_epoch_on(p: Any, loader: DataLoader[int], where: str, epoch: int) -> None:
    """Set the epoch as a user or a framework would: on the prefetcher or on a sampler."""
    if where == "prefetcher":
        p.set_epoch(epoch)
    elif where == "loader.sampler":
        p.sampler.set_epoch(epoch)  # read through to the loader's sampler, as Lightning does
    else:
        p.batch_sampler.sampler.set_epoch(epoch)
    assert loader.sampler is p.sampler


def take(p: Any, how: str) -> list[int]:
    """One epoch: to StopIteration, or exactly len() batches (Lightning's training loop)."""
    if how == "to StopIteration":
        return epoch_lists(p)
    it = iter(p)
    return epoch_lists([next(it) for _ in range(len(p))])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("how", ["to StopIteration", "len() batches"])
@pytest.mark.parametrize("where", ["prefetcher", "loader.sampler", "batch_sampler.sampler"])
def test_epoch_set_anywhere_gives_that_epochs_order(
    where: str, how: str, across: bool, workers: int
) -> None:
    """Every epoch has the order its sampler gives for the epoch set, wherever it was set."""

    def make() -> DataLoader[int]:
        return distributed_loader(workers, persistent_workers=bool(workers))

    reference = reference_orders(make, 4)
    loader = make()
    p = nostall.prefetch(loader, "cpu", across_epochs=across)
    got = []
    for e in range(4):
        set_epoch_on(p, loader, where, e)
        got.append(take(p, how))
    assert reference == got
    # Taking len() batches leaves the last epoch's end untaken until the next iter().
    assert (4 if how == "to StopIteration" else 3) == p.epoch
    p.close()


@pytest.mark.parametrize("across", [False, True])
def test_epoch_set_on_the_sampler_is_followed_by_the_epoch_count(across: bool) -> None:
    """An epoch set on the sampler directly becomes the prefetcher's epoch (and its state's)."""
    loader = distributed_loader()
    p = nostall.prefetch(loader, "cpu", across_epochs=across)
    epoch_lists(p)
    loader.sampler.set_epoch(7)  # type: ignore[attr-defined]
    it = iter(p)
    next(it)
    assert 7 == p.epoch
    assert 7 == p.state_dict()["epoch"]
    p.close()


def test_epoch_changed_on_the_sampler_after_the_next_was_opened_ahead() -> None:
    """Opened ahead with nostall's count, then set elsewhere: the stale order is dropped."""
    reference = reference_orders(distributed_loader, 6)
    loader = distributed_loader()
    p = nostall.prefetch(loader, "cpu", depth=4, across_epochs=True)
    assert reference[0] == epoch_lists(p)  # the producer now runs into epoch 1
    loader.sampler.set_epoch(5)  # type: ignore[attr-defined]
    assert reference[5] == epoch_lists(p)
    assert 6 == p.epoch
    p.close()


def test_stopping_early_does_not_leave_the_next_epoch_drawn() -> None:
    """Leaving an epoch before its last batch never starts the next one with nostall's count."""
    reference = reference_orders(distributed_loader, 3)
    loader = distributed_loader()
    n = len(loader)
    p = nostall.prefetch(loader, "cpu", depth=4, across_epochs=True)
    it = iter(p)
    first = [next(it) for _ in range(n - 2)]  # the producer has the rest of epoch 0 by now
    assert reference[0][: 3 * (n - 2)] == epoch_lists(first)
    wait_until(lambda: p.sampler.epoch == 0 and loader.sampler is p.sampler, "sampler back at 0")
    loader.sampler.set_epoch(1)  # type: ignore[attr-defined]  # as Lightning would
    assert reference[1] == epoch_lists(p)
    p.close()


def test_warns_when_set_epoch_target_shows_no_epoch() -> None:
    """across_epochs cannot see outside set_epoch calls on a sampler without ``epoch``."""
    with pytest.warns(UserWarning, match="no readable 'epoch' attribute"):
        p = nostall.prefetch(
            DataLoader(Indices(4), sampler=HiddenEpoch()), "cpu", across_epochs=True
        )
    p.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_the_start_of_an_epoch_set_on_a_distributed_sampler(workers: int) -> None:
    """A state saved after set_epoch(1), before any batch, resumes into epoch 1's order."""

    def make() -> DataLoader[int]:
        return distributed_loader(workers, persistent_workers=bool(workers))

    reference = reference_orders(make, 2)
    p = nostall.prefetch(make(), "cpu")
    epoch_lists(p)
    p.set_epoch(1)
    state = roundtrip(p.state_dict())
    p.close()
    resumed = nostall.prefetch(make(), "cpu")
    resumed.load_state_dict(state)
    assert reference[1] == epoch_lists(resumed)
    resumed.close()


def test_stateful_dataloader_state_before_the_first_batch_is_its_own() -> None:
    """Before any batch, the state still holds the source's state_dict(), and resumes by it.

    (A fresh StatefulDataLoader's state holds the seed its shuffle will use, so the resumed
    process draws the same order though its global generator is elsewhere.)
    """
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    def make() -> Any:  # a StatefulDataLoader, imported only when torchdata is there
        return StatefulDataLoader(Indices(12), batch_size=3, shuffle=True)

    torch.manual_seed(3)
    p = nostall.prefetch(make(), "cpu")
    state = roundtrip(p.state_dict())
    assert state["source_state"] is not None
    expected = epoch_lists(p)  # what the uninterrupted run does next
    p.close()
    torch.manual_seed(99)  # another process, another global random state
    resumed = nostall.prefetch(make(), "cpu")
    resumed.load_state_dict(state)
    assert expected == epoch_lists(resumed)
    resumed.close()


def test_stateful_iterable_dataset_resume_warns() -> None:
    """An IterableDataset without state_dict is resumed by re-reading it: nostall says so."""
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    p = nostall.prefetch(StatefulDataLoader(Stream(), batch_size=2), "cpu")
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    resumed = nostall.prefetch(StatefulDataLoader(Stream(), batch_size=2), "cpu")
    with pytest.warns(UserWarning, match="exact only if the dataset yields the same order"):
        resumed.load_state_dict(state)
    resumed.close()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("batches_yielded", 99, "past the end of an epoch of 16 batches"),
        ("epoch", 1.5, r"state\['epoch'\] must be an int"),
        ("epoch", True, r"state\['epoch'\] must be an int"),
        ("rng", torch.zeros(3, dtype=torch.uint8), r"\['rng'\]\['torch'\] is not a CPU generator"),
        ("rng", "junk", r"state\['replay'\]\['rng'\] must be a dict"),
        ("next_rng", torch.zeros(3, dtype=torch.uint8), r"\['next_rng'\] is not a CPU generator"),
        ("sampler_epoch", -2, "sampler_epoch"),
        ("fresh_iterator", "no", "fresh_iterator"),
    ],
)
def test_impossible_states_are_refused_at_load(field: str, value: Any, match: str) -> None:
    """A damaged state fails in load_state_dict, naming the field, never later in next()."""
    p = nostall.prefetch(seeded_loader(), "cpu")
    it = iter(p)
    next(it)
    state = p.state_dict()
    p.close()
    if field in ("epoch", "batches_yielded"):
        state[field] = value
    elif field == "rng":
        state["replay"]["rng"] = {"torch": value} if isinstance(value, torch.Tensor) else value
    else:
        state["replay"][field] = value
    fresh = nostall.prefetch(seeded_loader(), "cpu")
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    fresh.close()


def test_a_loop_that_asks_for_each_end_gets_the_next_epoch_opened_ahead() -> None:
    """Once the consumer asked for an epoch's end, the next epochs open before it asks again."""
    source = CountingSource(4)
    p = nostall.prefetch(source, "cpu", depth=3, across_epochs=True)
    assert list(range(4)) == [int(t) for t in p]  # asks for the end: a plain for loop
    it = iter(p)
    assert list(range(4)) == [int(next(it)) for _ in range(4)]  # the end not asked for yet
    wait_until(lambda: 3 == source.iters, "epoch 2 opened")  # all the same
    assert [] == list(it)
    assert list(range(4)) == [int(t) for t in p]
    assert 3 == p.epoch
    p.close()


def test_a_framework_that_never_asks_for_the_end_never_exhausts_the_sampler() -> None:
    """Taking len() batches (Lightning) leaves the loader's generator as a plain run leaves it."""
    generator_states = []
    for wrap in (False, True):
        gen = torch.Generator().manual_seed(1)
        loader = DataLoader(Indices(12), batch_size=3, shuffle=True, generator=gen)
        source: Any = nostall.prefetch(loader, "cpu", depth=4) if wrap else loader
        for _ in range(3):
            it = iter(source)
            for _ in range(len(source)):
                next(it)
        generator_states.append(gen.get_state())
        if wrap:
            source.close()
    assert torch.equal(generator_states[0], generator_states[1])


def test_leaving_an_epoch_early_after_the_next_opened_ahead() -> None:
    """The loop leaves epoch 1 early, after epoch 2 was opened ahead, then sets 2 itself.

    Epoch 2's order follows, never epoch 1's again.
    """
    reference = reference_orders(distributed_loader, 3)
    loader = distributed_loader()
    n = len(loader)
    p = nostall.prefetch(loader, "cpu", depth=4, across_epochs=True)
    assert reference[0] == epoch_lists(p)  # asks for the end: epochs now open ahead
    p.set_epoch(1)
    it = iter(p)
    assert reference[1][: 3 * (n - 1)] == epoch_lists([next(it) for _ in range(n - 1)])
    wait_until(lambda: 2 == loader.sampler.epoch, "epoch 2 set")  # type: ignore[attr-defined]
    del it  # the loop left epoch 1 before its last batch
    loader.sampler.set_epoch(2)  # type: ignore[attr-defined]
    assert reference[2] == epoch_lists(p)
    assert 3 == p.epoch
    p.close()


# -- a state saved at an epoch's end ------------------------------------------------------------


def sixteen_loader() -> DataLoader[int]:
    """16 samples in batches of 4, through a one-replica DistributedSampler."""
    data = list(range(16))
    sampler: DistributedSampler[int] = DistributedSampler(
        as_dataset(data), num_replicas=1, rank=0, shuffle=True, seed=3
    )
    return DataLoader(as_dataset(data), batch_size=4, sampler=sampler)


def sixteen_order(epoch: int) -> list[list[int]]:
    loader = sixteen_loader()
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [b.tolist() for b in loader]


def state_at_the_end_of_epoch_1(setter: str, after_end: bool) -> dict[str, Any]:
    """Two epochs, each set by ``setter`` ("prefetcher", "sampler" or "nobody"), then the state.

    Saved after epoch 1's last batch, inside the loop (``after_end`` False), or after the loop
    took the epoch's end.
    """
    batches = nostall.prefetch(sixteen_loader(), "cpu")
    state: dict[str, Any] = {}
    for epoch in range(2):
        if setter == "prefetcher":
            batches.set_epoch(epoch)
        elif setter == "sampler":
            batches.sampler.set_epoch(epoch)  # as Lightning does
        for _ in batches:
            state = batches.state_dict()
    if after_end:
        state = batches.state_dict()
    batches.close()
    assert (2, 0) == (state["epoch"], state["batches_yielded"])
    return roundtrip(state)


@pytest.mark.parametrize("after_end", [False, True], ids=["last-batch", "after-the-end"])
@pytest.mark.parametrize("setter", ["prefetcher", "sampler"])
def test_a_state_at_an_epoch_end_draws_the_epoch_it_names(setter: str, after_end: bool) -> None:
    """Loaded and iterated without set_epoch (as Lightning and Fabric loops are): epoch 2's order.

    The uninterrupted run set each epoch on the DistributedSampler; the state names epoch 2.
    """
    resumed = nostall.prefetch(sixteen_loader(), "cpu")
    resumed.load_state_dict(state_at_the_end_of_epoch_1(setter, after_end))
    assert sixteen_order(2) == [b.tolist() for b in resumed]
    resumed.close()


@pytest.mark.parametrize("after_end", [False, True], ids=["last-batch", "after-the-end"])
def test_a_state_at_an_epoch_end_keeps_a_sampler_epoch_nobody_set(after_end: bool) -> None:
    """Nobody set the sampler's epoch: the uninterrupted run drew epoch 0's order each epoch."""
    resumed = nostall.prefetch(sixteen_loader(), "cpu")
    resumed.load_state_dict(state_at_the_end_of_epoch_1("nobody", after_end))
    assert sixteen_order(0) == [b.tolist() for b in resumed]
    resumed.close()


def test_set_epoch_after_loading_a_state_at_an_epoch_end_still_decides() -> None:
    """The epoch set after load_state_dict wins, as set_epoch before an iteration always does."""
    resumed = nostall.prefetch(sixteen_loader(), "cpu")
    resumed.load_state_dict(state_at_the_end_of_epoch_1("prefetcher", after_end=True))
    resumed.sampler.set_epoch(5)
    with pytest.warns(UserWarning, match="state for epoch 2: the loaded state is dropped"):
        assert sixteen_order(5) == [b.tolist() for b in resumed]
    resumed.close()


# -- the next epoch's order, drawn ahead from the global generator ------------------------------


def global_shuffle(threads: int | None = None) -> Any:
    """A prefetcher across epochs over a loader that shuffles from torch's global generator."""
    loader = DataLoader(Indices(24), batch_size=3, shuffle=True)
    return nostall.prefetch(loader, "cpu", depth=3, across_epochs=True, threads=threads)


def uninterrupted(make: Callable[[], Any], epochs: int, seed: int = 7) -> list[list[int]]:
    """The orders of ``epochs`` epochs of a prefetcher from ``make()``, seeded with ``seed``."""
    torch.manual_seed(seed)
    p = make()
    orders = [epoch_lists(p) for _ in range(epochs)]
    p.close()
    return orders


def wait_for_the_next_epoch_drawn(it: Any, epoch: int) -> None:
    """Wait until ``it``'s producer opened ``epoch`` ahead and pulled its first batch.

    By then it drew that epoch's order (a RandomSampler draws its seed at its first item): a
    state or a checkpoint taken now comes after the draw, as a slow consumer's would.
    """
    wait_until(
        lambda: it._puller.epoch == epoch and it._puller.pulled >= 1, f"epoch {epoch} drawn ahead"
    )


def resume_global_shuffle(
    state: dict[str, Any], checkpoint_rng: torch.Tensor | None, threads: int | None, epochs: int
) -> list[list[int]]:
    """A fresh prefetcher over a fresh loader, seeded otherwise, resumed from ``state``.

    ``checkpoint_rng``: restored after ``load_state_dict`` (the README's checkpoint); None:
    only seeded as the uninterrupted run was.
    """
    torch.manual_seed(7 if checkpoint_rng is None else 99)
    resumed = global_shuffle(threads)
    resumed.load_state_dict(state)
    if checkpoint_rng is not None:
        torch.set_rng_state(checkpoint_rng)
    orders = [epoch_lists(resumed) for _ in range(epochs)]
    resumed.close()
    return orders


@pytest.mark.parametrize("restore", [True, False], ids=["checkpoint-rng", "same-seed"])
@pytest.mark.parametrize("threads", [None, 2])
def test_a_state_after_the_last_batch_draws_the_order_drawn_ahead(
    threads: int | None, restore: bool
) -> None:
    """Saved after epoch 1's last batch, once epoch 2's order was drawn ahead: that order."""
    # The state and the checkpoint's random state come after the producer drew epoch 2's order
    # from torch's generator (forced here; a slow step does the same): the resumed run draws it
    # from the generator as that draw found it, whichever of the two the checkpoint holds.
    full = uninterrupted(lambda: global_shuffle(threads), 3)
    torch.manual_seed(7)
    p = global_shuffle(threads)
    epoch_lists(p)  # epoch 0, its end asked for: epochs now open ahead
    it = iter(p)
    for _ in range(len(p)):
        next(it)
    wait_for_the_next_epoch_drawn(it, 2)
    state = roundtrip(p.state_dict())
    checkpoint_rng = torch.get_rng_state()
    p.close()
    assert (2, 0) == (state["epoch"], state["batches_yielded"])
    assert full[2:] == resume_global_shuffle(state, checkpoint_rng if restore else None, threads, 1)


@pytest.mark.parametrize("threads", [None, 2])
def test_a_state_inside_an_epoch_draws_the_next_order_drawn_ahead(threads: int | None) -> None:
    """Saved one batch before epoch 1's end, once epoch 2's order was drawn ahead: the rest."""
    full = uninterrupted(lambda: global_shuffle(threads), 3)
    torch.manual_seed(7)
    p = global_shuffle(threads)
    epoch_lists(p)
    it = iter(p)
    for _ in range(len(p) - 1):
        next(it)
    wait_for_the_next_epoch_drawn(it, 2)
    state = roundtrip(p.state_dict())
    checkpoint_rng = torch.get_rng_state()
    p.close()
    assert (1, len(p) - 1) == (state["epoch"], state["batches_yielded"])
    rest = resume_global_shuffle(state, checkpoint_rng, threads, 2)
    assert [full[1][-3:], full[2]] == rest


def test_a_state_at_an_epoch_start_leaves_the_step_its_random_numbers() -> None:
    """Resumed at an epoch's start, a step draws the uninterrupted run's random numbers."""
    # The loader has its own generator, so no order is drawn from torch's; the producer pulled
    # epoch 1's end (recording torch's generator) before epoch 1's last step drew from it.

    def make() -> Any:
        loader = seeded_loader()  # its orders come from its own generator
        return nostall.prefetch(loader, "cpu", depth=3, across_epochs=True)

    def steps(p: Any, epochs: int) -> list[tuple[list[int], float]]:
        return [(b.tolist(), torch.rand(()).item()) for _ in range(epochs) for b in p]

    torch.manual_seed(7)
    p = make()
    full = steps(p, 3)
    p.close()
    torch.manual_seed(7)
    p = make()
    steps(p, 1)  # epoch 0, its end asked for: the next ends are pulled ahead
    it = iter(p)
    for i in range(len(p)):
        next(it)
        if i == len(p) - 1:
            wait_for_the_next_epoch_drawn(it, 2)  # epoch 1's end pulled before this step
        torch.rand(())  # each step draws (dropout)
    assert [] == list(it)
    state = roundtrip(p.state_dict())
    checkpoint_rng = torch.get_rng_state()
    p.close()
    torch.manual_seed(99)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(checkpoint_rng)
    rest = steps(resumed, 1)
    resumed.close()
    assert full[2 * len(p) :] == rest


# -- a source whose len() is an estimate ---------------------------------------------------------


class Shares(IterableDataset[int]):
    """0..n-1, each DataLoader worker yielding its own share: len() counts samples, not batches.

    With 14 samples in batches of 2 between 2 workers, each worker yields 7 samples in 4
    batches: the loader yields 8 batches where its len() says 7 (torch calls it an estimate).
    """

    def __init__(self, n: int = 14) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        share = -(-self.n // workers)
        return iter(range(worker * share, min(self.n, (worker + 1) * share)))


def shares_loader() -> DataLoader[int]:
    return DataLoader(Shares(), batch_size=2, num_workers=2)


def state_after(batches: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Two epochs of the plain loader, and a prefetcher's state after ``batches`` of epoch 0."""
    plain = [[b.tolist() for b in shares_loader()] for _ in range(2)]
    assert (7, 8) == (len(shares_loader()), len(plain[0]))
    p = nostall.prefetch(shares_loader(), "cpu")
    it = iter(p)
    for _ in range(batches):
        next(it)
    state = roundtrip(p.state_dict())
    p.close()
    return plain, state


def test_a_state_after_len_batches_of_a_longer_epoch_resumes_its_rest() -> None:
    """Saved after len() = 7 of 8 batches: the resumed run yields the 8th, then epoch 1."""
    plain, state = state_after(7)
    assert (0, 7) == (state["epoch"], state["batches_yielded"])
    resumed = nostall.prefetch(shares_loader(), "cpu")
    resumed.load_state_dict(state)
    rest = [[b.tolist() for b in resumed] for _ in range(2)]
    resumed.close()
    assert [plain[0][7:], plain[1]] == rest


def test_a_state_past_an_estimated_len_is_loaded() -> None:
    """Saved after all 8 batches of an epoch whose len() says 7: loaded, not refused."""
    plain, state = state_after(8)
    resumed = nostall.prefetch(shares_loader(), "cpu", timeout=60)  # never a silent hang
    resumed.load_state_dict(state)
    rest = [[b.tolist() for b in resumed] for _ in range(2)]
    resumed.close()
    assert [[], plain[1]] == rest


# -- a checkpoint saved just before a batch that raises -------------------------------------------


class StreamRaisingAtSix(IterableDataset[int]):
    """The same as a stream: its iterator raises at 6 and goes on after it."""

    def __iter__(self) -> Iterator[int]:
        return _Items()


class _Items:
    def __init__(self) -> None:
        self.i = -1

    def __iter__(self) -> _Items:
        return self

    def __next__(self) -> int:
        self.i += 1
        if self.i >= 12:
            raise StopIteration
        if self.i == 6:
            raise ValueError("sample 6 is corrupt")
        return self.i


def _caught(batches: Any, save_after: list[int] | None = None) -> tuple[list[Any], Any]:
    """An epoch as a loop that catches a batch's error and goes on sees it; the state saved."""
    seen: list[Any] = []
    state = None
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return seen, state
        except ValueError:
            seen.append("error")
            continue
        seen.append(batch.tolist())
        if batch.tolist() == save_after:
            state = roundtrip(batches.state_dict())


@pytest.mark.parametrize("mode", ["map-style", "threads", "stream", "across_epochs"])
def test_a_state_saved_just_before_a_batch_that_raises_resumes_everything_after_it(
    mode: str,
) -> None:
    """The resumed epoch raises that batch's error, then gives the rest, as uninterrupted."""

    def make() -> Any:
        dataset = StreamRaisingAtSix() if mode == "stream" else OneBadSample(12)
        loader = DataLoader(dataset, batch_size=2)
        threads = 2 if mode == "threads" else None
        return nostall.prefetch(
            loader, "cpu", threads=threads, across_epochs=mode == "across_epochs"
        )

    uninterrupted = make()
    seen, state = _caught(uninterrupted, save_after=[4, 5])
    uninterrupted.close()
    # A stream's batch is lost with its error, and the next starts at 7: as a DataLoader's.
    after = [[8, 9], [10, 11]] if mode != "stream" else [[7, 8], [9, 10], [11]]
    assert [[0, 1], [2, 3], [4, 5], "error", *after] == seen
    resumed = make()
    resumed.load_state_dict(state)
    assert ["error", *after] == _caught(resumed)[0]
    resumed.close()
