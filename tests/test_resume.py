"""The consumer's position and the checkpoint made from it, driven directly.

The behaviour of ``state_dict``/``load_state_dict`` through a Prefetcher is tested in
test_epochs.py (resuming mid-epoch, across epochs, inside frameworks); here, the value itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import CountingTransform, as_dataset
from torch.utils.data import DataLoader, IterableDataset

from nostall._epochs.epochs import AS_BUILT, EpochSource
from nostall._epochs.resume import (
    STATE_VERSION,
    Position,
    check_state,
    loaded_position,
    state_of,
)


def epochs_of(n: int = 10, batch_size: int = 2) -> EpochSource:
    loader = DataLoader(as_dataset(range(n)), batch_size=batch_size, shuffle=True)
    return EpochSource(loader, across_epochs=False)


def test_a_batch_handed_out_advances_the_position_and_forgets_a_loaded_state() -> None:
    loaded = {"nostall": STATE_VERSION}
    at = Position(2, 3, AS_BUILT, {"seen": 3}, loaded)
    at.advance(2, 4, {"rng": "r"}, {"seen": 4})
    assert at == Position(2, 4, {"rng": "r"}, {"seen": 4}, None)


def test_a_batch_without_transform_state_keeps_the_last_one() -> None:
    at = Position.start(0, {"seen": 7})
    at.advance(0, 1, None, None)
    assert at.transform_state == {"seen": 7}


def test_after_an_epoch_is_a_new_position_with_the_transform_as_now() -> None:
    at = Position(0, 5, {"rng": "r"}, {"seen": 5}, None)
    after = at.after(1, 0, {"rng": "end"})
    assert after == Position(1, 0, {"rng": "end"}, {"seen": 5}, None)
    assert at.epoch == 0  # the old value is left as it was


def test_moving_to_another_epoch_reads_the_source_again_and_keeps_the_transform() -> None:
    at = Position(1, 5, {"rng": "r"}, {"seen": 5}, None)
    moved = at.moved_to(2, keep_source_state=False, keep_loaded=False)
    assert moved == Position(2, 0, AS_BUILT, {"seen": 5}, None)
    assert at.moved_to(1, keep_source_state=True, keep_loaded=False) == at


def test_moving_keeps_a_loaded_state_only_when_asked() -> None:
    loaded = {"epoch": 3, "batches_yielded": 4}
    at = Position(3, 4, AS_BUILT, None, loaded)
    kept = at.moved_to(3, keep_source_state=False, keep_loaded=True)
    assert kept.loaded is loaded
    assert kept.handed_out == 4
    dropped = at.moved_to(5, keep_source_state=False, keep_loaded=False)
    assert dropped == Position(5, 0, AS_BUILT, None, None)


def test_a_loaded_state_is_saved_as_it_was_loaded() -> None:
    loaded: dict[str, Any] = {"nostall": STATE_VERSION, "epoch": 9}
    assert state_of(Position(9, 0, AS_BUILT, None, loaded), epochs_of()) is loaded


def test_the_state_before_any_batch_reads_the_source_then() -> None:
    epochs = epochs_of()
    torch.manual_seed(3)
    state = state_of(Position.start(4, None), epochs)
    assert (state["nostall"], state["epoch"], state["batches_yielded"]) == (STATE_VERSION, 4, 0)
    assert state["source_state"] is None  # a DataLoader has no state_dict(): replayed
    assert torch.equal(state["replay"]["rng"]["torch"], torch.get_rng_state())
    assert state["replay"]["length"] == 5
    assert "transform" not in state


def test_the_state_holds_the_transform_state_when_there_is_one() -> None:
    state = state_of(Position.start(0, {"seen": 2}), epochs_of())
    assert state["transform"] == {"seen": 2}


def test_every_batch_handed_out_resumes_at_the_next_epoch_with_how_this_one_ended() -> None:
    epochs = epochs_of(n=4)  # two batches
    record = {"rng": {"torch": torch.get_rng_state()}, "sampler_epoch": None}
    state = state_of(Position(0, 2, record, None, None), epochs)
    assert (state["epoch"], state["batches_yielded"]) == (1, 0)
    assert state["replay"]["end_of"]["batches"] == 2


class SizedStream(IterableDataset[int]):
    """0..n-1 with a len(): a loader over it has a len() that torch calls an estimate."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_every_batch_len_promises_is_not_the_end_where_len_estimates() -> None:
    """Over an IterableDataset, the state stays after the batches handed out: more may come."""
    epochs = EpochSource(DataLoader(SizedStream(4), batch_size=2), across_epochs=False)
    record = {"rng": {"torch": torch.get_rng_state()}, "sampler_epoch": None}
    state = state_of(Position(0, 2, record, None, None), epochs)
    assert (0, 2) == (state["epoch"], state["batches_yielded"])
    assert "end_of" not in state["replay"]


def test_a_saved_state_checks_and_loads_into_a_position() -> None:
    epochs = epochs_of()
    saved = state_of(Position.start(1, {"seen": 0}), epochs)
    at = loaded_position(saved, epochs, CountingTransform(), Position.start(0, None))
    assert at == Position(1, 0, AS_BUILT, {"seen": 0}, saved)


def test_a_state_without_a_transform_keeps_the_transform_where_it_is() -> None:
    epochs = epochs_of()
    saved = state_of(Position.start(1, None), epochs)
    at = loaded_position(saved, epochs, CountingTransform(), Position.start(0, {"seen": 6}))
    assert at.transform_state == {"seen": 6}


def test_a_transform_state_for_a_transform_without_load_state_dict_is_refused() -> None:
    epochs = epochs_of()
    saved = state_of(Position.start(1, {"seen": 0}), epochs)
    with pytest.raises(ValueError, match="has no load_state_dict"):
        loaded_position(saved, epochs, lambda batch: batch, Position.start(0, None))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"nostall": 99}, "not a nostall Prefetcher state.*got a dict whose 'nostall' is 99"),
        ({"epoch": -1}, r"state\['epoch'\] must be an int >= 0"),
        ({"batches_yielded": True}, r"state\['batches_yielded'\] must be an int >= 0"),
        ({"batches_yielded": 6}, "past the end of an epoch of 5 batches"),
        ({"replay": None}, r"state\['replay'\] must be a dict .*\(got None, a NoneType\)"),
        (
            {"replay": None, "source_state": {"_num_yielded": 2}},
            r"state\['source_state'\] holds a source's own state_dict\(\), but the source here "
            r"has none \(a DataLoader\)",
        ),
    ],
)
def test_check_state_names_the_field_that_is_wrong(change: dict[str, Any], match: str) -> None:
    epochs = epochs_of()
    saved = state_of(Position.start(0, None), epochs)
    with pytest.raises(ValueError, match=match):
        check_state({**saved, **change}, epochs)


def test_check_state_refuses_a_state_for_another_length() -> None:
    saved = state_of(Position.start(0, None), epochs_of(n=10))
    with pytest.raises(ValueError, match="source of 5 batches, this one has 6"):
        check_state(saved, epochs_of(n=12))


def test_check_state_refuses_a_damaged_random_state() -> None:
    epochs = epochs_of()
    saved = state_of(Position.start(0, None), epochs)
    damaged = {**saved, "replay": {**saved["replay"], "rng": {"torch": torch.zeros(3)}}}
    with pytest.raises(ValueError, match=r"state\['replay'\]\['rng'\]\['torch'\]"):
        check_state(damaged, epochs)


def test_check_state_refuses_an_epoch_past_an_int64() -> None:
    """epoch=2**70 was accepted, then failed in the sampler's seed at a later next()."""
    epochs = epochs_of()
    saved = state_of(Position.start(0, None), epochs)
    with pytest.raises(ValueError, match=r"state\['epoch'\] must be an int >= 0 and < 2\*\*63 "):
        check_state({**saved, "epoch": 2**70}, epochs)
    assert check_state({**saved, "epoch": 2**63 - 1}, epochs)["epoch"] == 2**63 - 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sampler_epoch": "3"}, "sampler_epoch"),
        ({"fresh_iterator": None}, "fresh_iterator"),
        ({"rng": None}, "rng"),
        ({"batches": -1}, "batches"),
    ],
)
def test_a_damaged_end_of_epoch_record_is_named_where_it_is(
    change: dict[str, Any], field: str
) -> None:
    """A field of state['replay']['end_of'] is named there, not as state['replay']'s own."""
    epochs = epochs_of(n=4)  # two batches
    record = {"rng": {"torch": torch.get_rng_state()}, "sampler_epoch": None}
    saved = state_of(Position(0, 2, record, None, None), epochs)
    end_of = {**saved["replay"]["end_of"], "fresh_iterator": False, **change}
    damaged = {**saved, "replay": {**saved["replay"], "end_of": end_of}}
    with pytest.raises(ValueError, match=re.escape(f"state['replay']['end_of'][{field!r}]")):
        check_state(damaged, epochs)


def stateful_epochs(num_workers: int = 0) -> EpochSource:
    """EpochSource over torchdata's StatefulDataLoader of 10 numbers, batches of 2."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(range(10), batch_size=2, num_workers=num_workers)
    return EpochSource(loader, across_epochs=False)


@pytest.mark.parametrize(
    ("source_state", "match"),
    [
        (
            "garbage",
            r"must be a StatefulDataLoader's state_dict\(\), a dict \(got 'garbage', a str\)",
        ),
        ({"x": 1}, r"is no StatefulDataLoader state \(it has neither '_num_yielded'"),
    ],
)
def test_a_stateful_dataloaders_state_that_is_not_its_own_is_refused(
    source_state: object, match: str
) -> None:
    """torchdata asserted only at the next iter(); refused at load_state_dict, named."""
    epochs = stateful_epochs()
    saved = state_of(Position.start(0, None), epochs)
    with pytest.raises(ValueError, match=r"state\['source_state'\] " + match):
        check_state({**saved, "batches_yielded": 1, "source_state": source_state}, epochs)


def test_a_stateful_dataloaders_state_for_other_workers_is_refused() -> None:
    """Saved with num_workers=0, loaded into num_workers=2: refused with the count to build."""
    saved = state_of(Position.start(0, None), stateful_epochs())
    here = stateful_epochs(num_workers=2)
    with pytest.raises(ValueError, match="num_workers=0, and this one has num_workers=2"):
        check_state({**saved, "batches_yielded": 1}, here)


def test_a_foreign_dict_is_refused_by_what_it_lacks() -> None:
    """Not "expected a dict ... got a dict": the message says what the dict lacks."""
    with pytest.raises(
        ValueError, match=r"got a dict without a 'nostall' key \(its keys: 'model', 'optimizer'\)"
    ):
        check_state({"model": 1, "optimizer": 2}, epochs_of())


def test_a_length_of_another_type_is_refused_by_its_type() -> None:
    """Not "saved for a source of 5 batches, this one has 5": the type is what is wrong."""
    epochs = epochs_of()
    state = state_of(Position.start(0, None), epochs)
    state["replay"]["length"] = str(state["replay"]["length"])
    with pytest.raises(ValueError, match=r"state\['replay'\]\['length'\] must be an int or None"):
        check_state(state, epochs)
