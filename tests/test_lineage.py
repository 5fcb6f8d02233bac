"""What consecutive passes of one Prefetcher hand on (``Lineage``), driven directly."""

from __future__ import annotations

import torch
from helpers import as_dataset
from torch.utils.data import DataLoader

from nostall._channel import Channel
from nostall._epochs import AS_BUILT, EpochSource
from nostall._lineage import Lineage
from nostall._producer import Puller
from nostall._staging_base import Staging


def lineage_over(n: int = 8) -> Lineage:
    epochs = EpochSource(DataLoader(as_dataset(range(n)), batch_size=2), across_epochs=True)
    return Lineage(False, epochs, {"seen": 0})


def puller_of(lineage: Lineage) -> Puller:
    return Puller(Channel(2, "test"), Staging(torch.device("cpu")), lineage.epochs, epoch=0)


def test_a_new_lineage_is_at_epoch_0_as_built_with_the_transform_as_built() -> None:
    lineage = lineage_over()
    assert lineage.epoch == 0
    assert (lineage.at.handed_out, lineage.at.source_state) == (0, AS_BUILT)
    assert lineage.at.transform_state == {"seen": 0}


def test_the_epoch_is_the_positions() -> None:
    lineage = lineage_over()
    lineage.at = lineage.at.moved_to(3, keep_source_state=False, keep_loaded=False)
    assert lineage.epoch == 3


def test_discarding_what_runs_ahead_stops_its_producer() -> None:
    lineage = lineage_over()
    ahead = puller_of(lineage)
    lineage.ahead = ahead
    lineage.discard_ahead()
    assert ahead.stopped
    assert lineage.ahead is None


def test_the_owner_gone_stops_what_runs_ahead_when_no_pass_is_running() -> None:
    lineage = lineage_over()
    ahead = puller_of(lineage)
    lineage.ahead = ahead
    Lineage.owner_gone(lineage)
    assert not lineage.owner_alive
    assert ahead.stopped
