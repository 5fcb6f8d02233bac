"""nostall over timm's loaders: the same samples and random numbers as without it, and on resume.

timm cannot be imported here (it needs torchvision, which does not load with this torch build):
its loaders are stood in for by tests/frameworks/timm_like.py, which says what each mirrors.

Each test trains a tiny model and records what every step trained on: the samples' indices and
their augmented values (and the model's final weights). A run through nostall is compared with
the run without it, and a resumed run with the uninterrupted one. A resume is a fresh loader
and a fresh prefetcher, built identically in the same process, after the checkpoint's global
generators (torch's, ``random``'s, NumPy's) and the model's weights were restored, as a training
script restores its checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from frameworks.timm_like import Augmented, create_loader
from helpers import LoaderWrapper, global_states, seed_all, set_global_states
from torch.nn import functional
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import nostall
from nostall._sources.global_draws import DrawWatch, GlobalDrawsWarning, Watch
from nostall._sources.sources import classify

#: (epoch, step) after which the checkpoint is saved: mid-epoch 1.
SAVE_AT = (1, 2)
EPOCHS = 3


@dataclasses.dataclass
class Step:
    """What one step trained on."""

    epoch: int
    indices: list[int]
    values: list[list[float]]


@dataclasses.dataclass
class Checkpoint:
    data: dict[str, Any]
    rng: tuple[Any, ...]
    model: dict[str, torch.Tensor]


class Trainer:
    """A tiny model whose step draws from torch's global generator (dropout on the CPU)."""

    def __init__(self, step_time: float = 0.0, dropout: bool = True) -> None:
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.step_time, self.dropout = step_time, dropout
        self.steps: list[Step] = []

    def step(self, epoch: int, batch: Any) -> None:
        inputs, targets = batch
        self.steps.append(Step(epoch, targets.tolist(), inputs.tolist()))
        if self.step_time:
            time.sleep(self.step_time)  # the step's work: a prefetcher loads meanwhile
        hidden = functional.dropout(inputs.float() / 50, 0.25, training=self.dropout)
        loss = (self.model(hidden).squeeze(1) - targets.float() / 50).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def weights(self) -> list[float]:
        return [x for p in self.model.parameters() for x in p.detach().flatten().tolist()]


def train(
    batches: Iterable[Any],
    trainer: Trainer,
    epochs: Iterable[int],
    save_at: tuple[int, int] | None = None,
) -> Checkpoint | None:
    """The training loop: ``set_epoch`` on a prefetcher, each batch a step, one checkpoint."""
    saved = None
    for epoch in epochs:
        if isinstance(batches, nostall.Prefetcher):
            batches.set_epoch(epoch)
        for i, batch in enumerate(batches):
            trainer.step(epoch, batch)
            if (epoch, i) == save_at:
                assert isinstance(batches, nostall.Prefetcher)
                saved = Checkpoint(
                    batches.state_dict(), global_states(), copy.deepcopy(trainer.model.state_dict())
                )
    return saved


def resumed(
    make: Callable[[], Any], checkpoint: Checkpoint, **options: Any
) -> tuple[Trainer, nostall.Prefetcher[Any]]:
    """A fresh loader, prefetcher and model, restored from ``checkpoint`` as a script would."""
    seed_all(99)  # another start: the checkpoint decides
    trainer = Trainer(options.pop("step_time", 0.0))
    trainer.model.load_state_dict(checkpoint.model)
    batches = nostall.prefetch(make(), "cpu", **options)
    batches.load_state_dict(checkpoint.data)
    set_global_states(checkpoint.rng)
    return trainer, batches


def after_checkpoint(steps: list[Step]) -> list[Step]:
    """The steps of an uninterrupted run after the checkpoint's."""
    epoch, index = SAVE_AT
    before = sum(1 for s in steps if s.epoch < epoch) + index + 1
    return steps[before:]


def assert_resumed_as_uninterrupted(
    make: Callable[[], Any], **options: Any
) -> tuple[list[Step], list[Step]]:
    """Train uninterrupted through nostall, then resume from its checkpoint: the same steps.

    Returns both runs' steps after the checkpoint (compared already).
    """
    seed_all(0)
    uninterrupted = Trainer(options.get("step_time", 0.0))
    batches = nostall.prefetch(
        make(), "cpu", **{k: v for k, v in options.items() if k != "step_time"}
    )
    checkpoint = train(batches, uninterrupted, range(EPOCHS), SAVE_AT)
    batches.close()
    assert checkpoint is not None

    trainer, batches = resumed(make, checkpoint, **options)
    train(batches, trainer, range(batches.epoch, EPOCHS))
    batches.close()
    expected, got = after_checkpoint(uninterrupted.steps), trainer.steps
    assert [(s.epoch, s.indices) for s in expected] == [(s.epoch, s.indices) for s in got], (
        "the resumed run trained other samples"
    )
    for want, have in zip(expected, got, strict=True):
        assert want.values == have.values, (
            f"the resumed run's epoch {have.epoch} batch {have.indices} got other values"
        )
    assert uninterrupted.weights() == trainer.weights()
    return expected, got


# -- 2: a resume over a PrefetchLoader-like wrapper of a loader with persistent workers ----------


def persistent_loader() -> DataLoader[Any]:
    return DataLoader(
        Augmented(draws=False), shuffle=True, batch_size=4, num_workers=2, persistent_workers=True
    )


@pytest.mark.parametrize(
    "make",
    [
        persistent_loader,  # nostall over the loader itself: resumes exactly (the control)
        lambda: LoaderWrapper(persistent_loader()),
        lambda: create_loader(Augmented(draws=False), num_workers=2),
    ],
    ids=["loader", "wrapper", "prefetch-loader"],
)
def test_a_resume_over_a_wrapper_of_persistent_workers_trains_the_same_samples(
    make: Callable[[], Any],
) -> None:
    assert_resumed_as_uninterrupted(make)


# -- 4: timm's MultiEpochsDataLoader, its next pass's order drawn in nostall's thread -------------


def multi_epochs_loader(use_prefetcher: bool) -> Any:
    return create_loader(
        Augmented(48, draws=False),
        num_workers=2,
        use_multi_epochs_loader=True,
        use_prefetcher=use_prefetcher,
    )


def epoch_orders(trainer: Trainer) -> list[list[int]]:
    orders: dict[int, list[int]] = {}
    for s in trainer.steps:
        orders.setdefault(s.epoch, []).extend(s.indices)
    return list(orders.values())


@pytest.mark.parametrize("across_epochs", [False, True], ids=["per-epoch", "across-epochs"])
@pytest.mark.parametrize("use_prefetcher", [False, True], ids=["multi-epochs", "prefetch-loader"])
def test_multi_epochs_loader_orders_are_the_plain_runs_or_warned(
    use_prefetcher: bool, across_epochs: bool
) -> None:
    """Each pass's order draws from torch's generator, as the step does: the plain run's.

    Twelve batches an epoch: the next pass's first indices are put to a worker four batches
    before the pass ends (two workers, two batches each ahead), in whatever thread pulls then.
    """

    def make() -> Any:
        return multi_epochs_loader(use_prefetcher)

    seed_all(0)
    plain = Trainer(step_time=0.005)
    train(make(), plain, range(EPOCHS))
    seed_all(0)
    through = Trainer(step_time=0.005)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = nostall.prefetch(make(), "cpu", across_epochs=across_epochs)
        train(batches, through, range(EPOCHS))
        batches.close()
    if epoch_orders(plain) == epoch_orders(through):
        assert plain.weights() == through.weights()
        return
    at_user = [w for w in caught if w.filename == __file__]
    assert at_user, (
        f"the epochs' orders differ from the plain run's and nothing was warned at the loop "
        f"(warned elsewhere: {[(w.filename, str(w.message)[:80]) for w in caught]})"
    )


@pytest.mark.parametrize("use_prefetcher", [False, True], ids=["multi-epochs", "prefetch-loader"])
def test_multi_epochs_loader_is_loaded_ahead_where_the_step_draws_nothing_of_torchs(
    use_prefetcher: bool,
) -> None:
    """A step that draws from torch's CPU generator only on the GPU: the orders are the sampler's.

    Loaded ahead, without a word: nobody but the sampler draws from that generator.
    """
    seed_all(0)
    plain = Trainer(dropout=False)
    train(multi_epochs_loader(use_prefetcher), plain, range(EPOCHS))
    seed_all(0)
    through = Trainer(dropout=False)
    batches = nostall.prefetch(multi_epochs_loader(use_prefetcher), "cpu", across_epochs=True)
    train(batches, through, range(EPOCHS))
    assert not batches._lineage.epochs.draws.in_step
    batches.close()
    assert epoch_orders(plain) == epoch_orders(through)
    assert plain.weights() == through.weights()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_prefetch_loader_opened_ahead_keeps_the_plain_orders_or_is_warned_of(
    workers: int,
) -> None:
    """across_epochs=True over timm's PrefetchLoader: its order is drawn at its first pull.

    Once the epoch is opened ahead, in nostall's thread, among the step's own draws.
    """
    seed_all(0)
    plain = Trainer(step_time=0.005)
    train(create_loader(Augmented(draws=False), num_workers=workers), plain, range(EPOCHS))
    seed_all(0)
    through = Trainer(step_time=0.005)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = nostall.prefetch(
            create_loader(Augmented(draws=False), num_workers=workers), "cpu", across_epochs=True
        )
        train(batches, through, range(EPOCHS))
        batches.close()
    if epoch_orders(plain) == epoch_orders(through):
        return
    at_user = [w for w in caught if w.filename == __file__]
    assert at_user, (
        f"the epochs' orders differ from the plain run's and nothing was warned at the loop "
        f"(warned elsewhere: {[(w.filename, str(w.message)[:80]) for w in caught]})"
    )


# -- 5: augmentations drawn in worker processes, or one batch ahead in the main process ----------


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "restarted"])
def test_a_resume_gives_worker_augmentations_the_uninterrupted_values(persistent: bool) -> None:
    """Each sample draws in its worker (torch, random, NumPy seeded by timm's worker_init).

    ``--no-prefetcher``: nostall wraps the DataLoader itself, and records its workers' draws.
    """
    assert_resumed_as_uninterrupted(
        lambda: create_loader(
            Augmented(draws=True),
            num_workers=2,
            persistent_workers=persistent,
            use_prefetcher=False,
        )
    )


@pytest.mark.filterwarnings("ignore::nostall._sources.global_draws.GlobalDrawsWarning")
@pytest.mark.parametrize("re_prob", [0.0, 0.5], ids=["dataset", "dataset-and-erasing"])
def test_a_resume_over_a_prefetch_loader_in_the_main_process_draws_the_same(
    re_prob: float,
) -> None:
    """``num_workers=0``: the dataset (and the erasing) draw as the wrapper pulls, a batch ahead."""
    assert_resumed_as_uninterrupted(
        lambda: create_loader(Augmented(draws=True), num_workers=0, re_prob=re_prob)
    )


def test_nostall_trains_what_the_plain_loop_trains_over_a_prefetch_loader() -> None:
    """The baseline the resumes are held to: the uninterrupted run through nostall is plain."""
    for workers in (0, 2):

        def make(workers: int = workers) -> Any:
            return create_loader(Augmented(draws=True), num_workers=workers, re_prob=0.5)

        seed_all(0)
        plain = Trainer()
        train(make(), plain, range(EPOCHS))
        seed_all(0)
        through = Trainer()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GlobalDrawsWarning)
            batches = nostall.prefetch(make(), "cpu")
            train(batches, through, range(EPOCHS))
            batches.close()
        assert plain.steps == through.steps
        assert plain.weights() == through.weights()


def test_a_batch_sampler_with_a_length_is_not_taken_for_a_repeating_one() -> None:
    """Only an endless sampler starts an unseeded shuffle mid-epoch.

    A batch sampler of one's own over a RandomSampler draws its order when the epoch's iterator
    starts, as torch's do: a loader with workers is clear of draws from the start.
    """

    class Buckets(BatchSampler):
        pass

    dataset = Augmented(draws=False)
    loader = DataLoader(
        dataset, batch_sampler=Buckets(RandomSampler(dataset), 4, False), num_workers=2
    )
    assert DrawWatch(classify(loader)).state is Watch.CLEAR
    repeating = multi_epochs_loader(use_prefetcher=False)
    assert DrawWatch(classify(repeating)).reshuffles == "RepeatSampler"


# -- docs/clients/timm.md ------------------------------------------------------------------------


def page_train(monkeypatch: pytest.MonkeyPatch) -> Callable[..., torch.nn.Module]:
    """docs/clients/timm.md's ``train``, its ``timm.data.create_loader`` the stand-in's."""
    import re
    import sys
    import types
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "clients" / "timm.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert 1 == len(blocks)
    timm, data = types.ModuleType("timm"), types.ModuleType("timm.data")
    data.create_loader = create_loader  # type: ignore[attr-defined]
    timm.data = data  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.data", data)
    names: dict[str, Any] = {"__name__": "timm_page"}
    exec(compile(blocks[0], "docs/clients/timm.md", "exec"), names)
    return names["train"]  # type: ignore[no-any-return]


def test_the_pages_loop_trains_as_over_timms_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's loop through nostall ends with the weights of the same loop over the loader."""
    train = page_train(monkeypatch)

    def model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 24)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    seed_all(0)  # the workers' seeds, drawn from the global generators at the first iter()
    model, optimizer = model_and_optimizer()
    plain = create_loader(Augmented(draws=True), batch_size=4, num_workers=2, use_prefetcher=False)
    for _ in range(2):
        for inputs, targets in plain:
            loss = functional.cross_entropy(model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
    del plain
    seed_all(0)
    trained, optimizer = model_and_optimizer()
    assert trained is train(trained, optimizer, Augmented(draws=True), 2, device="cpu")
    assert torch.equal(model.weight, trained.weight)
    assert torch.equal(model.bias, trained.bias)


def test_a_prefetch_loader_loaded_in_step_is_told_timms_fix() -> None:
    """The warning for timm's PrefetchLoader (recognised by its class) names --no-prefetcher."""
    from frameworks import timm_like

    class PrefetchLoader(timm_like.PrefetchLoader):
        """As timm's class is named and placed."""

    PrefetchLoader.__module__ = "timm.data.loader"
    inner = create_loader(Augmented(draws=True), num_workers=0, use_prefetcher=False)
    batches = nostall.prefetch(PrefetchLoader(inner, re_prob=0.5))

    def train() -> None:
        for _ in batches:
            torch.rand(1)  # the step draws from torch's generator too

    with pytest.warns(GlobalDrawsWarning, match=r"use_prefetcher=False\) \(train\.py's"):
        train()
    batches.close()
