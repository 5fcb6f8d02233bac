"""examples/torchrun_resume.py: a DDP run killed mid-epoch and resumed, rank by rank.

Every rank saves and restores its own ``batches.state_dict()`` with its model and optimizer. The
resumed run must train each rank on the same samples, epoch by epoch, as an uninterrupted run,
and end with the same weights (gloo's allreduce of two ranks is deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_torchrun

SAMPLES, EPOCHS, BATCH = 80, 3, 8  # as in the example: 40 samples, 5 batches per rank and epoch
STOP_AFTER = 7  # the 2nd batch of epoch 1: mid-epoch, and after the epoch boundary was crossed


def torchrun(checkpoint: Path, *args: str) -> None:
    done = run_torchrun(
        "examples/torchrun_resume.py", "--checkpoint", str(checkpoint), *args, timeout=150
    )
    ranks = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))
    assert 0 == done.returncode, (
        f"torchrun failed ({args}):\n{ranks[-8000:]}\n{done.stderr[-3000:]}"
    )


def seen(checkpoint: Path, rank: int) -> dict[str, list[int]]:
    recorded: dict[str, list[int]] = json.loads((checkpoint / f"seen-rank{rank}.json").read_text())
    return recorded


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run from start to end (no workers), the reference for the resumed runs."""
    checkpoint = tmp_path_factory.mktemp("uninterrupted")
    torchrun(checkpoint)
    return checkpoint


@pytest.mark.timeout(400)
def test_uninterrupted_run_covers_every_sample_each_epoch(uninterrupted: Path) -> None:
    """The reference itself: the ranks split each epoch, and each epoch is shuffled anew."""
    for epoch in map(str, range(EPOCHS)):
        shards = [seen(uninterrupted, rank)[epoch] for rank in (0, 1)]
        assert [SAMPLES // 2] * 2 == [len(shard) for shard in shards]
        assert list(range(SAMPLES)) == sorted(shards[0] + shards[1])
    assert seen(uninterrupted, 0)["0"] != seen(uninterrupted, 0)["1"]  # set_epoch reached it


@pytest.mark.timeout(400)
def test_killed_mid_epoch_and_resumed_matches_uninterrupted(
    uninterrupted: Path, tmp_path: Path
) -> None:
    """Stopped after 7 steps and resumed from each rank's own checkpoint: the same run.

    With 2 workers per rank, against a reference run without workers: the worker processes
    change nothing either (one torchrun pair fewer than running both ways, for the suite's time).
    """
    workers = 2
    torchrun(tmp_path, "--workers", str(workers), "--stop-after", str(STOP_AFTER))
    assert not (tmp_path / "final.pt").exists()
    per_epoch = SAMPLES // 2 // BATCH
    for rank in (0, 1):  # stopped mid-epoch 1, every rank at the same step
        expected = {"0": SAMPLES // 2, "1": (STOP_AFTER - per_epoch) * BATCH}
        assert expected == {epoch: len(ids) for epoch, ids in seen(tmp_path, rank).items()}

    torchrun(tmp_path, "--workers", str(workers))
    for rank in (0, 1):
        assert seen(uninterrupted, rank) == seen(tmp_path, rank), f"rank {rank}"
    reference = torch.load(uninterrupted / "final.pt")
    resumed = torch.load(tmp_path / "final.pt")
    assert reference.keys() == resumed.keys()
    for name in reference:  # bit for bit
        assert torch.equal(reference[name], resumed[name]), (name, reference[name], resumed[name])
