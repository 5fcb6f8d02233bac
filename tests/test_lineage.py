"""What consecutive passes of one Prefetcher hand on (``Lineage``), driven directly."""

from __future__ import annotations

import dataclasses
import unittest.mock
from collections.abc import Iterator

import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader

from nostall._engine.channel import Channel
from nostall._engine.lineage import Lineage
from nostall._engine.producer import Puller
from nostall._epochs.epochs import AS_BUILT, EpochSource
from nostall._staging.base import Staging


def lineage_over(n: int = 8) -> Lineage:
    epochs = EpochSource(DataLoader(as_dataset(range(n)), batch_size=2), across_epochs=True)
    return Lineage(epochs, {"seen": 0})


def puller_of(lineage: Lineage) -> Puller:
    return Puller(Channel(2, "test"), Staging(torch.device("cpu")), lineage.epochs, epoch=0)


def run_ahead(lineage: Lineage) -> Puller:
    """A puller that took epoch 0's end and runs ahead into epoch 1, as across epochs."""
    ahead = puller_of(lineage)
    lineage.end_handed_out(ahead, 0, None, None)
    assert lineage.ahead_in(1)
    return ahead


def test_a_new_lineage_is_at_epoch_0_as_built_with_the_transform_as_built() -> None:
    lineage = lineage_over()
    assert lineage.epoch == 0
    assert (lineage.at.handed_out, lineage.at.source_state) == (0, AS_BUILT)
    assert lineage.at.transform_state == {"seen": 0}


def test_the_epoch_is_the_positions() -> None:
    lineage = lineage_over()
    lineage.move_to_epoch(3, "set_epoch(3)")
    assert lineage.epoch == 3
    assert lineage.at.epoch == 3


def test_discarding_what_runs_ahead_stops_its_producer() -> None:
    lineage = lineage_over()
    ahead = run_ahead(lineage)
    lineage.discard_ahead()
    assert ahead.stopped
    assert not lineage.ahead_in(lineage.epoch)


def test_the_owner_gone_stops_what_runs_ahead_when_no_pass_is_running() -> None:
    lineage = lineage_over()
    ahead = run_ahead(lineage)
    Lineage.owner_gone(lineage)
    assert ahead.stopped
    assert not lineage.ahead_in(lineage.epoch)


def test_a_handed_out_batch_moves_the_position_and_nothing_else_does() -> None:
    """``handed_out`` moves ``at``; running ahead (a puller's end taken) moves the epoch only."""
    lineage = lineage_over()
    lineage.handed_out(0, 1, None, {"seen": 1}, None)
    assert (lineage.at.epoch, lineage.at.handed_out) == (0, 1)
    assert lineage.at.transform_state == {"seen": 1}


def test_a_generator_that_raised_is_exhausted_once_its_error_is_handed_out() -> None:
    """A closed generator's error ends it: the lineage says so (the next pass warns)."""

    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("boom")

    source = failing()
    lineage = Lineage(EpochSource(source, across_epochs=False), None)
    assert next(source) == 1
    with pytest.raises(ValueError, match="boom"):
        next(source)
    lineage.error_handed_out(0, 2, None)
    assert lineage.exhausted
    assert lineage.at.handed_out == 2


def test_the_first_epoch_is_the_one_before_any_pass_ended() -> None:
    """``first_epoch`` is True until a pass ended or stopped: the framework checks run once."""
    lineage = lineage_over()
    assert [True, True] == [lineage.first_epoch() for _ in range(2)]  # a start that raised
    lineage.pass_ended(2)
    assert [False, False] == [lineage.first_epoch() for _ in range(2)]


def test_a_loaded_transform_state_is_taken_once_by_the_next_producer() -> None:
    """``loaded`` keeps the transform's state for the next producer, which takes it once."""
    lineage = lineage_over()
    state = {"epoch": 0, "batches_yielded": 0}
    at = dataclasses.replace(lineage.at, transform_state={"seen": 7})
    with unittest.mock.patch.object(lineage.epochs, "load") as load:
        lineage.loaded(at, state, transform=True)
    load.assert_called_once_with(state)
    assert lineage.at is at
    assert lineage.take_pending_transform_state() == {"seen": 7}
    assert lineage.take_pending_transform_state() is None


def test_a_stale_puller_ahead_is_stopped_not_taken() -> None:
    """An epoch opened ahead whose sampler epoch someone else changed is dropped."""
    lineage = lineage_over()
    ahead = run_ahead(lineage)
    with unittest.mock.patch.object(Lineage, "opened_with_current_epoch", return_value=False):
        assert lineage.take_ahead() is None
    assert ahead.stopped
