"""nostall inside Lightning Fabric: ``nostall.prefetch(fabric.setup_dataloaders(loader))``.

Fabric's loader (``_FabricDataLoader``) sets its sampler's epoch at each ``iter()`` from its own
count of ``iter()`` calls, and under DDP it injects a ``DistributedSampler``. Each test trains
the same seeded model (tests/frameworks/fabric_run.py) on Fabric's own loader and through
nostall, and compares the samples of every step, the steps at which the optimizer stepped
(gradient accumulation with ``fabric.no_backward_sync``) and the final weights; under DDP on
two CPU ranks (gloo), rank by rank, and after a mid-epoch resume in a fresh process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    as_dataset,
    assert_torchrun_finished,
    lightning_seed_unset,
    run_process_group,
    run_torchrun,
)

import nostall

pytest.importorskip("lightning")

from frameworks import fabric_run
from frameworks.fabric_run import SAVE_AT, make_loader, train
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "frameworks" / "fabric_run.py"

pytestmark = [
    # Fabric's advice on the tiny loaders (no workers) and on seeding: its own noise.
    pytest.mark.filterwarnings("ignore:The dataloader, .*, does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]


@pytest.fixture(autouse=True)
def _restore_seed_environment() -> Iterator[None]:
    """fabric.seed_everything() exports PL_GLOBAL_SEED; other tests must not inherit it."""
    with lightning_seed_unset():
        yield


@pytest.fixture(scope="module")
def fabric() -> Fabric:
    """One CPU device, in this process."""
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


# -- one process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["shuffle", "distributed"])
@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_same_steps_and_weights_as_fabrics_loader(
    fabric: Fabric, tmp_path: Path, across: bool, sampler: str
) -> None:
    """The samples of every step, the accumulation boundaries and the weights: all Fabric's."""
    expected = train(fabric, "plain", False, tmp_path / "plain.ckpt", sampler=sampler)
    actual = train(fabric, "nostall", across, tmp_path / "nostall.ckpt", sampler=sampler)
    assert expected == actual
    epochs = [[s[1] for s in expected["steps"] if s[0] == e] for e in range(fabric_run.EPOCHS)]
    assert epochs[0] != epochs[1] != epochs[2]  # each epoch its own order


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_resume_mid_epoch_over_a_new_fabric_loader(
    fabric: Fabric, tmp_path: Path, across: bool
) -> None:
    """fabric.load of the prefetcher saved mid-epoch 1 (of 10 batches): the rest of the run.

    The loader has a DistributedSampler, whose orders Fabric's count of iter() calls decides;
    the new loader's count starts at 0, as in a new process.
    """
    save_at = 12  # the 3rd batch of epoch 1, at an accumulation boundary
    run: dict[str, Any] = {"sampler": "distributed", "save_at": save_at}
    checkpoint = tmp_path / "nostall.ckpt"
    expected = train(fabric, "plain", False, tmp_path / "plain.ckpt", sampler="distributed")
    train(fabric, "nostall", across, checkpoint, **run)  # saves after save_at steps
    resumed = train(fabric, "nostall", across, checkpoint, resume=True, **run)
    assert expected["steps"][save_at:] == resumed["steps"]
    assert [b for b in expected["boundaries"] if b >= save_at] == resumed["boundaries"]
    assert expected["weights"] == resumed["weights"]


@pytest.mark.parametrize("after_end", [False, True], ids=["last-batch", "after-the-end"])
def test_resume_at_an_epoch_end_over_a_new_fabric_loader(fabric: Fabric, after_end: bool) -> None:
    """A state saved at epoch 1's end names epoch 2, and a new Fabric loader draws epoch 2's order.

    Saved after the last batch (inside the loop), or after the loop took the epoch's end.
    """
    # A _FabricDataLoader, which Fabric's annotation calls a DataLoader or a list of them.
    reference: Any = fabric.setup_dataloaders(make_loader("distributed"))
    orders = [[b[0].tolist() for b in reference] for _ in range(3)]
    batches = nostall.prefetch(fabric.setup_dataloaders(make_loader("distributed")))
    state: dict[str, Any] = {}
    for _ in range(2):
        for _batch in batches:
            state = batches.state_dict()
    if after_end:
        state = batches.state_dict()
    batches.close()
    assert 2 == state["epoch"]
    resumed = nostall.prefetch(fabric.setup_dataloaders(make_loader("distributed")))
    resumed.load_state_dict(state)
    assert orders[2] == [b[0].tolist() for b in resumed]
    assert 3 == resumed.epoch
    resumed.close()


class CountingDataset(Dataset[int]):
    """Sample i is i; counts the samples loaded."""

    def __init__(self) -> None:
        self.loads = 0

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        self.loads += 1
        return index


@pytest.mark.parametrize("saved_after", [13, 20], ids=["mid-epoch", "at-the-end"])
def test_resume_loads_no_skipped_sample(fabric: Fabric, saved_after: int) -> None:
    """Resumed in epoch 1, Fabric's loader skips what was trained on through its sampler.

    Saved after 3 batches of epoch 1, or after its last one: only what comes next is loaded.
    """

    def make() -> Any:
        data = CountingDataset()
        sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
        return fabric.setup_dataloaders(DataLoader(data, batch_size=4, sampler=sampler))

    reference = make()
    orders = [[b.tolist() for b in reference] for _ in range(3)]
    batches = nostall.prefetch(make())
    steps = iter(b.tolist() for epoch in range(3) for b in batches)
    for _ in range(saved_after):
        next(steps)
    state = batches.state_dict()
    batches.close()
    loader = make()
    resumed = nostall.prefetch(loader)
    resumed.load_state_dict(state)
    rest = [b.tolist() for epoch in range(resumed.epoch, 3) for b in resumed]
    assert (orders[1] + orders[2])[saved_after - 10 :] == rest
    assert 4 * len(rest) == loader.dataset.loads
    resumed.close()


def test_loading_threads_over_fabrics_loader_name_what_works(fabric: Fabric) -> None:
    """threads= cannot load Fabric's loader; the refusal gives the route that works."""
    loader = fabric.setup_dataloaders(fabric_run.make_loader())
    with pytest.raises(TypeError) as refused:
        nostall.prefetch(loader, threads=2)
    message = str(refused.value)
    assert "threads=2, shard=True" in message
    assert "nostall.prefetch(loader, fabric.device, threads=2, shard=True)" in message
    assert "set_epoch" in message


# -- DDP: two ranks on the CPU (gloo), started by fabric.launch() --------------------------------

FULL_RUNS = ("plain:0:full", "nostall:0:full", "nostall:1:full", "threads:0:full")
RESUMED_RUNS = ("nostall:0:resume", "nostall:1:resume")

Ranks = dict[int, dict[str, Any]]


def launch(out: Path, runs: tuple[str, ...], *, torchrun: bool = False) -> None:
    """Run fabric_run.py on 2 ranks: rank 0 starting rank 1 (``fabric.launch()``), or torchrun.

    If it hangs, both ranks are stopped (:func:`helpers.run_process_group`).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LT_"))}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    args = [str(out), "--devices", "2", *runs]
    if torchrun:
        done = run_torchrun(SCRIPT, *args, timeout=240, env=env)
    else:
        done = run_process_group([sys.executable, str(SCRIPT), *args], timeout=240, env=env)
    assert_torchrun_finished(done, ["rank 0: done", "rank 1: done"])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Every run, per rank: the full runs in one launch, then the resumed ones in a new one.

    Launched both ways Fabric users launch: the full runs by ``fabric.launch()`` in a script,
    the resumed ones by torchrun (which starts both ranks at once: a few seconds less).
    """
    out = tmp_path_factory.mktemp("fabric-ddp")
    launch(out, FULL_RUNS)
    launch(out, RESUMED_RUNS, torchrun=True)  # fresh processes: Fabric's counts start at 0
    runs: dict[str, Ranks] = {}
    for spec in FULL_RUNS + RESUMED_RUNS:
        folder = out / spec.replace(":", "-")
        runs[spec] = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)}
    return runs


@pytest.mark.timeout(600)
def test_ddp_fabric_splits_each_epoch_between_the_ranks(ddp: dict[str, Ranks]) -> None:
    """The reference itself: Fabric's DistributedSampler, set to a new epoch each epoch."""
    ranks = ddp["plain:0:full"]
    per_epoch = fabric_run.SAMPLES // fabric_run.BATCH // 2
    for epoch in range(fabric_run.EPOCHS):
        parts = [
            [i for step in ranks[r]["steps"] if step[0] == epoch for i in step[1]] for r in (0, 1)
        ]
        assert sorted(parts[0] + parts[1]) == list(range(fabric_run.SAMPLES)), f"epoch {epoch}"
    steps = ranks[0]["steps"]
    assert steps[0][1] != steps[per_epoch][1]  # epoch 1 is not epoch 0's order again
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", ["nostall:0:full", "nostall:1:full", "threads:0:full"])
def test_ddp_same_steps_and_weights_as_fabrics_loader(ddp: dict[str, Ranks], spec: str) -> None:
    """Over Fabric's loader, or threads=2 with shard=True over the raw loader: Fabric's run."""
    for rank in (0, 1):
        assert ddp["plain:0:full"][rank] == ddp[spec][rank], f"rank {rank}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("across", ["0", "1"], ids=["per-epoch", "across-epochs"])
def test_ddp_resume_mid_epoch_in_a_fresh_process(ddp: dict[str, Ranks], across: str) -> None:
    """Saved with fabric.save mid-epoch 1, loaded with fabric.load in new processes.

    Each rank trains on the samples the uninterrupted run trained on from there, step by step,
    with the same accumulation boundaries, and ends with the same weights. (fabric.save writes
    rank 0's state; every rank is at the same step, and its own DistributedSampler.)
    """
    for rank in (0, 1):
        expected = ddp["plain:0:full"][rank]
        resumed = ddp[f"nostall:{across}:resume"][rank]
        assert expected["steps"][SAVE_AT:] == resumed["steps"], f"rank {rank}"
        assert [b for b in expected["boundaries"] if b >= SAVE_AT] == resumed["boundaries"]
        assert expected["weights"] == resumed["weights"], f"rank {rank}"


# -- the example ---------------------------------------------------------------------------------


def run_example(checkpoint: Path, *args: str) -> None:
    """examples/fabric_train.py as `python examples/fabric_train.py ...` runs it (in-process)."""
    argv = [str(ROOT / "examples" / "fabric_train.py"), "--checkpoint", str(checkpoint), *args]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU, as on any machine
        runpy.run_path(argv[0], run_name="__main__")


def test_fabric_example_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """Stopped after 21 steps (mid-epoch 1) and run again: the uninterrupted run's weights."""
    run_example(tmp_path / "uninterrupted")
    with pytest.raises(SystemExit):
        run_example(tmp_path / "resumed", "--stop-after", "21")
    assert not (tmp_path / "resumed" / "final.ckpt").exists()
    run_example(tmp_path / "resumed")
    expected = torch.load(tmp_path / "uninterrupted" / "final.ckpt")["model"]
    actual = torch.load(tmp_path / "resumed" / "final.ckpt")["model"]
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_fabric_loader_is_prefetched_to_fabrics_device_by_default() -> None:
    """Fabric(accelerator="cpu") on a GPU machine: batches stay on the CPU, as Fabric's own.

    Seen on an H100: the prefetcher went to CUDA, and the CPU model met CUDA batches.
    """
    from lightning.fabric.wrappers import _FabricDataLoader
    from simcuda import simulated_cuda

    loader = _FabricDataLoader(
        DataLoader(as_dataset(list(range(8))), batch_size=4), torch.device("cpu")
    )
    with simulated_cuda():
        assert torch.cuda.is_available()  # a GPU machine, as far as nostall can tell
        p = nostall.prefetch(loader)
        assert torch.device("cpu") == p.device
        assert [torch.device("cpu")] * 2 == [b.device for b in p]
        assert torch.device("cuda", 0) == nostall.prefetch(loader, "cuda").device
