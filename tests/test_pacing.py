"""Pacing the pulls of loading threads: after the consumer's launches, never making it wait.

What ``threads=`` loads (batches, order, per-sample draws) is tested in test_threads.py and
test_threaded_stream.py; here, when the producer starts a pull.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from helpers import wait_until
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._engine.channel import Channel
from nostall._exceptions import PrefetchTimeoutError
from nostall._loading.pacing import WINDOW, Pacer


def paced(step: float, pull: float, last: float = 1000.0) -> Pacer:
    """A pacer that saw a full window of steps of ``step`` s and pulls of ``pull`` s."""
    pacer = Pacer()
    pacer.handoffs.extend(last - step * k for k in range(WINDOW, -1, -1))
    pacer.pulls.extend([pull] * WINDOW)
    return pacer


def test_no_start_before_a_window_of_steps_and_pulls() -> None:
    """Fewer than WINDOW steps or pulls seen: the pull starts at once."""
    pacer = paced(0.1, 0.01)
    pacer.pulls.pop()
    assert pacer.start_at() is None
    pacer = paced(0.1, 0.01)
    pacer.handoffs.popleft()
    assert pacer.start_at() is None


def test_no_start_within_a_window_of_the_consumer_waiting() -> None:
    """The consumer found nothing queued lately: loading keeps up only just, no wait."""
    pacer = paced(0.1, 0.01)
    pacer.hurry_up()
    assert pacer.start_at() is None
    for _ in range(WINDOW):
        pacer.handed_off()
    assert pacer.start_at() is None  # WINDOW hand-offs: WINDOW - 1 steps since the wait
    pacer.handoffs.clear()
    pacer.handoffs.extend(1000.0 + 0.1 * k for k in range(1, WINDOW + 2))  # steps of 0.1 s
    assert pacer.start_at() == pytest.approx(1000.0 + 0.1 * (WINDOW + 1) + 0.1 - 0.01)


def test_start_is_the_last_handoff_plus_the_median_step_less_the_longest_pull() -> None:
    """The slack after the last hand-off; none without slack."""
    pacer = paced(0.1, 0.03)
    pacer.handoffs[0] -= 5.0  # one long step (an epoch's end) does not move the median
    pacer.pulls[0] = 0.05  # the longest pull counts: pull times have a long tail
    assert pacer.start_at() == pytest.approx(1000.0 + 0.1 - 0.05)
    assert paced(0.1, 0.15).start_at() is None
    assert paced(0.1, 0.2).start_at() is None


class Hurry(threading.Event):
    """A pacer's ``hurry`` that tells when someone waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


def waiting(pacer: Pacer, queued: bool) -> threading.Thread:
    """A thread that waits in ``pacer.wait`` as the producer does: started, and waiting.

    Unless ``queued`` is False: then it does not wait, and ends on its own.
    """
    hurry = pacer.hurry = Hurry()
    thread = threading.Thread(target=pacer.wait, args=(lambda: queued,), daemon=True)
    thread.start()
    if queued:
        assert hurry.waited.wait(timeout=30), "the producer never waited"
    return thread


def test_no_wait_while_nothing_is_queued() -> None:
    """The consumer would wait for this pull: it starts at once, whatever the slack."""
    pacer = paced(600.0, 1.0, last=time.monotonic())
    thread = waiting(pacer, queued=False)
    wait_until(lambda: not thread.is_alive(), "done with the pull started at once")


def test_a_consumer_finding_nothing_queued_ends_the_wait() -> None:
    """``Channel.get`` on an empty queue hurries the producer waiting to pull."""
    pacer = paced(600.0, 1.0, last=time.monotonic())
    channel = Channel(2, "a test source", pacer=pacer)
    thread = waiting(pacer, queued=True)
    alive = threading.Event()  # the producer thread, as the channel sees it, lives on
    channel.thread = threading.Thread(target=alive.wait, args=(60,), daemon=True)
    channel.producing.set()  # as the iteration marks a producer it starts
    channel.thread.start()
    try:
        with pytest.raises(PrefetchTimeoutError):
            channel.get(0, timeout=0.01)
        wait_until(lambda: not thread.is_alive(), "the producer hurried")
    finally:
        alive.set()


def test_letting_the_channel_go_ends_the_wait() -> None:
    """A channel let go (close, exit) wakes the producer waiting to pull."""
    pacer = paced(600.0, 1.0, last=time.monotonic())
    channel = Channel(2, "a test source", pacer=pacer)
    thread = waiting(pacer, queued=True)
    channel.wake_to_stop()
    wait_until(lambda: not thread.is_alive(), "the producer woken")


def test_handoffs_are_recorded_by_the_consumers_get() -> None:
    """Each message the consumer gets is a hand-off, queued or waited for."""
    pacer = Pacer()
    channel = Channel(2, "a test source", pacer=pacer)
    assert channel.slots.acquire(blocking=False)
    channel.put(("batch", 0, 0, None, None))  # type: ignore[arg-type]
    channel.get(0, timeout=None)
    assert 1 == len(pacer.handoffs)


class Stamped(Dataset[int]):
    """Samples that record when each one starts loading."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.started: list[float] = []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        self.started.append(time.monotonic())
        time.sleep(0.002)  # GIL-free, as a decoder's call
        return index


@pytest.mark.perf
def test_threaded_loading_starts_after_the_consumers_launch_window() -> None:
    """With slack, a batch's loading starts after the first part of the consumer's step.

    Steps of 40 ms whose first 8 ms stand for the launch phase, batches of 2 that load in
    a few ms: unpaced, each refill starts at the hand-off, inside that window; paced, it
    starts about the slack later. Past the first window, at most a third start inside it.
    """
    dataset = Stamped(48)
    loader = DataLoader(dataset, batch_size=2)
    handoffs, out = [], []
    for batch in nostall.prefetch(loader, "cpu", threads=2):
        handoffs.append(time.monotonic())
        out.append(batch)
        time.sleep(0.04)
    assert torch.equal(torch.cat(out), torch.arange(48))
    starts = dataset.started[2 * (WINDOW + 3) :]  # paced from here on
    inside = sum(any(h <= s < h + 0.008 for h in handoffs) for s in starts)
    assert inside <= len(starts) / 3, (inside, len(starts))


def test_threaded_epochs_share_one_pacer_and_keep_their_batches() -> None:
    """Every epoch of a ``threads=`` prefetcher is paced by the same pacer; batches unchanged."""
    loader: DataLoader[Any] = DataLoader(Stamped(20), batch_size=4, shuffle=True)
    prefetcher = nostall.prefetch(loader, "cpu", threads=2)
    pacer = prefetcher._lineage.epochs.pacer  # where the loading threads' pacer lives
    assert pacer is not None
    seen: list[float] = []
    real = pacer.handed_off

    def counted() -> None:
        seen.append(time.monotonic())
        real()

    pacer.handed_off = counted  # type: ignore[method-assign]
    torch.manual_seed(0)
    expected = [list(loader), list(loader)]
    torch.manual_seed(0)
    got = [list(prefetcher), list(prefetcher)]
    assert [[b.tolist() for b in epoch] for epoch in expected] == [
        [b.tolist() for b in epoch] for epoch in got
    ]
    assert 12 == len(seen)  # both epochs' 5 batches and ends, handed off through one pacer


def test_a_consumer_taking_its_last_queued_batch_early_ends_the_wait() -> None:
    """Review finding: a step much shorter than the recent ones must not leave the pull waiting.

    Steps of 600 s so far, so the producer waits about a step for its pull while a batch is
    queued. The consumer takes that batch at once (a short step after long ones): nothing is
    queued now, and it will want the next batch within about as short a step; a producer
    still waiting out the long step's slack would keep it waiting for a whole pull, which
    an unpaced producer, pulling since the hand-off before, had done by then.
    """
    pacer = paced(600.0, 1.0, last=time.monotonic())
    channel = Channel(2, "a test source", pacer=pacer)
    assert channel.slots.acquire(blocking=False)
    channel.put(("batch", 0, 0, None, None))  # type: ignore[arg-type]
    hurry = pacer.hurry = Hurry()
    thread = threading.Thread(target=pacer.wait, args=(lambda: not channel.empty(),), daemon=True)
    thread.start()
    assert hurry.waited.wait(timeout=30), "the producer never waited"
    channel.get(1, timeout=None)  # the queued batch, taken at once: nothing queued now
    wait_until(lambda: not thread.is_alive(), "the producer started its pull")


def test_after_a_drain_a_last_step_shorter_than_the_median_is_the_step_allowed() -> None:
    """After steps of 0.1 s, one of 0.02 s that emptied the queue: the slack is taken from it.

    At a wait's start the median stands (a step a little short must not move the pull
    into the launches).
    """
    pacer = paced(0.1, 0.01)
    pacer.handoffs.append(1000.02)
    assert pacer.start_at(drained=True) == pytest.approx(1000.02 + 0.02 - 0.01)
    assert pacer.start_at() == pytest.approx(1000.02 + 0.1 - 0.01)
