"""Train a tiny model with Lightning Fabric on its own loader or through nostall; record it all.

tests/test_fabric.py imports :func:`train` for runs in one process, and runs this file as a
script for DDP (``fabric.launch()`` starts the script again for every other rank):

    python tests/frameworks/fabric_run.py OUT --devices 2 plain:0:full nostall:1:full ...

Each RUN is MODE:ACROSS:PHASE. MODE is plain (``fabric.setup_dataloaders(loader)`` itself),
nostall (``nostall.prefetch(fabric.setup_dataloaders(loader))``) or threads
(``nostall.prefetch(loader, fabric.device, shard=True, threads=2)`` over the raw loader, with
``set_epoch`` in the loop); ACROSS is 0 or 1 for ``across_epochs``; PHASE is full (from the
start, saving a checkpoint with ``fabric.save`` after SAVE_AT steps, mid-epoch 1, and going on)
or resume (a fresh model and loader resumed with ``fabric.load`` from the full run's
checkpoint). The runs go one after the other in the same processes. Every rank writes
OUT/MODE-ACROSS-PHASE/rankR.json: per step, the epoch and the sample indices trained on; the
steps at which the optimizer stepped (gradient-accumulation boundaries); the final weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nostall

SEED = 7
SAMPLES, BATCH, EPOCHS = 40, 4, 3
ACCUMULATE = 3  # optimizer steps every 3 batches, across epoch ends too
SAVE_AT = 6  # with 2 ranks: 5 batches per epoch, so the checkpoint is mid-epoch 1
MODES = ("plain", "nostall", "threads")


def make_loader(sampler: str = "shuffle") -> DataLoader[Any]:
    """Sample i is (i, features, target), shuffled: a batch names the samples it holds.

    ``sampler``: "shuffle" (``shuffle=True``; under DDP Fabric puts a DistributedSampler in its
    place) or "distributed" (a one-replica DistributedSampler of the user's own, whose epoch
    Fabric sets at each ``iter()``).
    """
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(SAMPLES, 3, generator=generator)
    dataset = TensorDataset(torch.arange(SAMPLES), features, features.sum(1, keepdim=True))
    if sampler == "distributed":
        shard: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=1, rank=0, seed=SEED
        )
        return DataLoader(dataset, batch_size=BATCH, sampler=shard)
    assert "shuffle" == sampler, sampler
    return DataLoader(dataset, batch_size=BATCH, shuffle=True)


def train(
    fabric: Fabric,
    mode: str,
    across: bool,
    checkpoint: Path,
    *,
    resume: bool = False,
    sampler: str = "shuffle",
    save_at: int = SAVE_AT,
) -> dict[str, Any]:
    """One seeded run as a Fabric user writes it; what this rank trained on, step by step.

    It saves ``checkpoint`` after ``save_at`` steps (at an accumulation boundary: a multiple of
    ACCUMULATE), or with ``resume`` starts from it.
    """
    fabric.seed_everything(SEED, verbose=False)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    if mode == "threads":  # the raw loader: nostall shards it and loads it with threads
        batches: Any = nostall.prefetch(
            make_loader(sampler), fabric.device, shard=True, threads=2, across_epochs=across
        )
    else:
        batches = fabric.setup_dataloaders(make_loader(sampler))
        if mode == "nostall":
            batches = nostall.prefetch(batches, across_epochs=across)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if mode != "plain":
        state["data"] = batches  # a Stateful: fabric.save and fabric.load call it
    if resume:
        fabric.load(checkpoint, state)
    step = state["step"]
    record: dict[str, Any] = {"steps": [], "boundaries": []}
    for epoch in range(0 if mode == "plain" else batches.epoch, EPOCHS):
        if mode == "threads":
            batches.set_epoch(epoch)  # Fabric sets it only on loaders it set up
        for index, features, target in batches:
            accumulating = (step + 1) % ACCUMULATE != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = torch.nn.functional.mse_loss(model(features), target)
                fabric.backward(loss)
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()
                record["boundaries"].append(step)
            record["steps"].append([epoch, index.tolist()])
            step += 1
            if step == save_at and not resume:
                state["step"] = step
                fabric.save(checkpoint, state)
    if mode != "plain":
        batches.close()
    record["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return record


def main(argv: list[str] | None = None) -> None:
    """Parse the runs, do them, and write one JSON per run and rank."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", metavar="MODE:ACROSS:PHASE")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)
    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    for spec in args.runs:
        mode, across, phase = spec.split(":")
        if mode not in MODES or across not in ("0", "1") or phase not in ("full", "resume"):
            parser.error(f"bad run {spec!r}")
        checkpoint = args.out / f"{mode}-{across}.ckpt"
        record = train(fabric, mode, across == "1", checkpoint, resume=phase == "resume")
        folder = args.out / spec.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
        fabric.barrier()  # the checkpoint and every rank's record are written
    print(f"rank {fabric.global_rank}: done", flush=True)


if __name__ == "__main__":
    main()
