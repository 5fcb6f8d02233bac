"""Train a tiny LightningModule on a DataLoader or on nostall.prefetch(loader); record what it saw.

tests/test_lightning.py imports it, and runs it as a script for DDP (Lightning starts the script
again for every other rank):

    python tests/frameworks/lightning_run.py OUT --devices 2 plain:0:0 nostall-shard:1:2

Each RUN is MODE:ACROSS:WORKERS: MODE is plain (the DataLoader itself), nostall
(``nostall.prefetch(loader)``), nostall-shard (``nostall.prefetch(loader, shard=True)``) or
nostall-shard-threads (the same with ``threads=2``, the loader built with 0 workers);
ACROSS is 0 or 1 for ``across_epochs``; WORKERS is the DataLoader's ``num_workers``. The runs go
one after the other in the same processes. Every rank writes OUT/MODE-ACROSS-WORKERS/rankR.json
with the sample indices it trained on per epoch, the final weights, the most loading threads
alive at a step, the warnings raised while building the loader and training, and the error if
building the loader failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    get_worker_info,
)

import nostall

SEED = 7
SAMPLES = 40
BATCH = 4
EPOCHS = 3
MODES = ("plain", "nostall", "nostall-shard", "nostall-shard-threads")


def dataset() -> TensorDataset:
    """Sample i is (i, features, target): a batch names the samples it holds."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(SAMPLES, 3, generator=generator)
    return TensorDataset(torch.arange(SAMPLES), features, features.sum(1))


def make_loader(workers: int = 0, sampler: str = "shuffle") -> DataLoader[Any]:
    """A shuffling DataLoader of :func:`dataset`, in batches of BATCH.

    ``sampler``: "shuffle" (shuffle=True: orders drawn from the global generator), "generator"
    (shuffle=True with the loader's own seeded generator) or "distributed" (a one-replica
    DistributedSampler: each epoch's order is fixed by its seed and ``set_epoch``).
    """
    data = dataset()
    kwargs: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
    if sampler == "distributed":
        shard: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=SEED
        )
        return DataLoader(data, batch_size=BATCH, sampler=shard, **kwargs)
    if sampler == "generator":
        kwargs["generator"] = torch.Generator().manual_seed(SEED)
    else:
        assert "shuffle" == sampler, sampler
    return DataLoader(data, batch_size=BATCH, shuffle=True, **kwargs)


class ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """:func:`dataset`'s samples as a stream: worker w of n reads every n-th, shuffled.

    The shuffle is drawn from ``get_worker_info().seed`` (the worker's seed, ``base_seed + w``),
    as a shard reader seeds its shuffle buffer, so the seeds a worker is given show in the order.
    """

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        data = dataset()
        info = get_worker_info()
        mine = range(SAMPLES) if info is None else range(info.id, SAMPLES, info.num_workers)
        seed = 0 if info is None else info.seed
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(seed))
        for i in order.tolist():
            yield data[mine[i]]


def stream_loader(workers: int) -> DataLoader[Any]:
    """The stream in batches; each epoch's worker seeds drawn from the loader's own generator.

    (From torch's global generator, the epochs after a resumed one would draw from a state a
    Lightning checkpoint does not hold: no resumed run, with or without nostall, repeats them.)
    """
    generator = torch.Generator().manual_seed(SEED)
    return DataLoader(ShardedStream(), batch_size=BATCH, num_workers=workers, generator=generator)


def wrap(loader: DataLoader[Any], mode: str, across: bool) -> Any:
    """The loader Trainer.fit is given in ``mode``."""
    if mode == "plain":
        return loader
    if mode == "nostall":
        return nostall.prefetch(loader, "cpu", across_epochs=across)
    if mode == "nostall-shard-threads":
        return nostall.prefetch(loader, "cpu", across_epochs=across, shard=True, threads=2)
    assert "nostall-shard" == mode, mode
    return nostall.prefetch(loader, "cpu", across_epochs=across, shard=True)


class Recorder(L.LightningModule):
    """A linear regression that records the sample indices of every batch, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: dict[int, list[int]] = {}
        #: The most nostall loading threads (``threads=``) alive at any step.
        self.loading_threads = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        index, features, target = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        alive = sum(t.name.startswith("nostall-load") for t in threading.enumerate())
        self.loading_threads = max(self.loading_threads, alive)
        return torch.nn.functional.mse_loss(self.layer(features).squeeze(1), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def weights(self) -> list[float]:
        return torch.cat([p.detach().flatten() for p in self.parameters()]).tolist()


def make_trainer(**kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer for EPOCHS epochs; ``kwargs`` override the defaults."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": EPOCHS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    with warnings.catch_warnings():
        # On a machine with a GPU, Lightning warns that a CPU Trainer leaves it unused, even
        # with accelerator="cpu" (trainer/setup.py); these runs are on the CPU on purpose.
        warnings.filterwarnings("ignore", "GPU available but not used", PossibleUserWarning)
        return L.Trainer(**{**options, **kwargs})


def run(mode: str, across: bool, workers: int, devices: int) -> tuple[dict[str, Any], L.Trainer]:
    """One seeded fit: what this rank saw, and the Trainer."""
    ddp: dict[str, Any] = {"strategy": "ddp", "devices": devices} if devices > 1 else {}
    record: dict[str, Any] = {"seen": {}, "weights": None, "warnings": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.seed_everything(SEED, verbose=False)
        trainer = make_trainer(**ddp)
        try:
            loader = wrap(make_loader(workers), mode, across)
        except Exception as e:  # the same on every rank, before any collective call
            record["error"] = f"{type(e).__name__}: {e}"
        else:
            model = Recorder()
            trainer.fit(model, loader)
            if mode != "plain":
                loader.close()
            record["seen"] = model.seen
            record["weights"] = model.weights()
            record["loading_threads"] = model.loading_threads
    record["rank"] = trainer.global_rank if record["error"] is None else local_rank()
    record["warnings"] = [
        {"categories": [c.__name__ for c in w.category.__mro__], "message": str(w.message)}
        for w in caught
    ]
    return record, trainer


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def main(argv: list[str] | None = None) -> None:
    """Parse the runs, do them, and write one JSON per run and rank."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", metavar="MODE:ACROSS:WORKERS")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)
    children: list[subprocess.Popen[bytes]] = []  # the ranks rank 0 started
    for spec in args.runs:
        mode, across, workers = spec.split(":")
        if mode not in MODES or across not in ("0", "1"):
            parser.error(f"bad run {spec!r}")
        record, trainer = run(mode, across == "1", int(workers), args.devices)
        launcher = trainer.strategy.launcher  # rank 0's first DDP fit starts the other ranks
        children += getattr(launcher, "procs", [])
        folder = args.out / f"{mode}-{across}-{workers}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{record['rank']}.json").write_text(json.dumps(record))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its files
    for child in children:
        child.wait(timeout=120)


if __name__ == "__main__":
    main()
