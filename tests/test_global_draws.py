"""Sources that draw from the global random generators: the draws keep the plain loop's order.

A collator that masks tokens with ``torch.bernoulli`` (as ``DataCollatorForLanguageModeling``
with ``seed=None`` does), a dataset whose augmentation draws from torch's global generator (as
torchvision's v2 transforms do), and a model with dropout: the losses with nostall must be the
plain loop's, step by step, and a warning says once, at the user's line, what drew and the fix.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same_batches, wait_until
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import nostall
from nostall import PrefetchTimeoutError
from nostall._sources import global_draws
from nostall._sources.generators import CUDA, NUMPY, PYTHON, TORCH, Trial, moved, snapshot
from nostall._sources.global_draws import DrawWatch, GlobalDrawsWarning, Watch
from nostall._sources.sources import classify

SAMPLES, FEATURES = 48, 8


class Features(Dataset[torch.Tensor]):
    """Fixed features; draws nothing."""

    def __init__(self) -> None:
        self.data = torch.arange(SAMPLES * FEATURES, dtype=torch.float32).reshape(SAMPLES, -1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i] / 100


class Jittered(Features):
    """An augmentation drawing from torch's global generator, as torchvision's v2 ones do."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return super().__getitem__(i) + torch.randn(FEATURES)


class Dropped(Features):
    """An augmentation drawing through a torch function that takes no generator= (F.dropout).

    Under threads= its draws escape the sample's own generator: the samples stay in step.
    """

    def __getitem__(self, i: int) -> torch.Tensor:
        return nn.functional.dropout(super().__getitem__(i), 0.1)


#: The line of :class:`Dropped`'s draw, as the warning names it.
DROPPED_LINE = Dropped.__getitem__.__code__.co_firstlineno + 1


class DroppedLater(Features):
    """:class:`Dropped`'s draws, but not at a batch's first sample (batches of 4, in order).

    Under threads= the first sample is judged alone and draws nothing: the threads load the
    others in parallel, and their escaped draws come in the order the threads run.
    """

    def __getitem__(self, i: int) -> torch.Tensor:
        sample = super().__getitem__(i)
        return sample if i % 4 == 0 else nn.functional.dropout(sample, 0.1)


def mask(batch: list[torch.Tensor]) -> torch.Tensor:
    """Masks a random tenth of the values, as a language-modelling collator masks tokens."""
    stacked = torch.stack(batch)
    return stacked * torch.bernoulli(torch.full(stacked.shape, 0.9))


def python_noise(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(batch) * random.random()


def numpy_noise(batch: list[torch.Tensor]) -> torch.Tensor:
    np = pytest.importorskip("numpy")
    return torch.stack(batch) * float(np.random.rand())


def drawing_loop(batches: Iterable[Any], draw: Callable[[], Any]) -> None:
    """A loop whose step makes one ``draw()`` per batch (as dropout draws)."""
    for _ in batches:
        draw()


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.5), nn.Linear(16, 1))


def train(batches: Callable[[], Iterable[torch.Tensor]], epochs: int = 1) -> list[float]:
    """Losses of a small training loop with dropout, seeded as a user seeds it."""
    net = model()
    optimiser = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.manual_seed(0)
    random.seed(0)
    losses = []
    for _ in range(epochs):
        for batch in batches():
            loss = net(batch).pow(2).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
    return losses


def loader(dataset: Dataset[Any] | None = None, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(dataset or Features(), batch_size=4, shuffle=True, **kwargs)


def nostall_losses(source: DataLoader[Any], epochs: int = 1, **kwargs: Any) -> list[float]:
    """Losses through nostall; the warning it gives is expected here, once."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prefetcher = nostall.prefetch(source, "cpu", **kwargs)
        losses = train(lambda: prefetcher, epochs)
    draws = [w for w in seen if issubclass(w.category, GlobalDrawsWarning)]
    others = [w for w in seen if not issubclass(w.category, GlobalDrawsWarning)]
    assert [] == others
    assert 1 == len(draws)
    return losses


@pytest.mark.parametrize("across_epochs", [False, True])
def test_a_collator_drawing_from_the_global_generator_sees_the_plain_loops_draws(
    across_epochs: bool,
) -> None:
    """DataCollatorForLanguageModeling's case: the same masks and dropout at every step."""
    expected = train(lambda: loader(collate_fn=mask), epochs=2)
    actual = nostall_losses(loader(collate_fn=mask), epochs=2, across_epochs=across_epochs)
    assert expected == actual


def test_a_dataset_drawing_from_the_global_generator_sees_the_plain_loops_draws() -> None:
    expected = train(lambda: loader(Jittered()))
    assert expected == nostall_losses(loader(Jittered()), depth=4)


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_over_a_dataset_whose_draws_escape_are_exact(threads: int) -> None:
    """Its samples are loaded one at a time, in order: the plain loop's draws."""
    expected = train(lambda: loader(Dropped()))
    assert expected == nostall_losses(loader(Dropped()), threads=threads)


def test_a_clear_source_through_threads_matches_itself_and_warns_nothing() -> None:
    """A dataset that draws nothing: threads load it in parallel, no warning."""
    expected = train(lambda: loader())
    prefetcher = nostall.prefetch(loader(), "cpu", threads=2)
    assert expected == train(lambda: prefetcher)
    assert not prefetcher._lineage.epochs.draws.in_step


def test_the_warning_names_what_drew_and_the_fix_once_at_the_users_line() -> None:
    """A loop that draws from the collator's generator too (dropout): in step, and told."""
    prefetcher = nostall.prefetch(loader(collate_fn=mask), "cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # a second epoch: said once
            for _ in prefetcher:
                torch.rand(())  # the step's own draw, from torch's generator
    assert [GlobalDrawsWarning] == [w.category for w in seen]
    assert __file__ == seen[0].filename
    message = str(seen[0].message)
    assert "the DataLoader's dataset (Features) or its collate_fn (mask)" in message
    assert TORCH in message
    assert "nothing is fetched ahead" in message
    assert "DataCollatorForLanguageModeling(..., seed=0)" in message
    assert "num_workers=2" in message
    assert "nostall.prefetch(loader, threads=2)" in message


def test_under_threads_the_warning_names_what_escapes_and_the_fix() -> None:
    with pytest.warns(GlobalDrawsWarning, match=r"torch\.thread_safe_generator\(\)") as seen:
        for _ in nostall.prefetch(loader(Dropped()), "cpu", threads=2):
            pass
    assert __file__ == seen[0].filename
    message = str(seen[0].message)
    assert "nothing is loaded in parallel or ahead" in message
    assert "F.dropout" in message
    assert "torch.rand/torch.randint" in message
    assert "may differ from run to run" not in message  # seen at the first sample: none were
    assert f"one such call: F.dropout at {__file__}:{DROPPED_LINE}, in a loading thread" in message


@pytest.mark.parametrize("timeout", [0, 30], ids=["in-parallel", "in-step-under-timeout"])
def test_under_threads_draws_seen_after_a_parallel_batch_are_said_to_vary(timeout: int) -> None:
    """Escaped draws seen only after the threads loaded a batch: the warning says it varies.

    Under a loader ``timeout=`` nothing is loaded on trial (one sample at a time, in order):
    the same draws on every run, and the warning says nothing of the kind.
    """
    source = DataLoader(DroppedLater(), batch_size=4, timeout=timeout)
    with pytest.warns(GlobalDrawsWarning) as seen:
        for _ in nostall.prefetch(source, "cpu", threads=2):
            pass
    assert __file__ == seen[0].filename
    message = str(seen[0].message)
    assert "nothing is loaded in parallel or ahead" in message
    assert (timeout == 0) == ("may differ from run to run" in message)


def test_a_later_prefetcher_over_a_loader_whose_draws_escaped_loads_in_step_at_once() -> None:
    """A prefetcher made each epoch: the second loads one sample at a time from its first batch.

    Its first batch is then the same on every run (not loaded in parallel to find out again),
    and its warning says where the draws were seen, without the "may differ" of the first.
    """
    source = DataLoader(DroppedLater(), batch_size=4)
    messages = []
    for _ in range(2):
        prefetcher = nostall.prefetch(source, "cpu", threads=2)
        with pytest.warns(GlobalDrawsWarning) as seen:
            for _ in prefetcher:
                pass
        messages.append(str(seen[0].message))
    assert "may differ from run to run" in messages[0]
    assert "may differ from run to run" not in messages[1]
    assert "seen by an earlier prefetcher over this DataLoader" in messages[1]
    other = nostall.prefetch(DataLoader(DroppedLater(), batch_size=4), "cpu", threads=2)
    assert other._lineage.epochs.draws.trial() is not None  # another loader: judged anew


class DroppedAfterFirst(Features):
    """:class:`Dropped`'s draws at every call but the very first one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lock = threading.Lock()

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        sample = super().__getitem__(i)
        return sample if first else nn.functional.dropout(sample, 0.1)


def test_draws_seen_at_a_trial_after_an_unjudged_parallel_batch_are_said_to_vary() -> None:
    """A shuffle drawn at the epoch's start leaves its first pull unjudged, loaded in parallel.

    The second batch's first sample is seen drawing: the first batch's escaped draws had come
    in the threads' order, and the warning says so.
    """
    source = DataLoader(DroppedAfterFirst(), batch_size=4, shuffle=True)
    with pytest.warns(GlobalDrawsWarning) as seen:
        for _ in nostall.prefetch(source, "cpu", threads=2):
            pass
    assert "may differ from run to run" in str(seen[0].message)


class ShufflingBatches(Sampler[list[int]]):
    """Batches of 4 in an order drawn per batch from Python's random, in the loop's thread."""

    def __len__(self) -> int:
        return SAMPLES // 4

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, SAMPLES, 4):
            batch = list(range(start, start + 4))
            random.shuffle(batch)
            yield batch


def test_a_batch_sampler_drawing_per_batch_is_not_said_to_vary_nor_remembered() -> None:
    """Its draws come in the loop's thread before the samples: in order, not the samples'."""
    source = DataLoader(Features(), batch_sampler=ShufflingBatches())
    with pytest.warns(GlobalDrawsWarning) as seen:
        for _ in nostall.prefetch(source, "cpu", threads=2):
            pass
    assert "may differ from run to run" not in str(seen[0].message)
    later = nostall.prefetch(source, "cpu", threads=2)
    assert not later._lineage.epochs.draws.remembered


def test_a_loader_seen_escaping_at_a_first_sample_is_remembered_for_threads_only() -> None:
    """Seen by a trial's first sample: remembered; a prefetcher without threads judges anew."""
    source = loader(Dropped())
    with pytest.warns(GlobalDrawsWarning):
        for _ in nostall.prefetch(source, "cpu", threads=2):
            pass
    assert nostall.prefetch(source, "cpu", threads=2)._lineage.epochs.draws.remembered
    without = nostall.prefetch(source, "cpu")._lineage.epochs.draws
    assert (False, Watch.WATCHING) == (without.remembered, without.state)


def test_draws_of_the_transform_given_to_nostall_are_not_held_against_the_loader() -> None:
    """An escaping transform=: the loader is not remembered (a later prefetcher judges anew)."""
    source = DataLoader(Features(), batch_size=4)
    noisy = nostall.prefetch(
        source, "cpu", threads=2, transform=lambda b: nn.functional.dropout(b, 0.1)
    )
    with pytest.warns(GlobalDrawsWarning):
        for _ in noisy:
            pass
    assert not nostall.prefetch(source, "cpu", threads=2)._lineage.epochs.draws.remembered


@pytest.mark.parametrize(
    ("collate", "generator"), [(python_noise, PYTHON), (numpy_noise, NUMPY)], ids=["random", "np"]
)
def test_pythons_and_numpys_global_generators_are_watched(
    collate: Callable[[list[torch.Tensor]], torch.Tensor], generator: str
) -> None:
    """Each seen on its own: the loop draws from the collate's generator too."""
    np = pytest.importorskip("numpy")
    draw = random.random if collate is python_noise else np.random.rand
    with pytest.warns(GlobalDrawsWarning, match=generator):
        drawing_loop(nostall.prefetch(loader(collate_fn=collate), "cpu"), draw)


def test_a_transform_drawing_from_the_global_generator_is_named() -> None:
    def noisy(batch: torch.Tensor) -> torch.Tensor:
        return batch + torch.rand(())

    with pytest.warns(GlobalDrawsWarning, match="or the transform= given to nostall"):
        drawing_loop(nostall.prefetch(loader(), "cpu", transform=noisy), lambda: torch.rand(()))


class Counting(Features):
    """Counts the samples loaded; draws nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = 0

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded += 1
        return super().__getitem__(i)


@pytest.mark.parametrize(
    ("shuffle", "judged"), [(False, 1), (True, 2)], ids=["sequential", "shuffled-globally"]
)
def test_a_source_that_draws_nothing_is_prefetched_after_its_judged_batch(
    shuffle: bool, judged: int
) -> None:
    """The batches up to the judged one come in step; then the producer runs ahead.

    The first batch is judged where the sampler draws nothing at the epoch's start; a
    RandomSampler without a generator draws the shuffle there, so the second one is.
    """
    dataset = Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = iter(nostall.prefetch(DataLoader(dataset, batch_size=4, shuffle=shuffle), depth=3))
        for _ in range(judged):
            assert it._lineage.epochs.draws.in_step
            next(it)
        assert not it._lineage.epochs.draws.in_step
        wait_until(lambda: dataset.loaded == 4 * (judged + 3), "three batches fetched ahead")
        assert 12 - judged == len(list(it))


def test_a_source_drawing_as_the_loop_does_is_never_pulled_ahead() -> None:
    dataset = Counting()

    def drawing(batch: list[torch.Tensor]) -> torch.Tensor:
        return mask(batch)

    it = iter(nostall.prefetch(DataLoader(dataset, batch_size=4, collate_fn=drawing), "cpu"))
    loaded: list[int] = []

    def taken() -> Iterator[int]:
        for _ in range(5):
            next(it)
            loaded.append(dataset.loaded)
            yield loaded[-1]

    with pytest.warns(GlobalDrawsWarning):
        drawing_loop(taken(), lambda: torch.rand(()))  # the collate's generator too
    assert [4, 8, 12, 16, 20] == loaded  # nothing more than what the loop took


def test_worker_processes_are_not_watched_and_see_the_plain_loops_draws() -> None:
    """Workers draw from their own seeds; the base seed is drawn where the plain loop draws it."""

    def build() -> DataLoader[Any]:
        return loader(Jittered(), collate_fn=mask, num_workers=2)

    expected = train(build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefetcher = nostall.prefetch(build(), "cpu")
        assert not prefetcher._lineage.epochs.draws.in_step
        assert expected == train(lambda: prefetcher)


def test_a_timeout_still_holds_while_pulling_in_step() -> None:
    """In step, the producer pulls while the loop waits, so timeout= still bounds the wait."""
    release = threading.Event()

    class Stalls(Jittered):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 4:
                release.wait(30)
            return super().__getitem__(i)

    it = iter(nostall.prefetch(DataLoader(Stalls(), batch_size=4), "cpu", timeout=0.3))
    next(it)  # judged: it draws, so it stays in step
    torch.rand(())  # and so does the loop: in step for good
    # Said at the next call, before it takes anything (see test_iteration's warnings made
    # errors); that call still waits at most the timeout.
    with pytest.warns(GlobalDrawsWarning), pytest.raises(PrefetchTimeoutError):
        next(it)
    release.set()
    assert 11 == len(list(it))


def test_snapshots_see_each_generator_and_nothing_else() -> None:
    np = pytest.importorskip("numpy")
    before = snapshot()
    assert () == moved(before, snapshot())
    torch.rand(1)
    random.random()
    np.random.rand()
    assert (TORCH, PYTHON, NUMPY) == moved(before, snapshot())
    assert CUDA not in moved(before, snapshot())


def test_a_trial_names_each_generator_drawn_from_and_puts_nothing_back() -> None:
    np = pytest.importorskip("numpy")
    seen: list[tuple[str, ...]] = []
    trial = Trial(seen.append)
    drawn = (torch.rand(2), random.random(), np.random.rand(), np.random.standard_normal())
    assert (TORCH, PYTHON, NUMPY) == trial.judge()
    after = (torch.rand(2), random.random(), np.random.rand(), np.random.standard_normal())
    assert not torch.equal(drawn[0], after[0])  # nothing drawn again
    assert drawn[1] != after[1]
    assert (TORCH, PYTHON, NUMPY) == trial.judge()  # judged once
    assert [(TORCH, PYTHON, NUMPY)] == seen
    assert () == Trial(seen.append).judge()


def test_another_threads_draws_during_a_trial_are_not_drawn_again() -> None:
    """A thread of the user's drawing from torch's generator meanwhile: no value twice.

    A trial that saw the generator move used to put it back, and that thread then drew the
    same values again (about 50 a run). Now it only reads as the source's draws (the warning
    says it may be another thread's), and the batches are the loader's.
    """
    values: list[float] = []
    stop = threading.Event()

    def draws() -> None:
        while not stop.is_set():
            values.append(torch.rand((), dtype=torch.float64).item())  # no chance repeats

    expected = list(DataLoader(Features(), batch_size=4))
    drawer = threading.Thread(target=draws)
    drawer.start()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = list(nostall.prefetch(DataLoader(Features(), batch_size=4), "cpu", threads=4))
    finally:
        stop.set()
        drawer.join(30)
    assert_same_batches(expected, got)
    assert len(values) == len(set(values)), "a value was drawn twice"
    for warning in seen:
        assert issubclass(warning.category, GlobalDrawsWarning), warning
        assert "another thread of yours drawing then looks the same" in str(warning.message)


class DrawingBatches(Sampler[list[int]]):
    """Pairs of indices in order, drawing from torch's global generator at every batch."""

    def __len__(self) -> int:
        return SAMPLES // 2

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(len(self)):
            torch.rand(())
            yield [2 * k, 2 * k + 1]


class CountedDropped(Dropped):
    def __init__(self) -> None:
        super().__init__()
        self.fetched = 0
        self.lock = threading.Lock()

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.fetched += 1
        return super().__getitem__(i)


@pytest.mark.parametrize(
    "build",
    [
        lambda: DataLoader(CountedDropped(), batch_size=1),
        lambda: DataLoader(CountedDropped(), batch_size=3, shuffle=True),
        lambda: DataLoader(CountedDropped(), batch_size=5),
        lambda: DataLoader(Features(), batch_sampler=DrawingBatches()),  # none ahead
    ],
    ids=["one-per-batch", "shuffled", "batch-past-threads", "drawing-sampler"],
)
def test_threads_fetch_the_first_batches_on_trial_and_stay_exact(
    build: Callable[[], DataLoader[Any]],
) -> None:
    """The first batch's first sample is judged alone; one whose draws escape stays in step.

    Its samples are then fetched one at a time, in order, each once (nothing is put back and
    fetched again); the losses are the plain loop's. A sampler of the user's may draw at every
    batch: no batch is started ahead of the loop on a trial.
    """
    expected = train(build)
    source = build()
    assert expected == nostall_losses(source, threads=4)
    dataset = source.dataset
    if isinstance(dataset, CountedDropped):
        assert SAMPLES == dataset.fetched


def test_lists_and_worker_loaders_start_clear() -> None:
    assert not DrawWatch(classify([torch.zeros(1)])).in_step
    assert DrawWatch(classify([torch.zeros(1)]), transform=True).in_step
    assert DrawWatch(classify(loader())).in_step


@pytest.mark.cuda
def test_a_collator_drawing_from_cudas_generator_is_seen() -> None:
    torch.zeros(1, device="cuda")  # CUDA initialised, as in a training process

    def cuda_mask(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(batch) * torch.rand((), device="cuda").cpu()

    before = snapshot()
    torch.rand(1, device="cuda")
    assert CUDA in moved(before, snapshot())
    with pytest.warns(GlobalDrawsWarning, match=r"torch\.cuda's generator"):
        for _ in nostall.prefetch(loader(collate_fn=cuda_mask), "cuda"):
            pass


@pytest.mark.cuda
def test_on_cuda_a_collator_drawing_from_the_global_generator_sees_the_plain_loops_draws() -> None:
    """Dropout on the GPU, masks drawn on the CPU, batches copied on nostall's stream."""

    def run(batches: Callable[[], Iterable[torch.Tensor]]) -> list[float]:
        net = model().cuda()
        torch.manual_seed(0)
        losses = []
        for batch in batches():
            out = net(batch.cuda(non_blocking=True))
            loss = out.pow(2).mean() + torch.rand(()).cuda()  # the loop draws on the CPU too
            loss.backward()
            losses.append(loss.item())
        return losses

    expected = run(lambda: loader(collate_fn=mask))
    with pytest.warns(GlobalDrawsWarning):
        actual = run(lambda: nostall.prefetch(loader(collate_fn=mask), "cuda"))
    assert expected == actual


def test_a_language_modelling_collator_with_seed_none_sees_the_plain_loops_draws() -> None:
    """Hugging Face's DataCollatorForLanguageModeling (seed=None) and a BERT with dropout."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate([*special, *(f"w{i}" for i in range(20))])}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        **{f"{name}_token": f"[{name.upper()}]" for name in ("pad", "unk", "cls", "sep", "mask")},
    )
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    examples = [{"input_ids": [2, *(5 + (i * 7 + j) % 20 for j in range(8)), 3]} for i in range(32)]
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )

    def run(batches: Callable[[], Iterable[Any]]) -> list[float]:
        torch.manual_seed(1)
        bert = transformers.BertForMaskedLM(config).train()
        optimiser = torch.optim.SGD(bert.parameters(), lr=0.1)
        torch.manual_seed(0)
        losses = []
        for batch in batches():
            loss = bert(**batch).loss
            loss.backward()
            optimiser.step()
            optimiser.zero_grad()
            losses.append(loss.item())
        return losses

    def build() -> DataLoader[Any]:
        return DataLoader(examples, batch_size=4, shuffle=True, collate_fn=collator)  # type: ignore[arg-type]

    expected = run(build)
    with pytest.warns(GlobalDrawsWarning, match="collate_fn \\(DataCollatorForLanguageModeling\\)"):
        actual = run(lambda: nostall.prefetch(build(), "cpu"))
    assert expected == actual


class SlowDrawing(Dataset[torch.Tensor]):
    """Each sample waits, then draws from torch's global generator."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.5)
        return torch.rand(1)


@pytest.mark.filterwarnings("ignore::nostall._sources.global_draws.GlobalDrawsWarning")
def test_draws_of_a_loop_that_caught_a_timeout_are_never_put_back() -> None:
    """With timeout=, next() may return (PrefetchTimeoutError) and the loop draws meanwhile.

    A first batch fetched by the threads on trial would put the generators back when it found
    the samples drew, taking the loop's draws back with them: its numbers would come again.
    With a timeout there is no trial, so every number drawn is new.
    """
    torch.manual_seed(0)
    batches = nostall.prefetch(DataLoader(SlowDrawing(), batch_size=2), threads=4, timeout=0.1)
    it = iter(batches)
    drawn = []
    while True:
        try:
            drawn += next(it).flatten().tolist()
            break
        except nostall.PrefetchTimeoutError:
            drawn.append(torch.rand(1).item())  # the loop does something else meanwhile
    drawn += torch.rand(3).tolist()
    batches.close()
    assert len(drawn) == len(set(drawn)), drawn


def train_apart(
    batches: Callable[[], Iterable[torch.Tensor]],
    epochs: int = 1,
    draws_torch_from: int | None = None,
) -> list[float]:
    """Losses of a loop whose step draws from Python's random (a loss scale), not torch's.

    From epoch ``draws_torch_from`` on, the step draws from torch's generator too.
    """
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
    optimiser = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.manual_seed(0)
    random.seed(0)
    losses = []
    for epoch in range(epochs):
        for batch in batches():
            scale = 1 + random.random() / 100
            if draws_torch_from is not None and epoch >= draws_torch_from:
                scale += float(torch.rand(())) / 100
            loss = net(batch).pow(2).mean() * scale
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
    return losses


class Watched(Jittered):
    """Jittered, counting the samples fetched."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched = 0

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("across_epochs", [False, True])
def test_a_source_drawing_apart_from_the_loop_is_prefetched_with_the_plain_loops_draws(
    across_epochs: bool,
) -> None:
    """The source draws from torch's generator, the step from Python's: prefetched, exact.

    Each generator is watched on its own: the step was seen drawing from none of the
    source's, so loading ahead changes no draw; the losses are the plain loop's, and the
    source is pulled ahead of the loop (no warning).
    """

    # Across epochs, the next epoch's order is drawn ahead: from a generator of its own.
    def order() -> dict[str, Any]:
        return {"generator": torch.Generator().manual_seed(3)} if across_epochs else {}

    plain = loader(Jittered(), **order())
    expected = train_apart(lambda: plain, epochs=2)
    dataset = Watched()
    source = loader(dataset, **order())
    prefetcher = nostall.prefetch(source, "cpu", across_epochs=across_epochs)
    held: list[int] = []

    def batches() -> Iterator[torch.Tensor]:
        for k, batch in enumerate(prefetcher):
            if not held and k == 3:  # batch 2's step was seen: batches 4 and 5 load meanwhile
                wait_until(lambda: dataset.fetched >= 6 * 4, "loaded ahead", timeout=30)
                held.append(k)
            yield batch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert expected == train_apart(batches, epochs=2)
    assert [3] == held
    assert Watch.APART is prefetcher._lineage.epochs.draws.state
    assert not prefetcher._lineage.epochs.draws.in_step


def test_a_loop_that_starts_drawing_from_the_sources_generator_is_caught_and_told() -> None:
    """From epoch 2 the step draws from torch's generator, which the source draws from too.

    Seen between two pulls (or at a recheck), the source goes back in step for good, and a
    warning at the loop's line says what drew and that batches loaded ahead drew otherwise.
    """
    prefetcher = nostall.prefetch(loader(Jittered()), "cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train_apart(lambda: prefetcher, epochs=4, draws_torch_from=2)
    assert [GlobalDrawsWarning] == [w.category for w in seen]
    assert __file__ == seen[0].filename
    message = str(seen[0].message)
    assert "and so does your loop: it drew from torch's global generator" in message
    assert "drew in another order than without nostall" in message
    draws = prefetcher._lineage.epochs.draws
    assert Watch.DRAWS is draws.state
    assert draws.in_step


def state_of(watch: DrawWatch) -> Watch:
    """The watch's state, read anew (it changes inside the calls between two reads)."""
    return watch.state


def in_step(watch: DrawWatch) -> bool:
    return watch.in_step


def test_a_recheck_sees_the_loop_drawing_while_every_pull_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop whose draws always fall inside a pull is seen at the next recheck."""
    monkeypatch.setattr(global_draws, "RECHECK_PULLS", 3)
    watch = DrawWatch(classify(loader(Jittered())))
    watch.pull(lambda: torch.rand(()), first=False)  # judged: draws from torch's
    watch.handed_out()
    random.random()  # the loop's own draw, from another generator
    watch.step_seen()
    assert Watch.APART is state_of(watch)
    assert not in_step(watch)
    for _ in range(3):  # the loop draws while each pull runs: no pull sees it
        watch.pull(lambda: (torch.rand(()), torch.rand(())), first=False)
    assert Watch.RECHECK is state_of(watch)
    assert in_step(watch)
    watch.handed_out()
    torch.rand(())  # the loop, alone between two batches
    watch.step_seen()
    assert Watch.DRAWS is state_of(watch)
    assert "torch's global generator, between two batches, as the source does" == watch.caught


def test_a_recheck_that_sees_nothing_goes_back_to_prefetching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(global_draws, "RECHECK_PULLS", 2)
    watch = DrawWatch(classify(loader(Jittered())))
    watch.pull(lambda: torch.rand(()), first=False)
    watch.handed_out()
    watch.step_seen()
    for _ in range(2):
        watch.pull(lambda: torch.rand(()), first=False)
    assert Watch.RECHECK is state_of(watch)
    watch.handed_out()
    watch.step_seen()
    assert Watch.APART is state_of(watch)
    watch.pull(lambda: torch.rand(()), first=False)
    torch.rand(())  # between two pulls: seen there
    watch.pull(lambda: torch.rand(()), first=False)
    assert Watch.DRAWS is state_of(watch)
    assert watch.caught is not None
    assert "between two batches loaded ahead" in watch.caught


def test_a_look_at_the_loop_while_a_pull_ran_does_not_count() -> None:
    watch = DrawWatch(classify(loader(Jittered())))
    watch.pull(lambda: torch.rand(()), first=False)
    watch.handed_out()
    watch.pull(lambda: torch.rand(()), first=False)  # a pull between: not the loop alone
    watch.step_seen()
    assert 0 == watch.loop_seen
    assert Watch.WATCHING is state_of(watch)


def test_a_state_saved_while_a_drawing_source_is_loaded_ahead_holds_its_generators() -> None:
    """Inside an epoch the state holds the source's generators as after its last batch.

    The user's checkpoint saves them ahead of the loop (the batches loaded ahead drew); a
    resumed run sets them back after skipping, and draws on as the uninterrupted one did
    (tests/test_silent_differences.py). Where it cannot (at an epoch's end), it warns.
    """
    prefetcher = nostall.prefetch(loader(Jittered()), "cpu")
    it = iter(prefetcher)
    for _ in range(4):
        next(it)
        random.random()  # the loop draws from another generator: the source is loaded ahead
    assert Watch.APART is prefetcher._lineage.epochs.draws.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = prefetcher.state_dict()
    saved = state["replay"]["source_draws"]
    assert ["torch"] == list(saved)
    with pytest.raises(ValueError, match=r"\['source_draws'\]"):
        nostall.prefetch(loader(Jittered()), "cpu").load_state_dict(
            {**state, "replay": {**state["replay"], "source_draws": {"torch": "?"}}}
        )
    for _ in it:  # every batch handed out, the end not asked for yet: the next epoch's start
        random.random()
    with pytest.warns(GlobalDrawsWarning, match="state_dict\\(\\) while batches of") as seen:
        prefetcher.state_dict()
    assert __file__ == seen[0].filename
    assert "load with threads=2" in str(seen[0].message)


def test_an_epoch_opened_in_the_loops_thread_is_not_read_as_the_loops_draw() -> None:
    """Opening draws (a DataLoader's base seed) between two looks: that look does not count.

    A loop that never asks for an epoch's end (Lightning takes len() batches) opens the next
    epoch at its next next(), after the last batch it took, before any pull.
    """
    watch = DrawWatch(classify(loader(Jittered())))
    watch.pull(lambda: torch.rand(()), first=False)
    watch.handed_out()
    watch.forget_left()  # the next epoch, opened in the loop's thread
    torch.rand(())  # as DataLoader.__iter__ draws its base seed
    watch.step_seen()
    assert 0 == watch.loop_seen
    assert Watch.WATCHING is state_of(watch)
