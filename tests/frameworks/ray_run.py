"""Train a tiny model with Ray Train on its prepared loader or through nostall; record it all.

tests/test_ray.py starts a local Ray cluster and calls :func:`fit`, which runs
:func:`train_loop_per_worker` with ``TorchTrainer`` on two CPU workers (Ray sets up
``torch.distributed`` with gloo between them). The worker processes import this module by name
(the test puts tests/ on their ``PYTHONPATH``).

``config["runs"]`` lists the runs, done one after the other in the same workers. A run is
MODE:ACROSS:PHASE, or ``reverse``:

* MODE is plain (``ray.train.torch.prepare_data_loader(loader)`` itself), nostall
  (``nostall.prefetch(prepare_data_loader(loader), device, across_epochs=...)``), unmoved (the
  same over ``prepare_data_loader(loader, move_to_device=False)``: nostall moves the batches),
  shard (``nostall.prefetch(loader, device, shard=True, across_epochs=...)`` over the raw
  loader, with ``batches.set_epoch`` in the loop) or threads (shard's with ``threads=2``).
  Over Ray's loader the loop calls ``loader.sampler.set_epoch(epoch)``, as Ray's
  documentation has its users do.
* ACROSS is 0 or 1 for ``across_epochs``.
* PHASE is full (from the start; nostall and shard runs save a checkpoint after SAVE_AT steps,
  mid-epoch 1, with ``ray.train.report(..., checkpoint=...)``, and go on) or resume (a fresh
  model, optimizer and loader, loaded from ``config["checkpoints"][MODE:ACROSS]``, a
  ``ray.train.Checkpoint`` of a full run, then the rest of the run).
* ``reverse`` hands a prefetcher to ``prepare_data_loader`` and records whether it was refused
  with a ``TypeError`` naming ``prepare_data_loader``.

Every worker writes OUT/RUN/rankR.json (``:`` written as ``-``): per step, the epoch and the
sample indices trained on; the final weights; the warnings the run raised; the nostall
threads still alive 5 s after it (tests/conftest.py's check, made in the worker).

Before the runs, when ``config["page"]`` is given, it is called with ``config["page_config"]``:
a docs page's training function, run in the same workers. It goes first, so that
``ray.train.get_checkpoint()`` there finds no checkpoint of the runs (it returns the latest one
reported in this ``fit()`` so far).
"""

from __future__ import annotations

import gc
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray.train
import ray.train.torch
import torch
from helpers import wait_for_no_nostall_threads
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nostall

SEED = 7
SAMPLES, BATCH, EPOCHS = 48, 4, 3  # two workers: 6 batches each per epoch, 18 steps in all
WORKERS = 2
SAVE_AT = 10  # the 4th batch of epoch 1
MODES = ("plain", "nostall", "unmoved", "shard", "threads")


def make_loader() -> DataLoader[Any]:
    """Sample i is (i, features, target), shuffled: a batch names the samples it holds."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(SAMPLES, 3, generator=generator)
    dataset = TensorDataset(torch.arange(SAMPLES), features, features.sum(1, keepdim=True))
    return DataLoader(dataset, batch_size=BATCH, shuffle=True)


def train(mode: str, across: bool, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """One seeded run as a Ray Train user writes it; what this worker trained on, step by step.

    A full nostall or shard run reports a checkpoint after SAVE_AT steps: this worker's model,
    optimizer, step and ``batches.state_dict()`` in ``rank{R}.pt``. With ``checkpoint`` the run
    starts from there.
    """
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    torch.manual_seed(SEED)
    model = ray.train.torch.prepare_model(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader: Any = None
    if mode in ("shard", "threads"):  # the raw loader: nostall gives each worker its part
        threads = 2 if mode == "threads" else None
        batches: Any = nostall.prefetch(
            make_loader(), device, shard=True, threads=threads, across_epochs=across
        )
    else:
        moved = mode != "unmoved"
        loader = ray.train.torch.prepare_data_loader(make_loader(), move_to_device=moved)
        batches = loader
        if mode != "plain":
            batches = nostall.prefetch(loader, device, across_epochs=across)
    step = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / f"rank{rank}.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["data"])
        step = state["step"]
    record: dict[str, Any] = {"steps": []}
    for epoch in range(0 if mode == "plain" else batches.epoch, EPOCHS):
        if loader is None:
            batches.set_epoch(epoch)
        elif isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for index, features, target in batches:
            loss = torch.nn.functional.mse_loss(model(features), target)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            record["steps"].append([epoch, index.tolist()])
            step += 1
            if step == SAVE_AT and checkpoint is None and mode != "plain":
                save(f"{mode}:{int(across)}", rank, step, model, optimizer, batches)
    if mode != "plain":
        batches.close()
    record["weights"] = [v for p in model.parameters() for v in p.detach().flatten().tolist()]
    return record


def save(run: str, rank: int, step: int, model: Any, optimizer: Any, batches: Any) -> None:
    """Report a checkpoint of this worker's state (every worker reports, at the same step)."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data": batches.state_dict(),
        "step": step,
    }
    with tempfile.TemporaryDirectory() as folder:
        torch.save(state, Path(folder) / f"rank{rank}.pt")
        checkpoint = Checkpoint.from_directory(folder)
        ray.train.report({"run": run, "step": step}, checkpoint=checkpoint)


def reverse() -> dict[str, Any]:
    """``prepare_data_loader(nostall.prefetch(loader))``: refused, naming the order that works.

    The expectation is checked here, in the worker, with ``pytest.raises``; what happened is
    recorded for the test: ``outcome`` is "refused" or the failure's text, and when the call
    returned, what it returned.
    """
    batches = nostall.prefetch(make_loader(), ray.train.torch.get_device())
    record: dict[str, Any] = {"outcome": "refused"}
    prepared: Any = None
    try:
        with pytest.raises(TypeError, match="prepare_data_loader") as refused:
            prepared = ray.train.torch.prepare_data_loader(batches)  # type: ignore[arg-type]
        record["message"] = str(refused.value)
    except (pytest.fail.Exception, Exception) as failed:  # DID NOT RAISE, or not matched
        record["outcome"] = f"{type(failed).__name__}: {failed}"
    if prepared is not None:
        inner = getattr(prepared, "_dataloader", prepared)
        record["returned"] = type(prepared).__qualname__
        record["iterates"] = type(inner).__qualname__
        record["sampler"] = type(inner.sampler).__qualname__
        record["nostall_inside"] = any(
            isinstance(x, nostall.Prefetcher) for x in (prepared, inner, inner.dataset)
        )
    batches.close()
    return record


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Call ``config["page"]``, then do ``config["runs"]`` and write every run's record."""
    rank = ray.train.get_context().get_world_rank()
    page: Callable[[dict[str, Any]], None] | None = config.get("page")
    if page is not None:
        page(config["page_config"])
    checkpoints: dict[str, Checkpoint] = config.get("checkpoints", {})
    for spec in config["runs"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if spec == "reverse":
                record = reverse()
            else:
                mode, across, phase = spec.split(":")
                assert mode in MODES, spec
                assert across in ("0", "1"), spec
                assert phase in ("full", "resume"), spec
                resume = checkpoints[f"{mode}:{across}"] if phase == "resume" else None
                record = train(mode, across == "1", resume)
        record["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        gc.collect()  # as tests/conftest.py does after each test, then the same wait
        record["threads_left"] = [t.name for t in wait_for_no_nostall_threads(timeout=5.0)]
        folder = Path(config["out"]) / spec.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps(record))


def fit(
    out: Path,
    name: str,
    runs: list[str],
    *,
    checkpoints: dict[str, Checkpoint] | None = None,
    page: Callable[[dict[str, Any]], None] | None = None,
    page_config: dict[str, Any] | None = None,
) -> ray.train.Result:
    """Run :func:`train_loop_per_worker` with ``TorchTrainer`` on two CPU workers.

    The run ``name`` keeps its checkpoints under ``out/ray``; the records go to ``out``.
    """
    config = {
        "out": str(out),
        "runs": runs,
        "checkpoints": checkpoints or {},
        "page": page,
        "page_config": page_config or {},
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(out / "ray")),
    )
    return trainer.fit()


def records(out: Path, spec: str) -> dict[int, dict[str, Any]]:
    """Every worker's record of run ``spec``, by rank."""
    folder = out / spec.replace(":", "-")
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORKERS)}


def reported(result: ray.train.Result) -> dict[str, Checkpoint]:
    """The checkpoints the full runs reported, by MODE:ACROSS."""
    return {
        metrics["run"]: checkpoint
        for checkpoint, metrics in result.best_checkpoints or []
        if "run" in metrics
    }


def page_checkpoints(result: ray.train.Result) -> dict[int, Checkpoint]:
    """The checkpoints a page's function reported (metrics without ``run``), by step."""
    return {
        metrics["step"]: checkpoint
        for checkpoint, metrics in result.best_checkpoints or []
        if "run" not in metrics
    }
