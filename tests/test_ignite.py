"""nostall inside PyTorch-Ignite: ``trainer.run(nostall.prefetch(loader), max_epochs=3)``.

Ignite's ``Engine`` calls ``iter()`` on its data at each epoch, counts ``len(data)`` iterations
per epoch, and takes an epoch's end only at the next epoch's start. Its ``Checkpoint`` saves
the objects of ``to_save`` (the prefetcher among them) and ``Checkpoint.load_objects`` puts
them back; the trainer then goes on from the saved iteration. Each test trains the same seeded
model (tests/frameworks/ignite_run.py) over the loader and over nostall and compares the
samples of every step and the final weights: in this process, after a resume in a fresh
process, under ``DeterministicEngine``, and on two CPU ranks (gloo) started by
``ignite.distributed.Parallel``, with and without the handler that sets the
``DistributedSampler``'s epoch.

``make test`` runs the first four: two runs here and one resume in a fresh process, and the
example of docs/clients/ignite.md; the others are the ``frameworks`` tier (``make
test-frameworks``).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_torchrun_finished, run_process_group

with warnings.catch_warnings():
    # ignite.handlers imports torch.distributed.optim, which torch.jit decorates on import: a
    # deprecation of torch's own, raised where no other test imported that module first.
    warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
    pytest.importorskip("ignite")
    from frameworks import ignite_run
    from frameworks.ignite_run import EPOCHS, SAVE_EVERY, Run, train

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "frameworks" / "ignite_run.py"

Record = dict[str, Any]
Ranks = dict[int, Record]

#: The nostall warning pyproject.toml ignores in every test: an epoch opened ahead drew from
#: torch's global generator (idist.auto_dataloader gives the loader no generator of its own).
DRAWN_AHEAD = "nostall: across_epochs=True opened this epoch ahead"


def launch(out: Path, runs: list[str], nproc: int = 1) -> dict[str, Ranks]:
    """ignite_run.py's ``runs`` in fresh processes: one, or ``nproc`` ranks (Parallel spawns).

    What each rank of each run recorded, by run. If it hangs, every rank is stopped.
    """
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, str(SCRIPT), str(out), *runs, "--nproc", str(nproc)]
    done = run_process_group(command, timeout=300, env=env)
    assert_torchrun_finished(done, [f"rank {r}: done" for r in range(nproc)])
    return {spec: read(out, Run.parse(spec), nproc) for spec in runs}


def read(out: Path, run: Run, nproc: int = 1) -> Ranks:
    """The records the run's ranks wrote."""
    folder = out / run.name
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)}


def epochs(record: Record) -> list[list[list[int]]]:
    """Each epoch's batches, as sample indices."""
    return [[s[1] for s in record["steps"] if s[0] == e] for e in range(EPOCHS)]


def nostall_warnings(record: Record) -> list[dict[str, Any]]:
    """The warnings nostall raised in a run, but the one pyproject.toml ignores in every test."""
    return [
        w
        for w in record["warnings"]
        if w["message"].startswith("nostall") and not w["message"].startswith(DRAWN_AHEAD)
    ]


def assert_same_or_warned(expected: Record, actual: Record, warned: str) -> None:
    """The same epochs; or, by the first epoch that differs, a UserWarning matching ``warned``.

    Before that epoch's last batch was trained on (a record files a warning under the step it
    came before): during it, or earlier (a warning said once, at the first epoch that could
    differ, when a race left that one as the loader's).
    """
    if expected["steps"] == actual["steps"]:
        assert expected["weights"] == actual["weights"]
        return
    differs = next(
        e for e, (x, y) in enumerate(zip(epochs(expected), epochs(actual), strict=True)) if x != y
    )
    steps = [i for i, s in enumerate(actual["steps"]) if s[0] == differs]
    matching = [
        w
        for w in actual["warnings"]
        if w["category"] == "UserWarning" and re.search(warned, w["message"])
    ]
    assert matching, (
        f"epoch {differs} trained on other batches than the loader gives, and no UserWarning "
        f"matching {warned!r} was raised; the run's warnings: {actual['warnings']}"
    )
    assert matching[0]["step"] <= steps[-1], (  # said during that epoch, or before it
        f"epoch {differs} (steps {steps[0]} to {steps[-1]}) differs from the loader's, but the "
        f"warning came only before step {matching[0]['step']}: {matching[0]['message']}"
    )


def trained_instead(full: Record, again: Record, start: int) -> str:
    """Which of the uninterrupted run's steps each step of the resumed run trained on."""
    where = {json.dumps(step[1]): i for i, step in enumerate(full["steps"])}
    trained = [where.get(json.dumps(step[1]), "?") for step in again["steps"]]
    return f"after step {start}, the resumed run trained on the full run's steps {trained}"


# -- one process: Engine over the loader and over nostall, and a resume in a fresh process -------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Record]:
    """The loader's run and nostall's (saving checkpoints) here, then a resume in a new process.

    The loader has a seeded ``generator=``: an ``Engine``'s checkpoint does not hold torch's
    global generator, from which the epochs after the resumed one would draw their orders.
    """
    out = tmp_path_factory.mktemp("ignite-engine")
    full = ("seeded=1", "data=nostall,seeded=1", *DETERMINISTIC)
    runs = {spec: train(Run.parse(spec), out) for spec in full}
    resumes = [f"{spec},phase=resume" for spec in ("data=nostall,seeded=1", *DETERMINISTIC)]
    runs.update({spec: ranks[0] for spec, ranks in launch(out, resumes).items()})
    return runs


#: A ``DeterministicEngine`` over nostall, the prefetcher in ``to_save`` and left out of it.
DETERMINISTIC = ("engine=deterministic,data=nostall", "engine=deterministic,data=nostall,saved=0")


def test_engine_trains_on_the_loaders_batches(engine: dict[str, Record]) -> None:
    """Over ``nostall.prefetch(loader)``, every step's samples and the weights: the loader's."""
    expected, actual = engine["seeded=1"], engine["data=nostall,seeded=1"]
    assert expected == actual
    orders = epochs(expected)
    assert orders[0] != orders[1] != orders[2]  # each epoch its own order


@pytest.mark.timeout(300)
def test_engine_resumes_mid_epoch_in_a_fresh_process(engine: dict[str, Record]) -> None:
    """Checkpoint saved after iteration 13 (mid-epoch 1), loaded in a new process: the rest.

    ``Checkpoint.load_objects`` puts the trainer's count, the model, the optimizer and the
    prefetcher back; ``trainer.run(batches, max_epochs=3)`` trains, step by step, on what the
    uninterrupted run trained on after the checkpoint, and ends with its weights.
    """
    expected, resumed = engine["seeded=1"], engine["data=nostall,seeded=1,phase=resume"]
    assert expected["steps"][SAVE_EVERY:] == resumed["steps"]
    assert expected["weights"] == resumed["weights"]


def test_deterministic_engine_resumes_without_skipping_twice(engine: dict[str, Record]) -> None:
    """The prefetcher in ``to_save``: the uninterrupted run's steps after the checkpoint.

    Resumed mid-epoch, a ``DeterministicEngine`` pulls and drops ``iteration % len(data)``
    batches from data that is no ``DataLoader``; the prefetcher, restored, already starts
    after them, and hands the engine placeholders to drop instead of skipping them again.
    """
    spec = DETERMINISTIC[0]
    full, again = engine[spec], engine[f"{spec},phase=resume"]
    assert full["steps"][SAVE_EVERY:] == again["steps"], trained_instead(full, again, SAVE_EVERY)
    assert full["weights"] == again["weights"]
    assert [] == nostall_warnings(again)


def test_deterministic_engine_resuming_a_prefetcher_left_out_of_to_save_is_warned(
    engine: dict[str, Record],
) -> None:
    """The engine drops batches of an epoch the prefetcher opened afresh: said, with the fix."""
    spec = DETERMINISTIC[1]
    full, again = engine[spec], engine[f"{spec},phase=resume"]
    assert full["steps"][SAVE_EVERY:] != again["steps"]
    said = [w["message"] for w in nostall_warnings(again)]
    assert any("pulling and dropping 3 batches" in m and "to_save" in m for m in said), said


# -- the example -----------------------------------------------------------------------------------


def run_example(checkpoint: Path, *args: str) -> None:
    """examples/ignite_train.py as `python examples/ignite_train.py ...` runs it (in-process)."""
    argv = [str(ROOT / "examples" / "ignite_train.py"), "--checkpoint", str(checkpoint), *args]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv)
        runpy.run_path(argv[0], run_name="__main__")


def test_the_pages_code_is_the_example() -> None:
    """docs/clients/ignite.md's one python block is examples/ignite_train.py, run below."""
    text = (ROOT / "docs" / "clients" / "ignite.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)\n```$", text, flags=re.DOTALL | re.MULTILINE)
    assert [(ROOT / "examples" / "ignite_train.py").read_text().rstrip("\n")] == blocks


def test_the_example_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """Stopped after 21 iterations (mid-epoch 1), resumed from its checkpoint at 20.

    The resumed run ends with the uninterrupted run's weights, bit for bit.
    """
    run_example(tmp_path / "uninterrupted")
    with pytest.raises(SystemExit):
        run_example(tmp_path / "resumed", "--stop-after", "21")
    assert not (tmp_path / "resumed" / "final.pt").exists()
    run_example(tmp_path / "resumed", "--resume-from", str(tmp_path / "resumed/checkpoint_20.pt"))
    expected = torch.load(tmp_path / "uninterrupted" / "final.pt")
    actual = torch.load(tmp_path / "resumed" / "final.pt")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


# -- frameworks tier: more loaders, more resumes, DeterministicEngine ------------------------------

#: Loader settings, each run over the loader and over nostall. "unseeded": the loader shuffles
#: from torch's global generator (its epochs ahead warn, as pyproject.toml lets them).
VARIANTS = {
    "across-epochs": ("seeded=1", "data=nostall,seeded=1,across=1"),
    "workers": ("seeded=1,workers=2", "data=nostall,seeded=1,workers=2"),
    "workers-across-epochs": ("seeded=1,workers=2", "data=nostall,seeded=1,workers=2,across=1"),
    "unseeded": ("default", "data=nostall"),
    "unseeded-across-epochs": ("default", "data=nostall,across=1"),
}

#: Resumed in a fresh process: nostall's full run with the same settings is the reference (it
#: trains as the loader's, above). "at-epoch-end": the checkpoint of iteration 20, after epoch
#: 1's last batch; "unseeded-rng": the global generator's state in to_save too.
RESUMED = {
    "across-epochs": "data=nostall,seeded=1,across=1",
    "workers": "data=nostall,seeded=1,workers=2",
    "workers-across-epochs": "data=nostall,seeded=1,workers=2,across=1",
    "at-epoch-end": "data=nostall,seeded=1,every=20",
    "unseeded-rng": "data=nostall,rng=1",
}


@pytest.mark.frameworks
@pytest.mark.usefixtures("fast_worker_shutdown")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_variants_train_on_the_loaders_batches(tmp_path: Path, variant: str) -> None:
    """Workers, ``across_epochs=True``, the global generator: the loader's steps and weights.

    (The loader's own run leaves its last epoch's iterator unfinished, as the Engine counts the
    batches: its persistent workers take torch's status interval each to stop, 5 s by default,
    which ``fast_worker_shutdown`` shortens.)
    """
    loader, prefetched = VARIANTS[variant]
    assert train(Run.parse(loader), tmp_path) == train(Run.parse(prefetched), tmp_path)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Record, Record]]:
    """Each of RESUMED: its full run here (saving checkpoints), then all resumed in one process.

    The full runs go in this process, where warnings are errors; the resumed ones record theirs.
    """
    out = tmp_path_factory.mktemp("ignite-resumed")
    full = {name: train(Run.parse(spec), out) for name, spec in RESUMED.items()}
    specs = {name: f"{spec},phase=resume" for name, spec in RESUMED.items()}
    again = launch(out, list(specs.values()))
    return {name: (full[name], again[specs[name]][0]) for name in RESUMED}


@pytest.mark.frameworks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(RESUMED))
def test_engine_resumes_in_a_fresh_process(
    resumed: dict[str, tuple[Record, Record]], variant: str
) -> None:
    """From the checkpoint, the uninterrupted run's steps and weights."""
    full, again = resumed[variant]
    every = Run.parse(RESUMED[variant]).every
    assert full["steps"][every:] == again["steps"], trained_instead(full, again, every)
    assert full["weights"] == again["weights"]


@pytest.mark.frameworks
@pytest.mark.parametrize("across", [0, 1], ids=["per-epoch", "across-epochs"])
def test_deterministic_engine_trains_as_over_its_loader(tmp_path: Path, across: int) -> None:
    """A ``DeterministicEngine`` seeds torch's global generator before each epoch's ``iter()``.

    The loader draws its order from that generator: over nostall, the same orders; or, where
    nostall opened an epoch ahead (``across_epochs=True``), before the engine seeded it, a
    warning that it drew from the global generator ahead, at the first epoch that differs.
    """
    expected = train(Run.parse("engine=deterministic"), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = f"engine=deterministic,data=nostall,across={across}"
        actual = train(Run.parse(spec), tmp_path, caught)
    assert_same_or_warned(expected, actual, r"(?s)^nostall: .*global generator")
    others = [w for w in actual["warnings"] if not w["message"].startswith("nostall")]
    assert [] == others


# -- two ranks (gloo), spawned by ignite.distributed.Parallel --------------------------------------

#: idist.auto_dataloader(dataset, batch_size=4, shuffle=True): a DistributedSampler on each rank.
#: "set_epoch=1": setup_common_training_handlers(trainer, train_sampler=loader.sampler).
RANK_RUNS = [
    "default",
    "data=nostall",
    "data=nostall,across=1",
    "set_epoch=1",
    "data=nostall,across=1,set_epoch=1",
    "data=nostall,set_epoch=1",
]
RANK_RESUMES = ["data=nostall,across=1,set_epoch=1,phase=resume"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Every run on two ranks, then a resume in two fresh ones (rank 0's checkpoint for both)."""
    out = tmp_path_factory.mktemp("ignite-ranks")
    runs = launch(out, RANK_RUNS, nproc=2)
    runs.update(launch(out, RANK_RESUMES, nproc=2))
    return runs


@pytest.mark.frameworks
@pytest.mark.timeout(600)
def test_ranks_split_each_epoch_and_repeat_it_without_set_epoch(ranks: dict[str, Ranks]) -> None:
    """The reference: the samplers split the data; without the handler, one order every epoch."""
    for spec in ("default", "set_epoch=1"):
        run = ranks[spec]
        for epoch in range(EPOCHS):
            parts = [i for r in (0, 1) for batch in epochs(run[r])[epoch] for i in batch]
            assert sorted(parts) == list(range(ignite_run.SAMPLES)), f"{spec}, epoch {epoch}"
        assert run[0]["weights"] == run[1]["weights"], spec  # DDP: the same model on each
    for r in (0, 1):
        forgot, handled = epochs(ranks["default"][r]), epochs(ranks["set_epoch=1"][r])
        assert forgot[0] == forgot[1] == forgot[2], f"rank {r}"
        assert handled[0] == forgot[0], f"rank {r}"
        assert handled[0] != handled[1] != handled[2], f"rank {r}"


@pytest.mark.frameworks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("across", [0, 1], ids=["per-epoch", "across-epochs"])
def test_ranks_without_set_epoch_train_as_the_loader_or_warn(
    ranks: dict[str, Ranks], across: int
) -> None:
    """The user forgot the set_epoch handler: the loader's batches, or a warning naming set_epoch.

    Each rank trains on what the loader gives it (one order every epoch), or nostall, having
    set an epoch the loop never set, says so with a UserWarning naming ``set_epoch`` during
    the first epoch that differs.
    """
    spec = "data=nostall" + (",across=1" if across else "")
    for r in (0, 1):
        assert_same_or_warned(ranks["default"][r], ranks[spec][r], r"set_epoch")


@pytest.mark.frameworks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("across", [0, 1], ids=["per-epoch", "across-epochs"])
def test_ranks_with_set_epoch_train_as_the_loader_without_a_warning(
    ranks: dict[str, Ranks], across: int
) -> None:
    """With the handler that sets the sampler's epoch: each rank's steps and weights, no warning.

    (But the one pyproject.toml ignores everywhere: with ``across_epochs=True`` the epochs
    opened ahead draw the loader's base seed from torch's global generator.)
    """
    spec = "data=nostall" + (",across=1" if across else "") + ",set_epoch=1"
    for r in (0, 1):
        expected, actual = ranks["set_epoch=1"][r], ranks[spec][r]
        assert expected["steps"] == actual["steps"], f"rank {r}"
        assert expected["weights"] == actual["weights"], f"rank {r}"
        assert [] == nostall_warnings(actual), f"rank {r}"
        assert [] == [w for w in actual["warnings"] if not w["message"].startswith("nostall")]


@pytest.mark.frameworks
@pytest.mark.timeout(600)
def test_ranks_resume_mid_epoch_in_fresh_processes(ranks: dict[str, Ranks]) -> None:
    """Rank 0's checkpoint (mid-epoch 1), loaded by both new ranks: each its own rest."""
    full = ranks["data=nostall,across=1,set_epoch=1"]
    again = ranks["data=nostall,across=1,set_epoch=1,phase=resume"]
    for r in (0, 1):
        assert full[r]["steps"][SAVE_EVERY:] == again[r]["steps"], f"rank {r}"
        assert full[r]["weights"] == again[r]["weights"], f"rank {r}"
