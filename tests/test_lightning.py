"""nostall inside PyTorch Lightning: ``trainer.fit(model, nostall.prefetch(loader))``.

Lightning drives a train loader that is not a ``torch.utils.data.DataLoader`` (as a Prefetcher
is not) like this: it calls ``set_epoch(epoch)`` on ``loader.sampler`` (and on
``loader.batch_sampler.sampler``), read through the prefetcher, then ``iter(loader)``, then takes
exactly ``len(loader)`` batches: it never asks for the batch after the last, so the prefetcher
never sees an epoch's end (``test_how_lightning_drives_a_loader_that_is_not_a_dataloader``).
Under DDP it injects a ``DistributedSampler`` into a DataLoader, but leaves any other loader as
it is. It saves a loader's ``state_dict()`` in its checkpoints when the loader has one.

Each test trains the same seeded LightningModule (tests/frameworks/lightning_run.py) once on the
plain DataLoader and once on ``nostall.prefetch`` of an identically built one, and compares the
sample indices each epoch (and each rank) trained on, and the final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from helpers import as_dataset, lightning_seed_unset

import nostall

pytest.importorskip("lightning")

import lightning as L
from frameworks.lightning_run import (
    BATCH,
    EPOCHS,
    SAMPLES,
    SEED,
    Recorder,
    dataset,
    make_loader,
    make_trainer,
    stream_loader,
)
from lightning.pytorch.callbacks import ModelCheckpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "frameworks" / "lightning_run.py"
BATCHES = SAMPLES // BATCH  # per epoch, in one process

pytestmark = [
    # Lightning's own noise, from its pytree helper and its advice on the plain DataLoader.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
    pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers"),
    # Resumed without the ModelCheckpoint that saved the checkpoint (no more checkpoints needed).
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used"),
]


class Fitted(NamedTuple):
    seen: dict[int, list[int]]  # the sample indices trained on, per epoch, in order
    weights: list[float]


@pytest.fixture(autouse=True)
def _restore_seed_environment() -> Iterator[None]:
    """seed_everything() exports PL_GLOBAL_SEED and PL_SEED_WORKERS; undo that after each test."""
    with lightning_seed_unset():
        yield


def fit(
    make_source: Callable[[], Any],
    *,
    callbacks: Callable[[Any], list[L.Callback]] | None = None,
    ckpt_path: Path | None = None,
    **trainer_kwargs: Any,
) -> Fitted:
    """Seed, build the source and the model, train; close the source if it is a prefetcher.

    ``callbacks`` makes the Trainer's callbacks from the source.
    """
    L.seed_everything(SEED, verbose=False)
    source = make_source()
    model = Recorder()
    trainer = make_trainer(callbacks=callbacks(source) if callbacks else None, **trainer_kwargs)
    try:
        trainer.fit(model, source, ckpt_path=ckpt_path)
    finally:
        if isinstance(source, nostall.Prefetcher):
            source.close()
    return Fitted(model.seen, model.weights())


@cache
def plain(sampler: str, workers: int) -> Fitted:
    """Lightning's own handling of the DataLoader: the reference (one fit per kind of loader)."""
    return fit(lambda: make_loader(workers, sampler))


# -- what Lightning does with a loader that is not a DataLoader ----------------------------------


class LoggingLoader:
    """A re-iterable of 3 batches with a sampler, logging how it is driven."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.sampler = LoggingSampler(log)

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.log.append("iter")
        return self._batches()

    def _batches(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            self.log.append(f"next {i}")
            yield torch.full((2, 3), float(i))
        self.log.append("StopIteration")


class LoggingSampler:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def set_epoch(self, epoch: int) -> None:
        self.log.append(f"set_epoch {epoch}")


class Summing(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_how_lightning_drives_a_loader_that_is_not_a_dataloader() -> None:
    """Two iter() before epoch 0's set_epoch, one after each later one; never StopIteration.

    The first iter() only checks that the loader is iterable (data_connector.py); the second
    creates the epoch's iterator (fit_loop.setup_data); each later epoch calls set_epoch on
    ``loader.sampler``, then iter(). Each epoch takes len(loader) batches and stops there.
    """
    log: list[str] = []
    make_trainer(max_epochs=2).fit(Summing(), LoggingLoader(log))
    epoch = ["next 0", "next 1", "next 2"]
    assert ["iter", "iter", "set_epoch 0", *epoch, "set_epoch 1", "iter", *epoch] == log


# -- one process: the same samples, epoch by epoch -----------------------------------------------


SAMPLERS = ["shuffle", "distributed", "generator"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_plain_lightning_reference(sampler: str, workers: int) -> None:
    """Each epoch of the reference is a permutation of the dataset, and a different one."""
    seen = plain(sampler, workers).seen
    assert list(range(EPOCHS)) == sorted(seen)
    for epoch in range(EPOCHS):
        assert list(range(SAMPLES)) == sorted(seen[epoch])
    assert seen[0] != seen[1] != seen[2]


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_same_samples_and_weights_as_the_dataloader(
    sampler: str, workers: int, across: bool
) -> None:
    """Lightning on nostall.prefetch(loader) trains on what it trains on with the loader itself.

    "distributed": the order of epoch e is the one Lightning's set_epoch(e) asks for, even though
    Lightning calls set_epoch on the loader's sampler, not on the prefetcher.
    "shuffle": each epoch's order comes from the global generator, drawn in the same sequence.
    "generator": the RandomSampler draws from the loader's own generator, and draws once more
    when its iterator is exhausted; Lightning stops after len(loader) batches, so without workers
    it never exhausts it (with workers, their index prefetching does) and neither may nostall.
    """
    expected = plain(sampler, workers)
    actual = fit(
        lambda: nostall.prefetch(make_loader(workers, sampler), "cpu", across_epochs=across)
    )
    for epoch in range(EPOCHS):
        assert expected.seen[epoch] == actual.seen.get(epoch), f"epoch {epoch}"
    assert expected.weights == actual.weights


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_loading_threads_train_on_what_the_dataloader_gives(sampler: str, across: bool) -> None:
    """Lightning on nostall.prefetch(loader, threads=2): the loader's own samples and weights."""
    expected = plain(sampler, 0)
    actual = fit(
        lambda: nostall.prefetch(make_loader(0, sampler), "cpu", across_epochs=across, threads=2)
    )
    for epoch in range(EPOCHS):
        assert expected.seen[epoch] == actual.seen.get(epoch), f"epoch {epoch}"
    assert expected.weights == actual.weights


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_loading_threads_over_a_stream_train_on_what_two_workers_give(across: bool) -> None:
    """Lightning on prefetch(stream loader, threads=2): what the loader with 2 workers trains on.

    The threads read the stream as worker processes do: each its shard, its seed, batches in
    the workers' turns; each epoch's seeds drawn from the global generator in the same place.
    """
    expected = fit(lambda: stream_loader(2))
    actual = fit(lambda: nostall.prefetch(stream_loader(0), "cpu", across_epochs=across, threads=2))
    assert sorted(expected.seen[0]) == list(range(SAMPLES))
    assert expected.seen[0] != expected.seen[1]  # each epoch's seeds differ
    for epoch in range(EPOCHS):
        assert expected.seen[epoch] == actual.seen.get(epoch), f"epoch {epoch}"
    assert expected.weights == actual.weights


def test_seed_everything_workers_reaches_the_dataloader() -> None:
    """With seed_everything(workers=True), Lightning sets the loader's worker_init_fn.

    It sets it on the loader it is given: through the prefetcher, it must reach the DataLoader,
    whose workers call it, as it does without nostall.
    """
    results = {}
    for mode in ("plain", "nostall"):
        L.seed_everything(SEED, workers=True, verbose=False)
        loader = make_loader(0, "distributed")
        source = loader if mode == "plain" else nostall.prefetch(loader, "cpu")
        try:
            make_trainer(max_epochs=1).fit(Recorder(), source)
        finally:
            if isinstance(source, nostall.Prefetcher):
                source.close()
        init = loader.worker_init_fn  # a functools.partial: compared by what it calls
        results[mode] = (getattr(init, "func", init), getattr(init, "keywords", None))
    assert results["plain"][0] is not None
    assert results["plain"] == results["nostall"]


# -- resuming from a checkpoint ------------------------------------------------------------------

MID_STEP = BATCHES + 3  # saved after the 3rd batch of epoch 1


class PrefetcherState(L.Callback):
    """The documented way: the prefetcher's state goes into every checkpoint, and comes back."""

    def __init__(self, prefetcher: nostall.Prefetcher[Any]) -> None:
        self.prefetcher = prefetcher

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["nostall"] = self.prefetcher.state_dict()

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.prefetcher.load_state_dict(checkpoint["nostall"])


def fit_and_resume(
    make_source: Callable[[], Any], folder: Path, resume_from: str, *, how: str, **save: Any
) -> Fitted:
    """Fit once saving ModelCheckpoint(**save) checkpoints, then fit afresh from ``resume_from``.

    ``how``: "callback" gives both fits :class:`PrefetcherState`; "lightning" leaves the
    prefetcher's state to Lightning alone (it saves a loader's ``state_dict()``, when there is
    one, in its loop state). Returns what the resumed fit saw.
    """
    assert how in ("callback", "lightning"), how

    def state(source: Any) -> list[L.Callback]:
        if how == "callback" and isinstance(source, nostall.Prefetcher):
            return [PrefetcherState(source)]
        return []

    checkpointing = ModelCheckpoint(
        dirpath=folder, filename="{epoch}-{step}", save_top_k=-1, **save
    )
    fit(make_source, callbacks=lambda s: [checkpointing, *state(s)], enable_checkpointing=True)
    path = folder / resume_from
    assert path.exists(), sorted(p.name for p in folder.iterdir())
    return fit(make_source, callbacks=state, ckpt_path=path)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch")
def test_lightning_resumes_a_dataloader_only_at_an_epoch_end(tmp_path: Path) -> None:
    """Lightning's own handling, for reference: a DataLoader has no state to save.

    From a checkpoint taken mid-epoch, Lightning starts the epoch's order again (set_epoch) and
    takes only the batches that were left: the first ones again, the last ones never. From one
    taken at an epoch's end, the next epochs are those of an uninterrupted run.
    """
    expected = plain("distributed", 0)
    mid = fit_and_resume(
        lambda: make_loader(0, "distributed"),
        tmp_path / "mid",
        f"epoch=1-step={MID_STEP}.ckpt",
        how="lightning",
        every_n_train_steps=MID_STEP,
    )
    assert {1: expected.seen[1][: BATCH * (BATCHES - 3)], 2: expected.seen[2]} == mid.seen
    end = fit_and_resume(
        lambda: make_loader(0, "distributed"),
        tmp_path / "end",
        f"epoch=0-step={BATCHES}.ckpt",
        how="lightning",
        every_n_epochs=1,
    )
    assert {1: expected.seen[1], 2: expected.seen[2]} == end.seen
    assert expected.weights == end.weights


#: What is resumed mid-epoch: the uninterrupted run's reference, and the prefetcher to resume.
RESUMED: dict[str, tuple[Callable[[], Fitted], Callable[[bool], nostall.Prefetcher[Any]]]] = {
    # The plain DataLoader's run; its DistributedSampler's orders depend on the epoch only.
    # (With shuffle=True the epochs after the resumed one would draw from torch's generator,
    # whose state a Lightning checkpoint does not hold: no resumed run repeats them.)
    "dataloader": (
        lambda: plain("distributed", 0),
        lambda across: nostall.prefetch(make_loader(0, "distributed"), "cpu", across_epochs=across),
    ),
    # Threads over a stream against 2 worker processes: the order comes from each epoch's
    # worker seeds; nostall's state holds what they were drawn from, and what the next
    # epoch's draw finds. Lightning takes a batch ahead of its step here (no len()).
    "stream-threads": (
        lambda: fit(lambda: stream_loader(2)),
        lambda across: nostall.prefetch(stream_loader(0), "cpu", across_epochs=across, threads=2),
    ),
}


@pytest.mark.parametrize("how", ["callback", "lightning"])
@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("source", list(RESUMED))
def test_resume_mid_epoch(tmp_path: Path, source: str, across: bool, how: str) -> None:
    """Saved after the 3rd batch of epoch 1 and resumed: the rest of the uninterrupted run."""
    reference, prefetcher = RESUMED[source]
    expected = reference()
    resumed = fit_and_resume(
        lambda: prefetcher(across),
        tmp_path,
        f"epoch=1-step={MID_STEP}.ckpt",
        how=how,
        every_n_train_steps=MID_STEP,
    )
    assert {1: expected.seen[1][3 * BATCH :], 2: expected.seen[2]} == resumed.seen
    assert expected.weights == resumed.weights


def test_a_stream_under_threads_resumes_mid_epoch_in_a_fresh_process(tmp_path: Path) -> None:
    """Trained and checkpointed after the 3rd step of epoch 1; a new process resumes.

    The resumed process trains on the rest of the uninterrupted run: Lightning's checkpoint
    holds the prefetcher's state, which leaves out the batch Lightning took ahead. (Per epoch
    only: across epochs is resumed in one process above.) The checkpoint is saved here, as
    tests/frameworks/lightning_stream_run.py saves it (the same seed, loader, model and
    Trainer): only the resumed run needs a process of its own, each of which costs Lightning's
    import.
    """
    script = ROOT / "tests" / "frameworks" / "lightning_stream_run.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH")])
    )
    saving = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{epoch}-{step}",
        save_top_k=-1,
        every_n_train_steps=MID_STEP,
    )
    saved = fit(
        lambda: nostall.prefetch(stream_loader(0), "cpu", threads=2),
        callbacks=lambda _: [saving],
        enable_checkpointing=True,
    )
    checkpoint = tmp_path / "ckpt" / f"epoch=1-step={MID_STEP}.ckpt"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "resumed.json"), "--resume", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert 0 == done.returncode, done.stderr[-5000:]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    expected = fit(lambda: stream_loader(2))
    assert expected.seen == saved.seen
    rest = {"1": expected.seen[1][3 * BATCH :], "2": expected.seen[2]}
    assert rest == resumed["seen"]
    assert expected.weights == resumed["weights"]


def test_a_combined_loader_fetching_ahead_leaves_its_batch_out() -> None:
    """Beside a loader without a length, Lightning's fetcher fetches ahead of a sized prefetcher.

    At every step the state leaves out the batch the fetcher holds, also when that is the
    epoch's last (the state must not say the epoch is complete), and also after the combined
    loader cycled the shorter prefetcher from the fetcher's ``__next__`` (``max_size_cycle``).
    """
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    def prefetcher() -> nostall.Prefetcher[Any]:
        return nostall.prefetch(torch.utils.data.DataLoader(as_dataset([0, 1, 2]), batch_size=None))

    trained = prefetcher()
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader({"p": trained, "q": iter(range(100, 110))}, "max_size_cycle"))
    iter(fetcher)
    for step in range(5):  # the prefetcher's 3 batches, then 2 more as the loader cycles it
        next(fetcher)
        resumed = prefetcher()
        resumed.load_state_dict(trained.state_dict())
        assert int(fetcher.batches[0][0]["p"]) == int(next(iter(resumed))), f"step {step}"
        resumed.close()
    trained.close()


class StatefulStream:
    """A loader without a length that keeps its own state (as torchdata's loaders do)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        data = dataset()
        while self.position < SAMPLES:
            rows = range(self.position, min(self.position + BATCH, SAMPLES))
            self.position += len(rows)
            yield [torch.stack([data[i][part] for i in rows]) for part in range(3)]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_a_state_that_cannot_leave_out_lightnings_batch_ahead_warns(tmp_path: Path) -> None:
    """Over a source that keeps its own state, the batch Lightning holds cannot be uncounted.

    Lightning saves the prefetcher's state in its checkpoint mid-epoch, one batch ahead of its
    step: the state would skip that batch on resume, so nostall says so, with the fix.
    """
    checkpointing = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=3)
    with pytest.warns(UserWarning, match="fetched ahead of its step") as caught:
        fit(
            lambda: nostall.prefetch(StatefulStream(), "cpu"),
            callbacks=lambda source: [checkpointing],
            enable_checkpointing=True,
            max_epochs=1,
        )
    message = str(next(w.message for w in caught if "fetched ahead" in str(w.message)))
    assert "counts 1 batch(es)" in message
    assert "keeps its own state" in message
    assert "__len__" in message


@pytest.mark.parametrize("how", ["callback", "lightning"])
@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_resume_at_an_epoch_end(tmp_path: Path, across: bool, how: str) -> None:
    """Saved by ModelCheckpoint at the end of epoch 0 (its default) and resumed: epochs 1 and 2.

    Lightning never asks for the batch after an epoch's last, so at that checkpoint the
    prefetcher has handed out every batch of the epoch but not seen its end.
    """
    expected = plain("distributed", 0)
    resumed = fit_and_resume(
        lambda: nostall.prefetch(make_loader(0, "distributed"), "cpu", across_epochs=across),
        tmp_path,
        f"epoch=0-step={BATCHES}.ckpt",
        how=how,
        every_n_epochs=1,
    )
    assert {1: expected.seen[1], 2: expected.seen[2]} == resumed.seen
    assert expected.weights == resumed.weights


# -- DDP: two processes on the CPU (gloo), started by Lightning ----------------------------------

DDP_RUNS = (
    "plain:0:0",
    "plain:0:2",
    "nostall:0:0",
    "nostall-shard:0:0",
    "nostall-shard:1:0",
    "nostall-shard:1:2",
    "nostall-shard-threads:0:0",
    "nostall-shard-threads:1:0",
)

Ranks = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Every DDP_RUNS fit, one after the other in the same two processes; per run, per rank.

    Each rank's record: "seen" (epoch -> indices; JSON keys are strings), "weights", "warnings"
    (raised while building the loader and fitting) and "error" (building the loader failed).
    """
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--devices", "2", *DDP_RUNS],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert 0 == done.returncode, f"{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
    runs: dict[str, Ranks] = {}
    for spec in DDP_RUNS:
        folder = out / spec.replace(":", "-")
        runs[spec] = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)}
    return runs


def trained(record: dict[str, Any]) -> dict[int, list[int]]:
    assert record["error"] is None, record["error"]
    return {int(epoch): indices for epoch, indices in record["seen"].items()}


def warned_about_sharding(record: dict[str, Any]) -> list[str]:
    return [
        w["message"]
        for w in record["warnings"]
        if "UserWarning" in w["categories"] and "DistributedSampler" in w["message"]
    ]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("spec", ["plain:0:0", "plain:0:2"])
def test_ddp_plain_dataloader_gets_disjoint_halves(ddp: dict[str, Ranks], spec: str) -> None:
    """Lightning injects a DistributedSampler: each epoch, the ranks split the dataset."""
    ranks = ddp[spec]
    seen = {rank: trained(ranks[rank]) for rank in (0, 1)}
    for epoch in range(EPOCHS):
        halves = seen[0][epoch], seen[1][epoch]
        assert SAMPLES // 2 == len(halves[0]) == len(halves[1])
        assert list(range(SAMPLES)) == sorted(halves[0] + halves[1]), f"epoch {epoch}"
    assert seen[0][0] != seen[0][1]  # set_epoch reached the injected sampler
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert [] == warned_about_sharding(ranks[0])


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "spec",
    [
        "nostall-shard:0:0",
        "nostall-shard:1:0",
        "nostall-shard:1:2",
        "nostall-shard-threads:0:0",
        "nostall-shard-threads:1:0",
    ],
)
def test_ddp_shard_matches_lightnings_own_sharding(ddp: dict[str, Ranks], spec: str) -> None:
    """nostall.prefetch(loader, shard=True): per rank and epoch, the samples Lightning gives.

    The reference is Lightning's DistributedSampler injected into the same kind of DataLoader
    (its order does not depend on the number of workers, nor on loading threads).
    """
    workers = spec.rsplit(":", 1)[1]
    expected = ddp[f"plain:0:{workers}"]
    actual = ddp[spec]
    for rank in (0, 1):
        assert trained(expected[rank]) == trained(actual[rank]), f"rank {rank}"
        assert [] == warned_about_sharding(actual[rank]), f"rank {rank}"
        threads = actual[rank]["loading_threads"]
        assert (threads > 0) == spec.startswith("nostall-shard-threads"), f"rank {rank}: {threads}"
    assert expected[0]["weights"] == actual[0]["weights"]


@pytest.mark.timeout(400)
def test_ddp_without_shard_warns_and_leaves_the_data_alone(ddp: dict[str, Ranks]) -> None:
    """Lightning does not shard a loader that is not a DataLoader; nostall says so, on every rank.

    Without shard=True every rank trains on every sample, as Lightning gives them.
    """
    for rank, record in ddp["nostall:0:0"].items():
        assert warned_about_sharding(record), f"rank {rank}: no warning in {record['warnings']}"
        seen = trained(record)
        assert list(range(EPOCHS)) == sorted(seen), f"rank {rank}"
        for epoch, indices in seen.items():
            assert list(range(SAMPLES)) == sorted(indices), f"rank {rank}, epoch {epoch}"


# -- the example ---------------------------------------------------------------------------------


def test_lightning_example_runs(tmp_path: Path) -> None:
    """examples/lightning_train.py trains in one process on the CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_train.py")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=tmp_path,  # where Lightning writes its logs and checkpoints
        env=env,
    )
    assert 0 == done.returncode, f"{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
    assert list(tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt"))
