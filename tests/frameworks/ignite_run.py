"""Train a tiny model with PyTorch-Ignite on its own loader or through nostall; record it all.

tests/test_ignite.py imports :func:`train` for runs in one process, and runs this file as a
script for a resume in a fresh process and for two ranks (``ignite.distributed.Parallel``
spawns them, gloo on the CPU):

    python tests/frameworks/ignite_run.py OUT RUN [RUN ...] [--nproc 2]

Each RUN is a comma-separated list of KEY=VALUE (the defaults of :class:`Run` for the others):

- ``engine``: ``engine`` (``create_supervised_trainer``: an ``Engine``) or ``deterministic``
  (``create_supervised_trainer(..., deterministic=True)``: a ``DeterministicEngine``);
- ``data``: ``loader`` (the ``DataLoader`` itself) or ``nostall`` (``nostall.prefetch(loader,
  idist.device(), across_epochs=...)``);
- ``across``: 0 or 1, nostall's ``across_epochs``;
- ``saved``: 1 puts the prefetcher in the checkpoint's ``to_save`` as ``"batches"``, 0 leaves
  it out;
- ``workers``: the ``DataLoader``'s ``num_workers`` (with ``persistent_workers``);
- ``seeded``: 1 gives the ``DataLoader`` a seeded ``generator=``; 0 leaves it drawing its
  orders from torch's global generator;
- ``rng``: 1 puts torch's global generator in ``to_save`` too (as ``"rng"``:
  :class:`GlobalGenerator`);
- ``set_epoch``: 1 attaches ``setup_common_training_handlers(trainer, train_sampler=...)``,
  whose handler sets the ``DistributedSampler``'s epoch at each ``EPOCH_STARTED``;
- ``every``: the full run saves an ``ignite.handlers.Checkpoint`` at every ``every``
  iterations (``Events.ITERATION_COMPLETED(every=...)``); by default SAVE_EVERY, the first
  mid-epoch 1; 20 saves at epoch 1's end;
- ``phase``: ``full`` (from the start, saving checkpoints) or ``resume`` (everything built
  again, ``Checkpoint.load_objects`` of the full run's first checkpoint, then
  ``trainer.run(batches, max_epochs=EPOCHS)``).

The loader is ``idist.auto_dataloader(dataset, batch_size=BATCH, shuffle=True)``: on one
process a plain shuffled ``DataLoader``; on two ranks each rank's ``DistributedSampler`` and
half the batch size. The runs go one after the other in the same processes. Every rank writes
OUT/RUN/rankR.json (RUN with ``,`` and ``=`` as ``_`` and ``-``): per step, the epoch (from 0)
and the sample indices trained on; the final weights; and, run as a script, every warning
raised during the run with the step it came before (and its epoch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import warnings
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.contrib.engines.common import setup_common_training_handlers
from ignite.distributed.launcher import Parallel
from ignite.engine import Engine, Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from ignite.utils import manual_seed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nostall

SEED = 7
SAMPLES, BATCH, EPOCHS = 40, 4, 3  # 10 batches per epoch (on two ranks: 10 of 2 on each)
SAVE_EVERY = 13  # iterations: the first checkpoint is after the 3rd batch of epoch 1


@dataclasses.dataclass(frozen=True)
class Run:
    """One run (see the module's docstring for each field)."""

    engine: str = "engine"
    data: str = "loader"
    across: int = 0
    saved: int = 1
    workers: int = 0
    seeded: int = 0
    rng: int = 0
    set_epoch: int = 0
    every: int = SAVE_EVERY
    phase: str = "full"

    @classmethod
    def parse(cls, spec: str) -> Run:
        """``"engine=deterministic,data=nostall"``: the fields named, the others' defaults.

        ``"default"`` is every default (the plain loader under an ``Engine``).
        """
        fields: dict[str, Any] = {}
        for item in spec.split(",") if spec != "default" else []:
            key, _, value = item.partition("=")
            kind = cls.__dataclass_fields__[key].type
            fields[key] = int(value) if kind == "int" else value
        run = cls(**fields)
        assert run.engine in ("engine", "deterministic"), spec
        assert run.data in ("loader", "nostall"), spec
        assert run.phase in ("full", "resume"), spec
        return run

    @property
    def name(self) -> str:
        """The run's folder name: each field that is not its default, in order."""
        default = Run()
        changed = [
            f"{f.name}-{getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return "_".join(changed) or "default"

    @property
    def checkpoints(self) -> str:
        """The folder of the full run's checkpoints, which its resumed run loads."""
        return dataclasses.replace(self, phase="full").name + "-checkpoints"


class GlobalGenerator:
    """torch's global generator as a ``Checkpoint`` object: its state saved and set back."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["state"])


def make_loader(workers: int = 0, seeded: bool = False) -> DataLoader[Any]:
    """Sample i is (i, features, target), shuffled: a batch names the samples it holds."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(SAMPLES, 3, generator=generator)
    dataset = TensorDataset(torch.arange(SAMPLES), features, features.sum(1, keepdim=True))
    options: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
    if seeded:
        options["generator"] = torch.Generator().manual_seed(SEED)
    loader = idist.auto_dataloader(dataset, batch_size=BATCH, shuffle=True, **options)
    assert isinstance(loader, DataLoader)  # on the CPU (an XLA device would get another kind)
    return loader


def features_and_target(
    batch: list[torch.Tensor], device: Any = None, non_blocking: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``create_supervised_trainer``'s ``prepare_batch``: the index stays out of the model."""
    _, features, target = batch
    return features.to(device, non_blocking=non_blocking), target.to(device)


def train(
    run: Run, out: Path, caught: list[warnings.WarningMessage] | None = None
) -> dict[str, Any]:
    """One seeded run as an Ignite user writes it; what this rank trained on, step by step.

    The full run saves its checkpoints in ``out / run.checkpoints``; the resumed one loads the
    first one (at iteration ``run.every``) from there. ``caught``, where given, is the list that
    ``warnings.catch_warnings(record=True)`` fills: the warnings raised since the last step
    are recorded with each step.
    """
    manual_seed(SEED)
    model = idist.auto_model(torch.nn.Linear(3, 1))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    trainer = create_supervised_trainer(
        model,
        optimizer,
        torch.nn.functional.mse_loss,
        device=idist.device(),
        prepare_batch=features_and_target,
        deterministic=run.engine == "deterministic",
    )
    loader = make_loader(run.workers, bool(run.seeded))
    batches: Any = loader
    if run.data == "nostall":
        batches = nostall.prefetch(loader, idist.device(), across_epochs=bool(run.across))
    if run.set_epoch:
        assert isinstance(loader.sampler, DistributedSampler), "set_epoch=1 needs two ranks"
        setup_common_training_handlers(trainer, train_sampler=loader.sampler, with_pbars=False)
    record: dict[str, Any] = {"steps": [], "warnings": []}

    def note_warnings(epoch: int | None) -> None:
        if caught is None:
            return
        for w in caught:
            record["warnings"].append(
                {
                    "step": len(record["steps"]),
                    "epoch": epoch,
                    "category": w.category.__name__,
                    "message": str(w.message),
                    "filename": w.filename,
                }
            )
        caught.clear()

    @trainer.on(Events.ITERATION_COMPLETED)
    def record_step(engine: Engine) -> None:
        epoch = engine.state.epoch - 1
        note_warnings(epoch)
        batch: Any = engine.state.batch  # State annotates it as int | None
        record["steps"].append([epoch, batch[0].tolist()])

    to_save: dict[str, Any] = {"trainer": trainer, "model": model, "optimizer": optimizer}
    if run.data == "nostall" and run.saved:
        to_save["batches"] = batches  # it has state_dict() and load_state_dict()
    if run.rng:
        to_save["rng"] = GlobalGenerator()
    folder = out / run.checkpoints
    if run.phase == "full":
        saver = DiskSaver(folder, require_empty=False)
        checkpoint = Checkpoint(to_save, saver, n_saved=None)
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=run.every), checkpoint)
    else:
        path = folder / f"checkpoint_{run.every}.pt"
        if run.engine == "deterministic":
            # Its rng_states hold NumPy's state, which torch.load(weights_only=True), what
            # load_objects does with a path, refuses: the file is ours, loaded in full.
            Checkpoint.load_objects(to_save, torch.load(path, weights_only=False))
        else:
            Checkpoint.load_objects(to_load=to_save, checkpoint=path)
    trainer.run(batches, max_epochs=EPOCHS)
    if run.data == "nostall":
        batches.close()
    note_warnings(None)
    record["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return record


def write(out: Path, run: Run, record: dict[str, Any]) -> None:
    """OUT/RUN/rankR.json."""
    folder = out / run.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{idist.get_rank()}.json").write_text(json.dumps(record))


def train_all(local_rank: int, out: Path, runs: list[Run]) -> None:
    """Every run in turn on this rank, its warnings recorded."""
    for run in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = train(run, out, caught)
        write(out, run, record)
        idist.barrier()  # the checkpoint and every rank's record are written
    print(f"rank {idist.get_rank()}: done", flush=True)


def free_port() -> int:
    """A port no one listens on now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: list[str] | None = None) -> None:
    """Parse the runs, do them on ``--nproc`` ranks, and write one JSON per run and rank."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", metavar="RUN")
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args(argv)
    runs = [Run.parse(spec) for spec in args.runs]
    if args.nproc == 1:
        train_all(0, args.out, runs)
        return
    parallel = Parallel(backend="gloo", nproc_per_node=args.nproc, master_port=free_port())
    with parallel:
        parallel.run(train_all, args.out, runs)


if __name__ == "__main__":
    main()
