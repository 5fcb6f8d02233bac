"""Random numbers drawn in a DataLoader's workers: recorded with each batch, resumed exactly."""

from __future__ import annotations

import copy
import multiprocessing
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    LoaderWrapper,
    global_states,
    seed_all,
    set_global_states,
    wait_for_no_nostall_threads,
)
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._sources import worker_draws
from nostall._torch_compat import live_iterator

#: Three workers on a machine with fewer cores: torch's advice, not the test's concern.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

#: Samples per epoch and per batch: 6 batches an epoch, enough for two rounds of 3 workers.
SAMPLES, BATCH, EPOCHS = 12, 2, 3

Checkpoint = tuple[dict[str, Any], tuple[Any, ...]]
#: (epoch, a batch's values, or the message of its error) for each batch, in order.
Batches = list[tuple[int, Any]]


class Drawing(Dataset[torch.Tensor]):
    """Each sample: its index and one draw each from torch, ``random`` and NumPy (a crop, a flip).

    ``fails``: the sample that raises (a damaged file), as a ``ValueError``.
    """

    def __init__(self, draws: bool = True, fails: int | None = None) -> None:
        self.draws, self.fails = draws, fails

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fails:
            raise ValueError(f"sample {i} is damaged")
        if not self.draws:
            return torch.tensor([float(i), 0.0, 0.0, 0.0])
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())]
        )


def numpy_seeded(worker_id: int) -> None:
    """NumPy seeded per worker, as timm's and many training scripts' ``worker_init_fn`` do."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    assert info.id == worker_id
    np.random.seed(info.seed % 2**32)


def loader(
    workers: int = 2, persistent: bool = False, dataset: Dataset[Any] | None = None
) -> DataLoader[torch.Tensor]:
    return DataLoader(
        Drawing() if dataset is None else dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent,
        worker_init_fn=numpy_seeded,
    )


def epoch_batches(batches: Iterator[Any]) -> Iterator[Any]:
    """An epoch's batches, with a batch's error in its place (the loop goes on after it)."""
    while True:
        try:
            yield next(batches)
        except StopIteration:
            return
        except ValueError as e:
            yield str(e)


def run(
    batches: nostall.Prefetcher[Any],
    epochs: range,
    save_at: tuple[int, int] | None = None,
) -> tuple[Batches, Checkpoint | None]:
    """The loop: each epoch set, each batch recorded; a checkpoint after batch ``save_at[1]``.

    ``save_at[1] == -1``: at the epoch's start, once its epoch is set.
    """
    seen: Batches = []
    saved = None
    for epoch in epochs:
        batches.set_epoch(epoch)
        if save_at == (epoch, -1):
            saved = (batches.state_dict(), global_states())
        for i, batch in enumerate(epoch_batches(iter(batches))):
            seen.append((epoch, batch if isinstance(batch, str) else batch.tolist()))
            if (epoch, i) == save_at:
                saved = (batches.state_dict(), global_states())
    return seen, saved


def a_state_inside_a_round() -> Checkpoint:
    """A checkpoint after batch 2 of epoch 0 over 2 workers started each epoch."""
    seed_all(0)
    with nostall.prefetch(loader(2), "cpu") as batches:
        _, saved = run(batches, range(1), (0, 2))
    assert saved is not None
    return saved


def resumed_with_warnings(
    loop: Callable[[nostall.Prefetcher[Any], range], tuple[Batches, Any]], saved: Checkpoint
) -> tuple[Batches, list[warnings.WarningMessage]]:
    """``loop`` resumed from ``saved`` over a fresh persistent loader, and what was warned.

    The warnings are those of ``load_state_dict``.
    """
    seed_all(99)
    with nostall.prefetch(loader(2, persistent=True), "cpu") as batches:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches.load_state_dict(copy.deepcopy(saved[0]))
        set_global_states(saved[1])
        rest, _ = loop(batches, range(batches.epoch, EPOCHS))
    return rest, caught


def resumed(
    make: Callable[[], DataLoader[Any]], saved: Checkpoint, **options: Any
) -> tuple[nostall.Prefetcher[Any], int]:
    """A fresh loader and prefetcher, restored from ``saved`` as a training script does."""
    seed_all(99)  # another start: the checkpoint decides
    batches = nostall.prefetch(make(), "cpu", **options)
    batches.load_state_dict(copy.deepcopy(saved[0]))
    set_global_states(saved[1])
    return batches, batches.epoch


def assert_resumes_exactly(
    make: Callable[[], DataLoader[Any]], save_at: tuple[int, int], **options: Any
) -> None:
    """Uninterrupted (equal to the plain loop), then resumed from ``save_at``: the same batches."""
    seed_all(0)
    plain: Batches = []
    source = make()
    for epoch in range(EPOCHS):
        plain += [
            (epoch, b if isinstance(b, str) else b.tolist()) for b in epoch_batches(iter(source))
        ]
    seed_all(0)
    with nostall.prefetch(make(), "cpu", **options) as batches:
        uninterrupted, saved = run(batches, range(EPOCHS), save_at)
    assert plain == uninterrupted, "nostall's uninterrupted run differs from the plain loop"
    assert saved is not None
    batches, epoch = resumed(make, saved, **options)
    with batches:
        rest, _ = run(batches, range(epoch, EPOCHS))
    expected = uninterrupted[len(uninterrupted) - len(rest) :]
    position = sum(1 for e, _ in uninterrupted if e < save_at[0]) + save_at[1] + 1
    assert len(uninterrupted) - position == len(rest), "the resumed run has another count"
    assert expected == rest, "the resumed run's batches hold other random values"


@pytest.mark.parametrize(
    ("workers", "save_at"),
    [(2, (0, 2)), (2, (1, 3)), (3, (1, 4)), (3, (2, 0))],
    ids=["2-inside-a-round", "2-at-a-round", "3-inside-a-round", "3-first-batch"],
)
def test_a_resume_with_restarted_workers_draws_as_uninterrupted(
    workers: int, save_at: tuple[int, int]
) -> None:
    """The workers start each epoch anew: the state's round, and the batches left in it."""
    assert_resumes_exactly(lambda: loader(workers), save_at)


@pytest.mark.parametrize(
    ("workers", "save_at", "options"),
    [
        (2, (0, 2), {}),
        (2, (1, 3), {}),
        (3, (1, -1), {}),
        (3, (2, 4), {"across_epochs": True}),
    ],
    ids=["first-epoch", "later-epoch", "epoch-start", "across-epochs"],
)
def test_a_resume_with_persistent_workers_draws_as_uninterrupted(
    workers: int, save_at: tuple[int, int], options: dict[str, Any]
) -> None:
    """The workers keep their draws from epoch to epoch: a resumed run's start where they were."""
    assert_resumes_exactly(lambda: loader(workers, persistent=True), save_at, **options)


def test_a_resume_after_a_batch_that_raised_in_a_worker_draws_as_uninterrupted() -> None:
    """A batch's error is a batch handed out: the rounds after it are counted as the loader's.

    (Workers started each epoch: torch takes about 10 s to shut down persistent workers after
    one of them raised, with nostall as without it.)
    """
    assert_resumes_exactly(lambda: loader(2, dataset=Drawing(fails=5)), (1, 4))


def test_without_the_restore_a_resume_draws_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary: resumed workers left at their seeds make the golden check fail."""
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the patched class reaches the workers only where they are forked")

    def seeds_only(self: worker_draws.Restore, worker_id: int) -> None:
        if self.init is not None:
            self.init(worker_id)

    monkeypatch.setattr(worker_draws.Restore, "__call__", seeds_only)
    with pytest.raises(AssertionError, match="other random values"):
        assert_resumes_exactly(lambda: loader(2), (1, 3))


def test_the_loader_keeps_its_own_attributes() -> None:
    """nostall's collate_fn and samplers live in the workers' iterator only, not on the loader."""
    source = loader(2, persistent=True)
    before = {
        name: getattr(source, name)
        for name in ("collate_fn", "worker_init_fn", "batch_sampler", "sampler", "generator")
    }
    with nostall.prefetch(source, "cpu") as batches:
        list(batches)
        saved = batches.state_dict()
        assert live_iterator(source) is not None  # the loader's own workers, kept across epochs
        assert before == {name: getattr(source, name) for name in before}
    again = loader(2, persistent=True)
    kept = {name: getattr(again, name) for name in before}
    with nostall.prefetch(again, "cpu") as batches:
        batches.load_state_dict(saved)
        next(iter(batches))
        assert kept == {name: getattr(again, name) for name in before}
        assert all(isinstance(b, torch.Tensor) for b in batches)  # no stamp reaches the loop


def test_a_state_from_another_worker_count_is_warned_of_at_load() -> None:
    """Its workers' draws cannot be set on other workers: the fix is the count it was saved with."""
    saved = a_state_inside_a_round()
    with (
        nostall.prefetch(loader(3), "cpu") as batches,
        pytest.warns(UserWarning, match=r"2 worker processes.*num_workers=3") as caught,
    ):
        batches.load_state_dict(saved[0])
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.parametrize("draws", [True, False], ids=["draws", "draws-nothing"])
def test_a_wrapper_over_persistent_workers_is_warned_of_where_they_draw(draws: bool) -> None:
    """A loader that a wrapper iterates is not nostall's to record: said at load, with the fix."""

    def make() -> LoaderWrapper:
        return LoaderWrapper(loader(2, persistent=True, dataset=Drawing(draws=draws)))

    seed_all(0)
    with nostall.prefetch(make(), "cpu") as batches:
        _, saved = run(batches, range(2), (1, 2))
    assert saved is not None
    with nostall.prefetch(make(), "cpu") as batches, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches.load_state_dict(saved[0])
    said = [w for w in caught if "persistent_workers=False" in str(w.message)]
    assert [w.filename for w in said] == ([__file__] if draws else [])


def test_a_damaged_record_of_the_workers_is_refused_at_load() -> None:
    """A worker's states that could not be set are named, field and worker."""
    saved = a_state_inside_a_round()
    state = copy.deepcopy(saved[0])
    state["replay"]["worker_draws"]["states"][1] = {"torch": torch.zeros(3)}
    with (
        nostall.prefetch(loader(2), "cpu") as batches,
        pytest.raises(ValueError, match=r"\['worker_draws'\]\['states'\]\[1\]"),
    ):
        batches.load_state_dict(state)


def test_a_state_after_an_epochs_last_batch_resumes_persistent_workers() -> None:
    """Saved after the last batch, the end not asked for: the next epoch, as uninterrupted."""
    assert_resumes_exactly(lambda: loader(2, persistent=True), (1, SAMPLES // BATCH - 1))


@pytest.mark.parametrize("save_at", [(1, 0), (1, 2)], ids=["first-round", "second-round"])
def test_an_epoch_left_early_is_resumed_exactly_or_warned_of(save_at: tuple[int, int]) -> None:
    """Each epoch left after 3 batches (a ``break``): the workers drew for batches never taken.

    The epoch after it cannot be known in its first round (a state there is warned of at
    ``load_state_dict``); from its second round on, each worker's states come with its batch.
    """
    taken = 3

    def run_short(
        batches: nostall.Prefetcher[Any], epochs: range, done: int = 0
    ) -> tuple[Batches, Any]:
        """Each epoch ``taken`` batches (the first, less the ``done`` ones of a resumed epoch)."""
        seen: Batches = []
        saved = None
        for epoch in epochs:
            batches.set_epoch(epoch)
            for i, batch in enumerate(batches, done if epoch == epochs[0] else 0):
                if i >= taken:
                    break
                seen.append((epoch, batch.tolist()))
                if (epoch, i) == save_at:
                    saved = (batches.state_dict(), global_states())
        return seen, saved

    seed_all(0)
    with nostall.prefetch(loader(2, persistent=True), "cpu") as batches:
        uninterrupted, saved = run_short(batches, range(EPOCHS))
    assert saved is not None
    rest, caught = resumed_with_warnings(
        lambda batches, epochs: run_short(batches, epochs, save_at[1] + 1), saved
    )
    warned = [w for w in caught if "persistent_workers=False" in str(w.message)]
    expected = uninterrupted[len(uninterrupted) - len(rest) :]
    if save_at[1] < 2:
        assert [w.filename for w in warned] == [__file__], "a first round after a break: warned"
    else:
        assert not warned
        assert expected == rest, "the resumed run's batches hold other random values"


def test_a_prefetcher_per_epoch_over_one_persistent_loader_gives_its_batches() -> None:
    """Each epoch through a new prefetcher: the loader's batches, as a plain loop over it gets."""
    seed_all(0)
    source = loader(2, persistent=True)
    plain = [b.tolist() for _ in range(EPOCHS) for b in source]
    seed_all(0)
    source = loader(2, persistent=True)
    through = []
    for epoch in range(EPOCHS):
        with nostall.prefetch(source, "cpu") as batches:
            batches.set_epoch(epoch)
            through += [b.tolist() for b in batches]
    assert plain == through


def test_the_loader_itself_gives_its_own_batches_after_nostall() -> None:
    """A loop over the loader itself gets its own batches, whatever nostall left behind."""
    source = loader(2, persistent=True)
    batches = nostall.prefetch(source, "cpu")
    list(batches)  # an epoch to its end: the workers stop stamping
    assert all(type(b) is torch.Tensor for b in source)
    for _ in batches:
        break  # an epoch left early, the prefetcher still open
    assert [] == wait_for_no_nostall_threads()  # its producer let go of the loader
    assert all(type(b) is torch.Tensor for b in source)
    next(iter(batches))  # again, and the prefetcher closed
    batches.close()
    assert all(type(b) is torch.Tensor for b in source)


def test_a_state_loaded_into_the_prefetcher_that_saved_it_resumes_exactly() -> None:
    """Its persistent workers drew past the state: new ones start at the state's."""
    seed_all(0)
    with nostall.prefetch(loader(2, persistent=True), "cpu") as batches:
        uninterrupted, saved = run(batches, range(EPOCHS), (1, 3))
        assert saved is not None
        batches.load_state_dict(copy.deepcopy(saved[0]))
        set_global_states(saved[1])
        rest, _ = run(batches, range(batches.epoch, EPOCHS))
    assert uninterrupted[len(uninterrupted) - len(rest) :] == rest


def test_the_record_keeps_only_what_a_state_can_ask_for() -> None:
    """Rounds behind the producer's look-ahead are dropped (each holds every worker's states)."""
    many = DataLoader(Drawing(), batch_size=1, num_workers=2, worker_init_fn=numpy_seeded)
    with nostall.prefetch(many, "cpu", depth=2) as batches:
        list(batches)
        record = batches._lineage.epochs.worker_record
        assert len(record._rounds) <= (2 + 8) // 2 + 5


def test_a_record_that_does_not_start_its_round_is_refused() -> None:
    """A record whose round does not hold the batches handed out could not be resumed."""
    saved = a_state_inside_a_round()
    state = copy.deepcopy(saved[0])
    state["replay"]["worker_draws"]["batches"] = 0
    with (
        nostall.prefetch(loader(2), "cpu") as batches,
        pytest.raises(ValueError, match=r"\['worker_draws'\]\['batches'\] is 0"),
    ):
        batches.load_state_dict(state)


@pytest.mark.parametrize("at", [0, 3], ids=["first-round", "later-round"])
def test_a_round_no_longer_kept_is_warned_of_where_the_state_is_saved(at: int) -> None:
    """Dropped (the loading ran further ahead than the record keeps): warned at ``state_dict``.

    In an epoch's first round, workers started each epoch are as they started: nothing lost.
    """
    seed_all(0)
    with nostall.prefetch(loader(2), "cpu") as batches:
        batches._lineage.epochs.worker_record.ahead = -100  # keeps no round at all
        it = iter(batches)
        for _ in range(at + 1):
            next(it)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = batches.state_dict()
    said = [w for w in caught if "no longer recorded" in str(w.message)]
    if at < 2:
        assert not said
        assert [None, None] == state["replay"]["worker_draws"]["states"]
    else:
        assert [w.filename for w in said] == [__file__]
        assert "worker_draws" not in state["replay"]


@pytest.mark.parametrize("between", ["reset", "loop"], ids=["workers-replaced", "loader-looped"])
@pytest.mark.parametrize("save_at", [(1, -1), (1, 0), (1, 2)], ids=["start", "first", "second"])
def test_persistent_workers_used_elsewhere_between_epochs_resume_exactly_or_are_warned_of(
    between: str, save_at: tuple[int, int]
) -> None:
    """Workers replaced between two epochs (as Lightning shuts them down), or the loader looped.

    A later state resumes exactly, or ``load_state_dict`` warns.
    """

    def loop(batches: nostall.Prefetcher[Any], epochs: range) -> tuple[Batches, Any]:
        seen: Batches = []
        saved = None
        for epoch in epochs:
            if epoch == 1 and save_at[0] == 1 and saved is None and epochs[0] == 0:
                if between == "reset":
                    batches._iterator = None  # set on the loader: new workers next epoch
                else:
                    seen += [(-1, b.tolist()) for b in batches._source]
            got, state = run(batches, range(epoch, epoch + 1), save_at)
            seen += got
            saved = saved or state
        return seen, saved

    seed_all(0)
    with nostall.prefetch(loader(2, persistent=True), "cpu") as batches:
        uninterrupted, saved = loop(batches, range(EPOCHS))
    assert saved is not None
    rest, caught = resumed_with_warnings(run, saved)
    warned = [w.filename for w in caught if "persistent_workers=False" in str(w.message)]
    if warned:
        assert [__file__] == warned
    else:
        assert uninterrupted[len(uninterrupted) - len(rest) :] == rest, "silently other values"
    if between == "loop" and save_at[1] < 2:
        assert warned, "draws for another loop in the first round: cannot be known, so warned"


def test_a_new_depth_keeps_as_many_rounds_as_it_runs_ahead() -> None:
    """``prefetcher.depth = 40`` after it was made: rounds kept for 40 batches ahead."""
    with nostall.prefetch(loader(2), "cpu") as batches:
        batches.depth = 40
        assert 40 <= batches._lineage.epochs.worker_record.ahead


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda s: s.clear(), "must be None or a dict with the 'torch' and 'random'"),
        (lambda s: s.update(numpy=(*s["numpy"][:3], "x", 0.0)), "has_gauss 'x'"),
        (lambda s: s.update(numpy=(s["numpy"][0], s["numpy"][1], 10**6, 0, 0.0)), "at most 624"),
    ],
    ids=["empty", "has-gauss", "position"],
)
def test_a_workers_state_that_could_not_be_set_is_refused(
    damage: Callable[[dict[str, Any]], None], match: str
) -> None:
    """Each worker's states are checked as a resume would set them."""
    saved = a_state_inside_a_round()
    state = copy.deepcopy(saved[0])
    damage(state["replay"]["worker_draws"]["states"][0])
    with nostall.prefetch(loader(2), "cpu") as batches, pytest.raises(ValueError, match=match):
        batches.load_state_dict(state)
