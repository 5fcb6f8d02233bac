"""One pass over the source (``PrefetchIterator``): its lifecycle and where its errors arose.

Most of the iterator's behaviour is tested through the Prefetcher (test_prefetcher.py,
test_epochs.py, test_exit.py); here, what belongs to the iterator alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import (
    OneBadSample,
    SleepingSource,
    as_dataset,
    refused_thread_starts,
    wait_for_no_nostall_threads,
    wait_until,
)
from torch.utils.data import DataLoader

import nostall
from nostall._engine.channel import Channel


def nostall_notes(error: BaseException) -> list[str]:
    return [n for n in getattr(error, "__notes__", []) if n.startswith("nostall:")]


def test_an_error_raised_into_next_is_noted_once_with_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error raised into the consumer thread inside next() says where.

    PyTorch's SIGCHLD handler raises a dead DataLoader worker's error wherever the main thread
    is: waiting, pulling a batch itself, or between the two.
    """
    it = iter(nostall.prefetch(DataLoader(as_dataset(range(8)), batch_size=2), "cpu"))
    assert next(it).tolist() == [0, 1]
    real_get = Channel.get

    def raised_into_the_wait(self: Channel, *args: object, **kwargs: object) -> object:
        monkeypatch.setattr(Channel, "get", real_get)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    monkeypatch.setattr(Channel, "get", raised_into_the_wait)
    with pytest.raises(RuntimeError, match="DataLoader worker") as raised:
        next(it)
    assert nostall_notes(raised.value) == [
        "nostall: raised in the consumer thread during next() for batch 1 of this epoch"
    ]


def test_an_error_from_the_source_keeps_its_one_note() -> None:
    def source() -> Iterator[int]:
        yield 1
        raise KeyError("bad sample")

    it = iter(nostall.prefetch(source(), "cpu"))
    assert next(it) == 1
    with pytest.raises(KeyError) as raised:
        next(it)
    notes = nostall_notes(raised.value)
    assert len(notes) == 1
    assert "consumer thread during next()" not in notes[0]


def test_nostalls_own_errors_and_the_epochs_end_are_not_noted() -> None:
    prefetcher = nostall.prefetch(DataLoader(as_dataset(range(2)), batch_size=2), "cpu")
    it = iter(prefetcher)
    next(it)
    with pytest.raises(StopIteration) as ended:
        next(it)
    assert nostall_notes(ended.value) == []
    it = iter(prefetcher)
    it.close()
    with pytest.raises(nostall.PrefetcherClosedError) as closed:
        next(it)
    assert nostall_notes(closed.value) == []


def test_running_is_true_only_between_the_first_next_and_the_end() -> None:
    it = iter(nostall.prefetch(DataLoader(as_dataset(range(2)), batch_size=2), "cpu"))
    before = it.running
    next(it)
    during = it.running
    assert list(it) == []
    assert (False, True, False) == (before, during, it.running)


def test_the_depth_auto_chose_is_readable_during_and_after_the_epoch() -> None:
    prefetcher = nostall.prefetch(SleepingSource(12, 0.005, (4,)), "cpu", depth="auto")
    assert prefetcher.current_depth == 1
    it = iter(prefetcher)
    for _ in range(6):
        next(it)
    during = prefetcher.current_depth
    assert during == it.depth
    assert during >= 2  # the loop found nothing ready, and the depth grew
    rest = list(it)
    del it, rest
    assert prefetcher.current_depth >= during  # it never shrinks within an epoch
    assert prefetcher.depth == "auto"


def test_a_fixed_depth_is_the_current_depth() -> None:
    prefetcher = nostall.prefetch(SleepingSource(12, 0.005, (4,)), "cpu", depth=3)
    assert prefetcher.current_depth == 3
    for _ in prefetcher:
        pass
    assert prefetcher.current_depth == 3


def test_a_producer_paused_at_an_error_stays_paused_until_the_error_is_taken() -> None:
    """Batches queued before an error are taken without restarting the producer.

    So a loop that stops at the error leaves nothing running.
    """
    it = iter(nostall.prefetch(DataLoader(OneBadSample(), batch_size=2), "cpu", depth=4))
    assert next(it).tolist() == [0, 1]
    assert next(it).tolist() == [2, 3]  # watched for global draws: none, so it runs ahead
    puller = it._puller
    assert puller is not None
    wait_until(lambda: puller.after_error, "the producer pulled the failed batch")
    paused = it._lineage.producer.thread
    assert next(it).tolist() == [4, 5]  # queued before the error
    assert it._lineage.producer.thread is paused  # no producer started for what follows the error
    with pytest.raises(ValueError, match="sample 6"):
        next(it)
    assert it._lineage.producer.thread is paused
    assert next(it).tolist() == [8, 9]  # the loop caught it and asks on: producing resumes
    assert it._lineage.producer.thread is not paused


def test_a_refused_producer_thread_raises_the_os_error_then_next_goes_on() -> None:
    """The OS refuses the producer thread: next() raises its error once; the next one goes on."""
    p = nostall.prefetch(list(range(6)))
    it = iter(p)
    with (
        refused_thread_starts("nostall-prefetch", refusals=1),
        pytest.raises(RuntimeError, match="can't start new thread"),
    ):
        next(it)
    assert list(range(6)) == list(it)
    p.close()
    wait_for_no_nostall_threads()


# -- warnings turned into errors (python -W error), in a loop that catches and goes on -----------


def _every_batch_catching_warnings(
    batches: Any, draw: Callable[[], Any] = lambda: None
) -> tuple[list[Any], list[str]]:
    """One epoch as a loop that turns warnings into errors, catches them and goes on.

    Its step makes a ``draw()`` after each batch.
    """
    import warnings

    seen: list[Any] = []
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = iter(batches)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return seen, said
            except Warning as w:
                said.append(str(w))
                continue
            seen.append(batch.tolist())
            draw()


def _drawing_collate(items: list[int]) -> torch.Tensor:
    torch.rand(1)  # draws from torch's global generator, as a masking collator does
    return torch.tensor(items)


def test_a_draw_warning_made_an_error_loses_no_batch_and_the_epoch_ends() -> None:
    """Said once, before the next batch is taken: every batch, then the end (it hung before)."""
    loader = DataLoader(as_dataset(range(12)), batch_size=2, collate_fn=_drawing_collate)
    p = nostall.prefetch(loader, "cpu")
    seen, said = _every_batch_catching_warnings(p, lambda: torch.rand(()))  # as the collate
    p.close()
    assert [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]] == seen
    assert 1 == len(said)
    assert "draws from torch's global generator" in said[0]


def test_an_across_epochs_warning_made_an_error_loses_no_batch() -> None:
    """The order drawn ahead is said as the epoch starts; the epoch is there after it."""
    torch.manual_seed(0)
    loader = DataLoader(as_dataset(range(8)), batch_size=2, shuffle=True)
    p = nostall.prefetch(loader, "cpu", across_epochs=True)
    first, _ = _every_batch_catching_warnings(p)

    def opened_ahead() -> bool:  # the producer began the next epoch before the loop asked
        ahead = p._lineage._ahead
        return ahead is not None and (ahead.batches is not None or ahead.epoch in ahead.open_marks)

    wait_until(opened_ahead, "the producer to open the next epoch ahead")
    second, said = _every_batch_catching_warnings(p)
    p.close()
    for seen in (first, second):
        assert list(range(8)) == sorted(x for batch in seen for x in batch)
    assert 1 == len(said)
    assert "opened this epoch ahead" in said[0]


def test_an_exhausted_one_shot_source_warned_as_an_error_still_ends_its_epoch() -> None:
    p = nostall.prefetch(iter([torch.zeros(1), torch.ones(1)]), "cpu")
    assert [[0.0], [1.0]] == _every_batch_catching_warnings(p)[0]
    seen, said = _every_batch_catching_warnings(p)
    p.close()
    assert [] == seen
    assert 1 == len(said)
    assert "one-shot iterator that is exhausted" in said[0]


def test_a_same_epoch_warning_made_an_error_loses_no_batch() -> None:
    """A DistributedSampler left at one epoch: said as the third epoch opens, which goes on."""
    from torch.utils.data import DistributedSampler

    data = as_dataset(range(10))
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    p = nostall.prefetch(DataLoader(data, batch_size=5, sampler=sampler), "cpu")
    first, _ = _every_batch_catching_warnings(p)
    second, _ = _every_batch_catching_warnings(p)
    third, said = _every_batch_catching_warnings(p)  # said as the third opens
    p.close()
    assert first == second == third  # the same order: nobody set the epoch
    assert 1 == len(said)
    assert "set_epoch() was not called" in said[0]
