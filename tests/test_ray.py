"""nostall inside Ray Train: ``nostall.prefetch(ray.train.torch.prepare_data_loader(loader))``.

With two workers, ``prepare_data_loader`` rebuilds the loader with a ``DistributedSampler`` and
wraps it in its ``_WrappedDataLoader``, which moves each batch to the worker's device. The tests
start a local Ray cluster (one per module) and train the same seeded model
(tests/frameworks/ray_run.py) with ``TorchTrainer`` on two CPU workers (gloo), on Ray's loader
and through nostall, and compare each worker's samples step by step and the final weights;
after a mid-epoch resume in new worker processes too. docs/clients/ray.md's program runs here
as well.

Starting the cluster and each ``TorchTrainer.fit()`` (a controller and two worker processes,
each importing torch) costs most of the time, so each fit does several runs one after the
other in the same workers: ``make test`` does one fit (Ray's loader, nostall over it across
epochs, the page's function, a prefetcher handed to ``prepare_data_loader``); the other
scenarios are marked ``frameworks``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from doc_blocks import python_blocks

pytest.importorskip("ray.train")

import ray
import ray.train
from frameworks import ray_run
from frameworks.ray_run import EPOCHS, SAMPLES, SAVE_AT, WORKERS

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "clients" / "ray.md"

pytestmark = [
    pytest.mark.timeout(600),
    # Ray Data's DataContext, which TorchTrainer makes, warns about its own default settings.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

Ranks = dict[int, dict[str, Any]]

#: Ray Train's background work that a short local run does not need, and usage reports.
QUIET = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # the controller sees the workers end sooner
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}

#: What nostall warns about Ray's loader (and the raw one) with across_epochs=True: the loader
#: has no generator of its own, so opening the next epoch ahead draws its base seed from
#: torch's global generator in nostall's thread. Ray's documentation builds it so.
SEED_DRAWN_AHEAD = "UserWarning: nostall: across_epochs=True opened this epoch ahead"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs; the workers import tests/frameworks and nostall."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in QUIET.items():
            patch.setenv(name, value)
        paths = [str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def page_function() -> Any:
    """docs/clients/ray.md's ``train_loop_per_worker``, from its python block (not run)."""
    (block,) = python_blocks(PAGE)
    names: dict[str, Any] = {"__name__": "ray_page"}  # not __main__: the program is not run
    exec(compile(block, str(PAGE), "exec"), names)
    return names["train_loop_per_worker"]


def load_rank(checkpoint: ray.train.Checkpoint, rank: int) -> dict[str, Any]:
    """What worker ``rank`` saved in ``checkpoint``."""
    with checkpoint.as_directory() as folder:
        state: dict[str, Any] = torch.load(Path(folder) / f"rank{rank}.pt")
    return state


def assert_same_run(expected: Ranks, actual: Ranks) -> None:
    """Every worker trained on the same samples at every step and ended with the same weights."""
    for rank in range(WORKERS):
        assert expected[rank]["steps"] == actual[rank]["steps"], f"rank {rank}"
        assert expected[rank]["weights"] == actual[rank]["weights"], f"rank {rank}"


def assert_resumed(uninterrupted: Ranks, resumed: Ranks) -> None:
    """After the resume, every worker trained on what it did from SAVE_AT on, to the same end."""
    for rank in range(WORKERS):
        expected, actual = uninterrupted[rank]["steps"][SAVE_AT:], resumed[rank]["steps"]
        where = f"rank {rank}: {len(actual)} steps after the resume, {len(expected)} expected"
        assert expected == actual, where
        assert uninterrupted[rank]["weights"] == resumed[rank]["weights"], f"rank {rank}"


def assert_quiet(run: Ranks, across: bool) -> None:
    """No nostall thread left in a worker; no warning but the one across epochs brings."""
    for rank in range(WORKERS):
        assert [] == run[rank]["threads_left"], f"rank {rank}"
        unexpected = [
            w for w in run[rank]["warnings"] if not (across and w.startswith(SEED_DRAWN_AHEAD))
        ]
        assert [] == unexpected, f"rank {rank}"


# -- make test: one fit ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One fit: the page's function (3 epochs), Ray's loader, nostall over it, the reverse."""
    out = tmp_path_factory.mktemp("ray-quick")
    runs = ["plain:0:full", "nostall:1:full", "reverse"]
    result = ray_run.fit(out, "quick", runs, page=page_function(), page_config={"epochs": 3})
    return out, result


def test_prepared_loader_through_nostall_trains_as_rays_own(quick: tuple[Path, Any]) -> None:
    """``nostall.prefetch(prepare_data_loader(loader), across_epochs=True)``: Ray's run.

    The loop calls ``loader.sampler.set_epoch(epoch)`` on Ray's ``DistributedSampler``, as
    Ray's documentation has it; each epoch is split between the workers, in its own order.
    """
    out, _ = quick
    expected = ray_run.records(out, "plain:0:full")
    for epoch in range(EPOCHS):
        parts = [
            [i for step in expected[r]["steps"] if step[0] == epoch for i in step[1]]
            for r in range(WORKERS)
        ]
        assert sorted(parts[0] + parts[1]) == list(range(SAMPLES)), f"epoch {epoch}"
    per_epoch = SAMPLES // ray_run.BATCH // WORKERS
    steps = expected[0]["steps"]
    assert steps[0][1] != steps[per_epoch][1]  # epoch 1 is not epoch 0's order again
    actual = ray_run.records(out, "nostall:1:full")
    assert_same_run(expected, actual)
    assert_quiet(actual, across=True)


def test_a_prefetcher_given_to_prepare_data_loader_is_refused(quick: tuple[Path, Any]) -> None:
    """``prepare_data_loader(nostall.prefetch(loader))`` raises a TypeError naming the fix.

    Ray would build a new DataLoader from what the prefetcher reads through (dataset, sampler,
    batch size...) and nostall would be gone. Checked in each worker with ``pytest.raises(
    TypeError, match="prepare_data_loader")``; the record says what happened there.
    """
    out, _ = quick
    for rank, record in ray_run.records(out, "reverse").items():
        assert "refused" == record["outcome"], f"rank {rank}: {record}"
        assert "nostall.prefetch(" in record["message"], f"rank {rank}"
        assert [] == record["threads_left"], f"rank {rank}"


def test_the_pages_function_trains_and_saves_each_workers_place(quick: tuple[Path, Any]) -> None:
    """docs/clients/ray.md's loop: a checkpoint every 4 steps, each worker's state in it.

    Two workers of 8 batches per epoch, 3 epochs: steps 4 to 24. At step 12 each worker is 4
    batches into epoch 1; the last state names epoch 3 (the run is done). The workers end with
    the same weights (DDP).
    """
    _, result = quick
    checkpoints = ray_run.page_checkpoints(result)
    assert [4, 8, 12, 16, 20, 24] == sorted(checkpoints)
    middle = [load_rank(checkpoints[12], r)["data"] for r in range(WORKERS)]
    assert [(1, 4)] * WORKERS == [(d["epoch"], d["batches_yielded"]) for d in middle]
    last = [load_rank(checkpoints[24], r) for r in range(WORKERS)]
    assert [3] * WORKERS == [state["data"]["epoch"] for state in last]
    weights = [state["model"] for state in last]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


# -- make test-frameworks ----------------------------------------------------------------------

FULL_RUNS = [
    "plain:0:full",
    "nostall:0:full",
    "nostall:1:full",
    "unmoved:0:full",
    "shard:0:full",
    "shard:1:full",
    "threads:0:full",
]
RESUMED_RUNS = ["nostall:0:resume", "nostall:1:resume", "shard:1:resume"]
PAGE_RESUMED_AT = 12  # 4 batches into epoch 1


@pytest.fixture(scope="module")
def full(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Every full run, in one fit (the nostall and shard runs report a checkpoint at SAVE_AT)."""
    out = tmp_path_factory.mktemp("ray-full")
    return out, ray_run.fit(out, "full", FULL_RUNS)


@pytest.fixture(scope="module")
def page_program(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """docs/clients/ray.md's program, run as ``python`` runs it, in an empty folder: its result."""
    (block,) = python_blocks(PAGE)
    names: dict[str, Any] = {"__name__": "__main__"}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("ray-page"))
        exec(compile(block, str(PAGE), "exec"), names)
    return names["result"]


@pytest.fixture(scope="module")
def resumed(
    full: tuple[Path, Any], page_program: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    """A new fit (new worker processes): the resumed runs, and the page's function resumed."""
    out, result = full
    page_checkpoint = ray_run.page_checkpoints(page_program)[PAGE_RESUMED_AT]
    resumed = ray_run.fit(
        out,
        "resumed",
        RESUMED_RUNS,
        checkpoints=ray_run.reported(result),
        page=page_function(),
        page_config={"epochs": 3, "checkpoint": page_checkpoint},
    )
    return out, resumed


@pytest.mark.frameworks
@pytest.mark.parametrize(
    "spec", ["nostall:0:full", "nostall:1:full", "unmoved:0:full"], ids=lambda s: s[:-5]
)
def test_same_steps_and_weights_as_rays_loader(full: tuple[Path, Any], spec: str) -> None:
    """Over Ray's loader (and over ``prepare_data_loader(..., move_to_device=False)``)."""
    out, _ = full
    actual = ray_run.records(out, spec)
    assert_same_run(ray_run.records(out, "plain:0:full"), actual)
    assert_quiet(actual, across=spec.endswith(":1:full"))


@pytest.mark.frameworks
@pytest.mark.parametrize("spec", ["shard:0:full", "shard:1:full", "threads:0:full"])
def test_shard_true_over_the_raw_loader_splits_as_ray_does(
    full: tuple[Path, Any], spec: str
) -> None:
    """``nostall.prefetch(loader, device, shard=True)`` instead of ``prepare_data_loader``.

    Its ``DistributedSampler`` is built as Ray's (seed 0, shuffled as the loader shuffles), so
    each worker trains on what Ray's loader gives it, step by step: each epoch split between
    the workers, nothing lost or repeated. With ``threads=2`` as well.
    """
    out, _ = full
    actual = ray_run.records(out, spec)
    for epoch in range(EPOCHS):
        parts = [
            [i for step in actual[r]["steps"] if step[0] == epoch for i in step[1]]
            for r in range(WORKERS)
        ]
        assert sorted(parts[0] + parts[1]) == list(range(SAMPLES)), f"epoch {epoch}"
    assert_same_run(ray_run.records(out, "plain:0:full"), actual)
    assert_quiet(actual, across=spec.startswith("shard:1"))


@pytest.mark.frameworks
@pytest.mark.parametrize("across", ["0", "1"], ids=["per-epoch", "across-epochs"])
def test_resume_mid_epoch_in_new_workers(resumed: tuple[Path, Any], across: str) -> None:
    """Saved with ``ray.train.report`` 4 batches into epoch 1, loaded in a new fit.

    Each worker loads its own model, optimizer and ``batches.state_dict()``, starts the loop at
    ``batches.epoch`` and trains on what the uninterrupted run trained on from there: no batch
    again, none missing, and the same weights.
    """
    out, _ = resumed
    actual = ray_run.records(out, f"nostall:{across}:resume")
    assert_resumed(ray_run.records(out, "plain:0:full"), actual)
    assert_quiet(actual, across=across == "1")


@pytest.mark.frameworks
def test_resume_mid_epoch_with_shard_true(resumed: tuple[Path, Any]) -> None:
    """``shard=True`` over the raw loader, across epochs, resumed in new workers as above."""
    out, _ = resumed
    actual = ray_run.records(out, "shard:1:resume")
    assert_resumed(ray_run.records(out, "plain:0:full"), actual)
    assert_quiet(actual, across=True)


@pytest.mark.frameworks
def test_the_pages_program_resumed_mid_epoch_ends_as_uninterrupted(
    page_program: Any, resumed: tuple[Path, Any]
) -> None:
    """The page's function resumed mid-epoch in new workers ends as the program without a stop.

    Resumed from the program's checkpoint of step 12 (4 batches into epoch 1), it reports at
    steps 16, 20 and 24; the last holds the uninterrupted program's weights, bit for bit.
    """
    _, result = resumed
    uninterrupted = ray_run.page_checkpoints(page_program)
    again = ray_run.page_checkpoints(result)
    assert [16, 20, 24] == sorted(again)
    assert "loss" in page_program.metrics  # the program's own print read it
    for rank in range(WORKERS):
        expected, actual = load_rank(uninterrupted[24], rank), load_rank(again[24], rank)
        assert expected["data"]["epoch"] == actual["data"]["epoch"] == 3
        for name in expected["model"]:
            assert torch.equal(expected["model"][name], actual["model"][name]), name
