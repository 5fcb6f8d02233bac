"""nostall inside Hugging Face accelerate: ``nostall.prefetch(accelerator.prepare(loader))``.

accelerate's prepared loader (a ``DataLoaderShard``) looks one batch ahead of the loop and, while
a batch is handed out, says whether it is the last one (``end_of_dataloader``) and how much of
the last batch is real (``remainder``), through the ``GradientState`` it registers in at the
start of each epoch. ``Accelerator.accumulate`` reads these to decide when gradients are synced,
and ``gather_for_metrics`` to drop padding. So a prefetcher running ``depth`` batches ahead
must show each batch's state when it hands that batch out, not when it fetched it.

Each test runs the plain accelerate loop and the same loop through nostall, on fresh and
identically built objects, and compares them step by step; everything runs on the CPU in one
process except the torchrun test, which starts two.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from helpers import run_torchrun
from torch.utils.data import DataLoader, Dataset, IterableDataset

import nostall

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "frameworks" / "accelerate_run.py"
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
SAMPLES = 38  # 10 batches of 4, the last one of 2
BATCH = 4
BATCHES = 10
ACCUMULATE = 3  # 10 is not a multiple: the epoch's end forces a sync
EPOCHS = 2
SEED = 7


class Indexed(Dataset[dict[str, Any]]):
    """Sample i carries its index, so that every step shows which samples it trained on.

    Counts its loads in this process (with workers=0: what was fetched, ahead or not).
    """

    def __init__(self) -> None:
        self.loads = 0
        self.loaded_by: set[str] = set()  # the names of the threads that loaded, less numbers

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.loads += 1
        self.loaded_by.add(threading.current_thread().name.rsplit("-", 1)[0])
        return {"index": i, "x": torch.tensor([i / SAMPLES, 1.0])}


class Step(NamedTuple):
    """What the loop sees inside ``accelerator.accumulate`` at one step."""

    indices: list[int]
    sync_gradients: bool
    end_of_dataloader: bool
    remainder: int
    iteration: int  # the prepared loader's epoch counter
    active: bool  # the prepared loader is the GradientState's active dataloader


class EpochEnd(NamedTuple):
    """What the loop sees after an epoch's ``for`` ended."""

    in_dataloader: bool
    iteration: int


class Run(NamedTuple):
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any
    loader: Any  # the prepared DataLoaderShard


def reset_accelerate() -> None:
    """Forget the process-wide accelerate singletons (as accelerate's own tests do)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    reset_accelerate()
    yield
    reset_accelerate()


def build(
    workers: int = 0, config: DataLoaderConfiguration | None = None, seeded: bool = True
) -> Run:
    """A fresh Accelerator and a prepared model, optimizer and shuffled loader.

    ``seeded``: the loader draws its order from its own seeded ``generator=``.
    """
    reset_accelerate()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATE, dataloader_config=config
    )
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        model.bias.fill_(0.125)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(
        Indexed(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=bool(workers),
        generator=torch.Generator().manual_seed(SEED) if seeded else None,
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return Run(accelerator, model, optimizer, loader)


def train_epoch(
    run: Run, batches: Iterable[dict[str, Any]], steps: list[Step], loader: Any = None
) -> EpochEnd:
    """The loop of accelerate's gradient-accumulation guide, recording each step.

    ``loader`` is the prepared loader behind ``batches`` (``run.loader`` unless given).
    """
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    loader = run.loader if loader is None else loader
    for batch in batches:
        with accelerator.accumulate(model):
            loss = (model(batch["x"]) - 1).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state = accelerator.gradient_state
            steps.append(
                Step(
                    batch["index"].tolist(),
                    accelerator.sync_gradients,
                    state.end_of_dataloader,
                    state.remainder,
                    loader.iteration,
                    state.active_dataloader is loader,
                )
            )
    return EpochEnd(accelerator.gradient_state.in_dataloader, loader.iteration)


def train(run: Run, batches: Iterable[dict[str, Any]], epochs: int = EPOCHS) -> tuple[Any, ...]:
    """``epochs`` epochs; returns the steps, the epochs' ends and the final weights."""
    steps: list[Step] = []
    ends = [train_epoch(run, batches, steps) for _ in range(epochs)]
    weights = [p.detach().clone() for p in run.model.parameters()]
    return steps, ends, weights


def check_plain_accelerate(steps: list[Step], ends: list[EpochEnd], epochs: int = EPOCHS) -> None:
    """What plain accelerate does, so that a failure below is nostall's, not the setup's."""
    sync = [(i + 1) % ACCUMULATE == 0 or i == BATCHES - 1 for i in range(BATCHES)]
    assert sync * epochs == [s.sync_gradients for s in steps]
    assert ([False] * (BATCHES - 1) + [True]) * epochs == [s.end_of_dataloader for s in steps]
    assert {SAMPLES % BATCH} == {s.remainder for s in steps}
    assert [e for e in range(epochs) for _ in range(BATCHES)] == [s.iteration for s in steps]
    assert all(s.active for s in steps)
    assert [EpochEnd(False, e + 1) for e in range(epochs)] == ends
    for e in range(epochs):
        epoch = [i for s in steps[e * BATCHES : (e + 1) * BATCHES] for i in s.indices]
        assert list(range(SAMPLES)) == sorted(epoch)


def assert_same_weights(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a), f"{e} != {a}"


# -- gradient accumulation -------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_accelerate_reference(workers: int) -> None:
    """The plain loop: syncs every 3 steps and at each epoch's last batch, which it flags."""
    run = build(workers)
    steps, ends, _ = train(run, run.loader)
    check_plain_accelerate(steps, ends)


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("depth", [2, 4])
@pytest.mark.parametrize("workers", [0, 2])
def test_accumulate_steps_match_plain_accelerate(workers: int, depth: int, across: bool) -> None:
    """Same samples, same syncs, same end-of-dataloader flags at each step, same weights."""
    run = build(workers)
    expected_steps, expected_ends, expected_weights = train(run, run.loader)
    check_plain_accelerate(expected_steps, expected_ends)

    run = build(workers)
    with nostall.prefetch(run.loader, depth=depth, across_epochs=across) as batches:
        steps, ends, weights = train(run, batches)
    assert expected_steps == steps
    assert expected_ends == ends
    assert_same_weights(expected_weights, weights)


# -- gather_for_metrics ----------------------------------------------------------------------------


def evaluate(run: Run, batches: Iterable[dict[str, Any]]) -> list[list[int]]:
    """An evaluation epoch: what ``gather_for_metrics`` keeps of each batch."""
    return [run.accelerator.gather_for_metrics(batch["index"]).tolist() for batch in batches]


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_gather_for_metrics_keeps_every_sample(across: bool) -> None:
    """It truncates a batch to ``remainder`` only at the end: a flag raised early drops samples."""
    run = build()
    expected = [evaluate(run, run.loader) for _ in range(EPOCHS)]
    for epoch in expected:
        assert list(range(SAMPLES)) == sorted(i for batch in epoch for i in batch)

    run = build()
    with nostall.prefetch(run.loader, depth=4, across_epochs=across) as batches:
        assert expected == [evaluate(run, batches) for _ in range(EPOCHS)]


# -- set_epoch -------------------------------------------------------------------------------------


@pytest.mark.parametrize("on", ["loader", "prefetcher"])
def test_set_epoch_picks_the_order(on: str) -> None:
    """With the seedable sampler the order is drawn from (seed, epoch); set_epoch(e) picks it.

    accelerate's loader sets its sampler's epoch from its own counter at each epoch's start, so
    ``loader.set_epoch(e)`` on the prepared loader (not only through nostall) must reach the
    epoch nostall fetches.
    """
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    epochs = [3, 1]
    run = build(config=config)
    expected: list[Step] = []
    for e in epochs:
        run.loader.set_epoch(e)
        train_epoch(run, run.loader, expected)
    assert epoch_indices(expected[:BATCHES]) != epoch_indices(expected[BATCHES:])

    run = build(config=config)
    steps: list[Step] = []
    with nostall.prefetch(run.loader, depth=4) as batches:
        for e in epochs:
            (run.loader if on == "loader" else batches).set_epoch(e)
            train_epoch(run, batches, steps)
    assert expected == steps


# -- wrapping before prepare -----------------------------------------------------------------------


def test_prefetcher_given_to_prepare_warns() -> None:
    """prepare() does not see the DataLoader inside a Prefetcher: nostall says to swap them."""
    accelerator = Accelerator(cpu=True)
    loader = DataLoader(Indexed(), batch_size=BATCH)
    with accelerator.prepare(nostall.prefetch(loader)) as batches:
        assert isinstance(batches, nostall.Prefetcher)  # prepare() passed it through untouched
        with pytest.warns(UserWarning, match=r"accelerator\.prepare") as caught:
            first = [b["index"].tolist() for b in batches]
        assert 1 == len(caught), [str(w.message) for w in caught]
        assert [b["index"].tolist() for b in loader] == first
        second = [b["index"].tolist() for b in batches]  # warned once: an error here otherwise
        assert first == second


def test_prefetcher_given_to_prepare_data_loader_is_refused() -> None:
    """prepare_data_loader() rebuilds a loader from the prefetcher's attributes: refused.

    Its loop would iterate a new DataLoader without nostall, silently; the error names the
    order that works. ``skip_first_batches`` reads them too, and is not refused (its resume
    route, tested with the Trainer).
    """
    accelerator = Accelerator(cpu=True)
    batches = nostall.prefetch(DataLoader(Indexed(), batch_size=BATCH))
    with pytest.raises(TypeError, match=r"nostall\.prefetch\(accelerator\.prepare\(loader\)\)"):
        accelerator.prepare_data_loader(batches)
    batches.close()


# -- threads= -------------------------------------------------------------------------------------


@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_loading_threads_load_a_prepared_loader(across: bool) -> None:
    """threads= loads the DataLoader accelerate iterates: its steps and flags are unchanged."""
    run = build()
    expected_steps, expected_ends, expected_weights = train(run, run.loader)
    check_plain_accelerate(expected_steps, expected_ends)

    run = build()
    with nostall.prefetch(run.loader, depth=4, across_epochs=across, threads=2) as batches:
        steps, ends, weights = train(run, batches)
    assert expected_steps == steps
    assert expected_ends == ends
    assert_same_weights(expected_weights, weights)
    assert "nostall-load" in run.loader.dataset.loaded_by


@pytest.mark.parametrize(
    ("config", "workers", "fix"),
    [
        (DataLoaderConfiguration(dispatch_batches=True), 0, "dispatch_batches=False"),
        (DataLoaderConfiguration(use_stateful_dataloader=True), 0, "without the stateful loader"),
        (None, 2, r"num_workers=0 .*dataloader_num_workers=0"),
    ],
    ids=["dispatcher", "stateful", "workers"],
)
def test_loading_threads_refuse_what_they_cannot_load(
    config: DataLoaderConfiguration | None, workers: int, fix: str
) -> None:
    """Each refusal names the setting that works, in one step."""
    run = build(workers, config)
    with pytest.raises(ValueError, match=fix):
        nostall.prefetch(run.loader, "cpu", threads=2)


def test_an_unprepared_loader_warning_leads_to_threads_over_the_prepared_one() -> None:
    """The raw loader's warning says to prepare it, and that threads= loads a prepared one."""
    run = build()
    raw = DataLoader(Indexed(), batch_size=BATCH)
    with (
        nostall.prefetch(raw, "cpu", threads=2) as batches,
        pytest.warns(UserWarning, match=r"accelerator\.prepare\(loader\) first.*threads="),
    ):
        next(iter(batches))
    with nostall.prefetch(run.accelerator.prepare(raw), "cpu", threads=2) as batches:
        assert SAMPLES == sum(len(b["index"]) for b in batches)  # no warning: an error here


def page_code(path: Path) -> dict[str, Any]:
    """The names defined by the first python block of a docs page, run as is."""
    block = path.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": path.stem}
    exec(compile(block, str(path), "exec"), namespace)
    return namespace


class Output(NamedTuple):
    loss: torch.Tensor


class Regression(torch.nn.Module):
    """A model that returns its loss, as Hugging Face models do (``model(**batch).loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.5, -0.25]]))
            self.linear.bias.fill_(0.125)

    def forward(self, index: torch.Tensor, x: torch.Tensor) -> Output:
        return Output((self.linear(x) - index.unsqueeze(1) / SAMPLES).pow(2).mean())


def test_the_pages_loop_trains_as_plain_accelerate() -> None:
    """docs/clients/accelerate.md's ``train`` (threads=2) ends with plain accelerate's weights."""

    def plain(model: Any, optimizer: Any, loader: Any, epochs: int) -> Any:
        accelerator = Accelerator(gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
        return model

    weights = []
    for train in (plain, page_code(ROOT / "docs" / "clients" / "accelerate.md")["train"]):
        reset_accelerate()
        model = Regression()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        seeded = torch.Generator().manual_seed(SEED)
        loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True, generator=seeded)
        trained = train(model, optimizer, loader, EPOCHS)
        weights.append([p.detach().clone() for p in trained.parameters()])
    assert_same_weights(*weights)
    assert not torch.equal(weights[0][0], torch.tensor([[0.5, -0.25]]))  # it trained


# -- skip_first_batches ----------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [None, 2])
def test_skip_first_batches_of_a_prefetcher(threads: int | None) -> None:
    """accelerator.skip_first_batches(prefetcher, k): plain accelerate's skip, prefetched.

    accelerate rebuilds a loader from the object it is given; from a prefetcher it would build
    a plain DataLoader (the prefetcher's own settings read as the loader's, no prefetching).
    """
    k = 3
    run = build()
    expected: list[Step] = []
    run.loader.set_epoch(1)
    skipping = run.accelerator.skip_first_batches(run.loader, k)
    train_epoch(run, skipping, expected, loader=skipping)
    train_epoch(run, run.loader, expected)

    run = build()
    steps: list[Step] = []
    with nostall.prefetch(run.loader, timeout=30, threads=threads) as batches:
        batches.set_epoch(1)
        with run.accelerator.skip_first_batches(batches, k) as rest:
            assert isinstance(rest, nostall.Prefetcher)
            train_epoch(run, rest, steps, loader=rest.source)
        train_epoch(run, batches, steps)
    assert expected == steps
    assert BATCHES - k + BATCHES == len(steps)


# -- resuming --------------------------------------------------------------------------------------


def let_it_run_ahead(run: Run, batches: int) -> None:
    """Give the producer time to load ``batches`` batches (milliseconds, normally).

    Only so that a state saved next would show batches fetched ahead if it counted them; what
    the test asserts afterwards holds whether the producer got there or not. It stops early
    once no sample was loaded for 0.2 s: a producer kept in step (an epoch's first batch,
    before nostall knows whether the source draws) fetches nothing ahead.
    """
    dataset, samples = run.loader.dataset, min(batches * BATCH, SAMPLES)
    deadline = time.monotonic() + 2.0
    loads, since = dataset.loads, time.monotonic()
    while dataset.loads < samples and time.monotonic() < min(deadline, since + 0.2):
        time.sleep(0.01)
        if dataset.loads != loads:
            loads, since = dataset.loads, time.monotonic()


def state_after(
    run: Run, k: int, across: bool = False, workers: int = 0, threads: int | None = None
) -> Any:
    """nostall's state after k batches of the first epoch, the producer fetching ahead."""
    with nostall.prefetch(run.loader, depth=4, across_epochs=across, threads=threads) as batches:
        ours = iter(batches)
        for _ in range(k):
            next(ours)
        if workers == 0:  # with workers, the loads are counted in their processes
            let_it_run_ahead(run, k + 4)
        return roundtrip(batches.state_dict())


def roundtrip(state: Any) -> Any:
    """Through torch.save and a weights-only torch.load, as a checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def epoch_indices(steps: list[Step]) -> list[list[int]]:
    return [s.indices for s in steps]


def stateful(workers: int) -> Run:
    """A prepared loader backed by torchdata's StatefulDataLoader.

    With torch's RandomSampler, accelerate's own resume draws another order: the prepared
    loader's constructor already calls ``state_dict()``, which creates an iterator that draws
    from the loader's generator, and only an uninterrupted run reuses that iterator. The
    seedable sampler reseeds from (seed, epoch) at each epoch instead, so the order depends on
    nothing else (and the loader needs no generator of its own).
    """
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    return build(workers, config, seeded=False)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [1, 4, BATCHES - 1])
def test_resume_a_stateful_prepared_loader(workers: int, k: int) -> None:
    """nostall's state after k batches resumes as accelerate's own state after k batches does.

    With ``use_stateful_dataloader=True`` the prepared loader has its own ``state_dict()``; the
    steps after the resume (samples, syncs, flags) equal those after accelerate's own resume,
    and, without workers, the rest of the epoch equals the uninterrupted run's.
    """
    run = stateful(workers)
    uninterrupted, _, _ = train(run, run.loader)

    run = stateful(workers)
    own = iter(run.loader)
    for _ in range(k):
        next(own)
    state = roundtrip(run.loader.state_dict())
    del own
    run = stateful(workers)
    run.loader.load_state_dict(state)
    expected, _, _ = train(run, run.loader)
    if workers == 0:
        assert epoch_indices(uninterrupted[k:]) == epoch_indices(expected)

    state = state_after(stateful(workers), k, workers=workers)
    run = stateful(workers)
    with nostall.prefetch(run.loader) as batches:
        batches.load_state_dict(state)
        resumed, _, _ = train(run, batches)
    assert expected == resumed


@pytest.mark.parametrize("k", [1, 4])
def test_accelerator_save_state_mid_epoch(tmp_path: Path, k: int) -> None:
    """``accelerator.save_state`` saves the prepared loader's position: the batches handed out.

    After k batches through nostall (which fetched further), the loader's ``state_dict()`` is the
    one the plain loop has after k batches, and ``load_state`` in a fresh run resumes there.
    """
    run = stateful(0)
    uninterrupted, _, _ = train(run, run.loader, epochs=1)

    run = stateful(0)
    own = iter(run.loader)
    for _ in range(k):
        next(own)
    expected_state = run.loader.state_dict()
    del own

    run = stateful(0)
    with nostall.prefetch(run.loader, depth=4) as batches:
        ours = iter(batches)
        for _ in range(k):
            next(ours)
        let_it_run_ahead(run, k + 4)
        assert expected_state == run.loader.state_dict()
        run.accelerator.save_state(str(tmp_path))

    run = stateful(0)
    run.accelerator.load_state(str(tmp_path))
    with nostall.prefetch(run.loader) as batches:
        resumed, _, _ = train(run, batches, epochs=1)
    assert epoch_indices(uninterrupted[k:]) == epoch_indices(resumed)


def decisions(steps: list[Step]) -> list[tuple[list[int], bool, bool]]:
    """What each step trained on and what accelerate decided there."""
    return [(s.indices, s.sync_gradients, s.end_of_dataloader) for s in steps]


@pytest.mark.parametrize("threads", [None, 2], ids=["loader", "threads"])
@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("k", [1, 4, BATCHES - 1])
def test_resume_by_replay(k: int, across: bool, threads: int | None) -> None:
    """Without a stateful loader, nostall draws the order again and skips k batches.

    The reference is accelerate's way: ``skip_first_batches(loader, k)`` for the rest of the
    epoch, then the loader itself; the same samples, syncs and end-of-dataloader flags follow,
    and the same weights. The skipping loader is another object, with its own epoch counter and
    no ``remainder`` (-1: its SkipBatchSampler has no batch_size); through nostall the prepared
    loader itself shows epoch 0, then 1, and the remainder of an uninterrupted run.
    """
    run = build()
    uninterrupted, _, _ = train(run, run.loader)

    run = build()
    skipping = run.accelerator.skip_first_batches(run.loader, k)
    steps: list[Step] = []
    train_epoch(run, skipping, steps, skipping)
    train_epoch(run, run.loader, steps)
    expected_weights = [p.detach().clone() for p in run.model.parameters()]
    assert epoch_indices(uninterrupted[k:BATCHES]) == epoch_indices(steps[: BATCHES - k])
    assert epoch_indices(uninterrupted[BATCHES:]) == epoch_indices(steps[BATCHES - k :])

    state = state_after(build(), k, across, threads=threads)
    run = build()
    with nostall.prefetch(run.loader, across_epochs=across, threads=threads) as batches:
        batches.load_state_dict(state)
        resumed, ends, weights = train(run, batches)
    assert decisions(steps) == decisions(resumed)
    assert [SAMPLES % BATCH] * len(resumed) == [s.remainder for s in resumed]
    assert [0] * (BATCHES - k) + [1] * BATCHES == [s.iteration for s in resumed]
    assert all(s.active for s in resumed)
    assert [EpochEnd(False, 1), EpochEnd(False, 2)] == ends
    assert_same_weights(expected_weights, weights)


# -- two processes ---------------------------------------------------------------------------------


def test_two_processes_under_torchrun(tmp_path: Path) -> None:
    """Two CPU ranks (gloo), DDP and ``even_batches``: per rank, nostall's steps are plain's.

    Each rank trains on its own half; rank 1's last batch is padded with the epoch's first
    samples, and ``gather_for_metrics`` drops the padding through ``remainder``. Opening an
    epoch of the prepared loader broadcasts rank 0's sampler generator: a collective, which must
    not run in nostall's thread while the loop runs its own, so across_epochs=True is refused.
    """
    runs = ["plain", "nostall:2:0", "nostall:4:0", "nostall:2:1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_torchrun(SCRIPT, str(tmp_path), *runs, timeout=100, env=env)
    results: dict[str, list[Any]] = {}
    for run in runs:
        files = [tmp_path / run.replace(":", "-") / f"rank{rank}.json" for rank in (0, 1)]
        results[run] = [json.loads(f.read_text()) if f.exists() else None for f in files]
        assert None not in results[run], f"{run}: a rank wrote nothing\n{done.stderr[-3000:]}"

    plain = results["plain"]
    per_epoch = BATCHES // 2
    sync = [(i + 1) % ACCUMULATE == 0 or i == per_epoch - 1 for i in range(per_epoch)]
    last = [False] * (per_epoch - 1) + [True]
    for rank in plain:
        assert rank["error"] is None, rank["error"]
        assert sync * EPOCHS == [s["sync_gradients"] for s in rank["steps"]]
        assert last * EPOCHS == [s["end_of_dataloader"] for s in rank["steps"]]
        assert {SAMPLES % (2 * BATCH)} == {s["remainder"] for s in rank["steps"]}
        for e in range(EPOCHS):
            epoch = rank["steps"][e * per_epoch : (e + 1) * per_epoch]
            assert list(range(SAMPLES)) == sorted(i for s in epoch for i in s["gathered"])
    assert plain[0]["weights"] == plain[1]["weights"]  # DDP kept the replicas equal

    for run in runs[1:-1]:
        for rank, (expected, actual) in enumerate(zip(plain, results[run], strict=True)):
            assert None is actual["error"], f"{run}, rank {rank}:\n{actual['error']}"
            assert expected["steps"] == actual["steps"], f"{run}, rank {rank}"
            assert expected["weights"] == actual["weights"], f"{run}, rank {rank}"
    for rank in results["nostall:2:1"]:
        assert "ValueError" in (rank["error"] or ""), rank["error"]
        assert "across_epochs=False" in rank["error"]
        assert [] == rank["steps"]
    assert 0 == done.returncode, done.stderr[-3000:]


# -- the example -----------------------------------------------------------------------------------


def test_example_trains_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/accelerate_train.py runs; its checkpoint holds nostall's position; it resumes.

    The first run is a subprocess, as a user runs it; the resumed run goes in this process (no
    second start-up), from the checkpoint saved after the last batch, which is the start of the
    epoch after it: nothing is left to train.
    """
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    assert "epoch 2: loss" in done.stdout
    saved = torch.load(tmp_path / "checkpoint" / "custom_checkpoint_0.pkl", weights_only=True)
    assert (3, 0) == (saved["epoch"], saved["batches_yielded"])  # after epoch 2's last batch

    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        resumed = runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "" == printed.getvalue()
    resumed["batches"].close()
    assert (3, 0) == (resumed["batches"].epoch, resumed["batches"].state_dict()["batches_yielded"])


def test_a_dispatcher_in_a_distributed_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each DataLoaderDispatcher batch is a collective: it must not be pulled in a thread."""
    from accelerate.data_loader import DataLoaderDispatcher

    from nostall._sources import checks as _source_checks

    Accelerator(cpu=True)
    dispatcher = DataLoaderDispatcher(Indexed(), batch_size=2)
    monkeypatch.setattr(_source_checks, "distributed_world", lambda: (0, 2))
    with pytest.raises(ValueError, match=r"dispatch_batches=False"):
        nostall.prefetch(dispatcher, "cpu")


# -- a DataLoaderDispatcher on one process ---------------------------------------------------------


def dispatching(stateful: bool = False) -> Run:
    """A prepared loader that is a ``DataLoaderDispatcher`` (``dispatch_batches=True``).

    accelerate makes one by default over an ``IterableDataset`` (Trainer with a streaming
    train set); it moves the gradient state as it is iterated, as a shard does.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    config = DataLoaderConfiguration(dispatch_batches=True, use_stateful_dataloader=stateful)
    run = build(config=config)
    assert isinstance(run.loader, DataLoaderDispatcher)
    return run


@pytest.mark.parametrize("stateful", [False, True], ids=["plain", "stateful"])
@pytest.mark.parametrize("across", [False, True], ids=["per-epoch", "across-epochs"])
def test_a_dispatcher_steps_as_plain_accelerate(across: bool, stateful: bool) -> None:
    """Same samples, syncs, end flags, remainders and epochs at each step; same weights."""
    run = dispatching(stateful)
    expected_steps, expected_ends, expected_weights = train(run, run.loader)
    last = [False] * (BATCHES - 1) + [True]  # the plain dispatcher flags each epoch's last
    assert last * EPOCHS == [s.end_of_dataloader for s in expected_steps]

    run = dispatching(stateful)
    with nostall.prefetch(run.loader, depth=4, across_epochs=across) as batches:
        steps, ends, weights = train(run, batches)
    assert expected_steps == steps
    assert expected_ends == ends
    assert_same_weights(expected_weights, weights)


@pytest.mark.parametrize("k", [1, 4])
def test_a_stateful_dispatcher_states_the_batches_handed_out(tmp_path: Path, k: int) -> None:
    """Its ``state_dict()`` (what ``save_state`` saves) is the plain loop's after k batches."""
    run = dispatching(stateful=True)
    own = iter(run.loader)
    for _ in range(k):
        next(own)
    expected_state = run.loader.state_dict()
    del own

    run = dispatching(stateful=True)
    with nostall.prefetch(run.loader, depth=4) as batches:
        ours = iter(batches)
        for _ in range(k):
            next(ours)
        let_it_run_ahead(run, k + 4)
        assert expected_state == run.loader.state_dict()


@pytest.mark.parametrize("k", [1, 4])
def test_a_dispatcher_resumes_by_replay(k: int) -> None:
    """Without ``use_stateful_dataloader`` its ``state_dict()`` raises: nostall never asks it.

    nostall's own state after k batches resumes the rest of the epoch, then the next one, as
    the uninterrupted run trains them.
    """
    run = dispatching()
    uninterrupted, _, _ = train(run, run.loader)

    state = state_after(dispatching(), k)
    run = dispatching()
    with nostall.prefetch(run.loader) as batches:
        batches.load_state_dict(state)
        resumed, _, _ = train(run, batches)
    assert epoch_indices(uninterrupted[k:]) == epoch_indices(resumed)


class Stream(IterableDataset[torch.Tensor]):
    """Six numbers in order, without ``set_epoch``."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([float(i)]) for i in range(6))


def test_a_dispatcher_without_an_epoch_to_set_is_not_warned_of() -> None:
    """A dispatcher's own ``set_epoch`` only passes the epoch on (here, to nothing).

    So across epochs it is not "an object that keeps no readable epoch": nostall asks what it
    passes the epoch on to, as for a shard.
    """
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(Stream(), batch_size=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nostall.prefetch(loader, across_epochs=True) as batches:
            epochs = [[b.flatten().tolist() for b in batches] for _ in range(2)]
    assert [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]] * 2 == epochs
    # (Its unseeded loader's next epoch is drawn ahead from torch's global generator: that
    # warning is another's, tested in test_silent_differences.)
    assert [] == [str(w.message) for w in caught if "set_epoch" in str(w.message)]
