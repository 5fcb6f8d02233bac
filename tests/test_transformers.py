"""nostall inside Hugging Face ``Trainer``: the ``get_train_dataloader`` override users write.

``Trainer`` builds its loader in ``get_train_dataloader()`` (a ``DataLoader`` prepared by
accelerate), so a user puts nostall in by overriding that method, as docs/clients/trainer.md
shows; the tests run that page's code. Each run trains a 1-layer BERT on CPU with gradient
accumulation 4 (steps of 4, 4 and 3 batches per epoch) and is compared with ``Trainer`` without
nostall: the indices of every micro-batch of every optimizer step, and the final weights.

A mid-epoch resume calls accelerate's ``skip_first_batches`` on the loader; over a prefetcher
nostall makes that skip the prefetcher's loader and prefetch the result. It is checked in a
fresh process, from checkpoints saved by ``save_steps`` in this one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from frameworks import trainer_run as run
from frameworks.trainer_run import Seen, Spec

ROOT = Path(__file__).resolve().parent.parent

#: The nostall runs compared with Trainer's own: (trainer class, prefetch options, workers).
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    # The override as a user first writes it: nostall.prefetch(super().get_train_dataloader()).
    "default": ("prefetch", {}, 0),
    # The page's classes, as a user copies them.
    "page": ("PrefetchingTrainer", {}, 0),
    "page-threads": ("ThreadLoadingTrainer", {}, 0),
    # The settings that broke a mid-epoch resume: a timeout (the loader's is 0), across epochs,
    # worker processes.
    "timeout-across": ("prefetch", {"timeout": 60, "across_epochs": True}, 0),
    "timeout-workers": ("prefetch", {"timeout": 60}, 2),
}
#: Runs over a streaming train set (no length; Trainer counts steps): ``stream-plain`` is
#: Trainer itself, the others the trainer class they name. accelerate prepares the stream as a
#: ``DataLoaderDispatcher`` (``dispatch_batches`` defaults to True for an ``IterableDataset``).
STREAMS = {
    "stream-plain": "plain",
    "stream-page": "PrefetchingTrainer",
    "stream-default": "prefetch",
}
EPOCH_END = f"checkpoint-{run.STEPS_PER_EPOCH}"
MID_EPOCH = f"checkpoint-{run.STEPS_PER_EPOCH + 1}"  # one step into the second epoch


@pytest.fixture(autouse=True)
def _no_accelerator_left_active() -> Iterator[None]:
    """Trainer makes an Accelerator, whose state is process-wide: later tests must not see it."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The model is tiny: one intra-op thread is many times faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(spec: Spec) -> tuple[Seen, dict[str, torch.Tensor]]:
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    seen = run.train(spec)
    return seen, torch.load(Path(spec.out) / "weights.pt", weights_only=True)


def spec(name: str, out: Path, resume: str | None = None) -> Spec:
    """The run called ``name`` (``plain-N``: Trainer itself with N workers; else a variant)."""
    if name.startswith("plain-"):
        return Spec(str(out), workers=int(name.split("-")[1]), resume=resume)
    if name in STREAMS:
        return Spec(str(out), STREAMS[name], resume=resume, stream=True)
    trainer, options, workers = VARIANTS[name]
    return Spec(str(out), trainer, options, workers, resume)


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert [] == different


class Runs:
    """Uninterrupted runs, each once per module (their checkpoints are resumed from)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[Seen, dict[str, torch.Tensor]]] = {}

    def __getitem__(self, name: str) -> tuple[Seen, dict[str, torch.Tensor]]:
        if name not in self.done:
            self.done[name] = train(spec(name, self.root / name))
        return self.done[name]

    def checkpoint(self, name: str, which: str) -> str:
        self[name]
        return str(self.root / name / which)

    def resumed(self, name: str, which: str) -> tuple[Seen, dict[str, torch.Tensor]]:
        """``name`` resumed in this process from its own checkpoint ``which``."""
        key = f"{name}@{which}"
        if key not in self.done:
            self.done[key] = train(spec(name, self.root / key, self.checkpoint(name, which)))
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("trainer"))


def workers_of(name: str) -> int:
    return int(name.split("-")[1]) if name.startswith("plain-") else VARIANTS[name][2]


def loaded_by_nostall(name: str, seen: Seen) -> bool:
    """Whether nostall's threads loaded samples.

    Those a step waited for may be loaded in the training thread itself; worker processes load
    them all in theirs.
    """
    if workers_of(name):
        return [] == seen.loaded_by
    return ("nostall-load" if "threads" in name else "nostall-prefetch") in seen.loaded_by


# -- a streaming train set: accelerate's DataLoaderDispatcher ----------------------------------


@pytest.mark.parametrize("name", ["stream-page", "stream-default"])
def test_a_streaming_train_set_trains_as_plain_trainer(runs: Runs, name: str) -> None:
    """Over a stream Trainer trains on a dispatcher; nostall's steps and weights are Trainer's.

    The dispatcher moves accelerate's gradient state as it is iterated, and has no
    ``state_dict()`` without ``use_stateful_dataloader``: nostall iterates a shadow of it and
    replays its state at hand-out, as for a ``DataLoaderShard``.
    """
    expected, expected_weights = runs["stream-plain"]
    seen, weights = runs[name]
    assert (None, None) == (expected.error, seen.error)
    assert ("DataLoaderDispatcher",) * 2 == (expected.loader, seen.loader)
    assert run.EPOCHS * run.STEPS_PER_EPOCH == len(seen.steps)
    assert expected.steps == seen.steps
    assert_same_weights(expected_weights, weights)
    assert all("nostall-prefetch" in alive for alive in seen.threads[:4])
    assert "nostall-prefetch" in seen.loaded_by


def test_a_streaming_train_set_resumes_mid_epoch(runs: Runs) -> None:
    """From a checkpoint inside the second epoch: as Trainer itself resumes a stream.

    Trainer skips the epoch's first batches with accelerate's ``skip_first_batches`` of the
    dispatcher (a new dispatcher with ``skip_batches``), which nostall routes and prefetches.
    """
    expected, expected_weights = runs.resumed("stream-plain", MID_EPOCH)
    seen, weights = runs.resumed("stream-page", MID_EPOCH)
    assert (None, None) == (expected.error, seen.error)
    assert [] != expected.steps
    assert expected.steps == seen.steps
    assert_same_weights(expected_weights, weights)
    assert "nostall-prefetch" in seen.threads[0], "not prefetched after the resume"


# -- uninterrupted ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_trainer_reference(runs: Runs, workers: int) -> None:
    """Trainer itself: steps of 4, 4, 3 batches; every sample once per epoch; checkpoints."""
    seen, _ = runs[f"plain-{workers}"]
    assert seen.error is None
    assert [4, 4, 3] * run.EPOCHS == [len(step) for step in seen.steps]
    per_epoch = run.STEPS_PER_EPOCH
    for e in range(run.EPOCHS):
        epoch = [
            i for step in seen.steps[e * per_epoch : (e + 1) * per_epoch] for b in step for i in b
        ]
        assert list(range(run.SAMPLES)) == sorted(epoch)
    assert seen.steps[:per_epoch] != seen.steps[per_epoch:]  # each epoch draws its own order
    assert (runs.root / f"plain-{workers}" / MID_EPOCH / "trainer_state.json").exists()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_same_steps_and_weights_as_plain_trainer(runs: Runs, name: str) -> None:
    """Every step trains on the same samples, with the same accumulation, to the same weights."""
    expected, expected_weights = runs[f"plain-{workers_of(name)}"]
    seen, weights = runs[name]
    assert seen.error is None
    assert expected.steps == seen.steps
    assert_same_weights(expected_weights, weights)
    assert all("nostall-prefetch" in alive for alive in seen.threads[:4])  # prefetched
    assert loaded_by_nostall(name, seen), seen.loaded_by


@pytest.mark.parametrize("name", ["page", "page-threads", "timeout-workers"])
def test_resume_at_an_epoch_end(runs: Runs, name: str) -> None:
    """From the checkpoint saved at the first epoch's end: the second epoch, as Trainer's."""
    plain = f"plain-{workers_of(name)}"
    expected, expected_weights = runs.resumed(plain, EPOCH_END)
    seen, weights = runs.resumed(name, EPOCH_END)
    assert (None, None) == (expected.error, seen.error)
    assert runs[plain][0].steps[run.STEPS_PER_EPOCH :] == expected.steps
    assert expected.steps == seen.steps
    assert_same_weights(expected_weights, weights)


def test_resume_mid_epoch_in_a_fresh_process(runs: Runs, tmp_path: Path) -> None:
    """From a checkpoint one step into the second epoch, in a new process: as Trainer resumes.

    Trainer skips the epoch's first 4 batches with accelerate's ``skip_first_batches``, which
    rebuilds a loader from the object it is given. nostall must hand it the prefetcher's own
    loader (the rebuilt one draws the second epoch's order, reads the loader's ``timeout``), and
    prefetch what it returns.
    """
    names = ["plain-0", "plain-2", *VARIANTS]
    specs = []
    for name in names:
        resumed = spec(name, tmp_path / name, runs.checkpoint(name, MID_EPOCH))
        Path(resumed.out).mkdir()
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dataclasses.asdict(resumed)))
        specs.append(str(path))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "frameworks" / "trainer_run.py"), *specs],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    results = {}
    for name in names:
        seen = Seen(**json.loads((tmp_path / name / "seen.json").read_text()))
        weights = torch.load(tmp_path / name / "weights.pt", weights_only=True)
        results[name] = (seen, weights)

    for workers in (0, 2):
        expected, _ = results[f"plain-{workers}"]
        assert expected.error is None
        uninterrupted = runs[f"plain-{workers}"][0].steps
        # The rest of the second epoch (its first step was trained before the checkpoint).
        assert uninterrupted[run.STEPS_PER_EPOCH + 1 :] == expected.steps
    for name in VARIANTS:
        expected, expected_weights = results[f"plain-{workers_of(name)}"]
        seen, weights = results[name]
        assert seen.error is None, name
        assert expected.steps == seen.steps, name
        assert_same_weights(expected_weights, weights)
        assert "nostall-prefetch" in seen.threads[0], f"{name}: not prefetched after the resume"
        assert loaded_by_nostall(name, seen), f"{name}: {seen.loaded_by}"
