"""The puller and the producer thread, driven directly (a Channel, a Puller, ``produce``)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from helpers import settle, wait_until

import nostall
from nostall import PrefetchTimeoutError
from nostall._engine.channel import BATCH, END, ERROR, FAILED, Channel
from nostall._engine.producer import Puller
from nostall._engine.producer_thread import produce, stop_all_producers
from nostall._epochs.epochs import EpochSource
from nostall._staging.base import Staging

CPU = torch.device("cpu")


def puller_over(batches: Iterable[Any], depth: int = 1, describe: str = "list") -> Puller:
    puller = Puller(Channel(depth, describe), Staging(CPU), EpochSource([], False))
    puller.batches = iter(batches)
    return puller


def start(depth: int, describe: str, batches: Iterable[Any]) -> Puller:
    puller = puller_over(batches, depth, describe)
    thread = threading.Thread(
        target=produce, args=(puller,), name="nostall-test-producer", daemon=True
    )
    puller.channel.thread = thread
    puller.channel.producing.set()  # as the iteration marks a producer it starts
    thread.start()
    return puller


def take(puller: Puller, index: int, timeout: float | None = None) -> Any:
    if puller.epochs.draws.in_step:  # as PrefetchIterator asks, while a source may draw
        puller.want(wake=True)
    return puller.channel.get(index, timeout, puller.pull_here)


def test_messages_in_order_then_end() -> None:
    """Batches arrive in order, then the end with the count."""
    puller = start(2, "list", [torch.tensor(i) for i in range(5)])
    messages = [take(puller, i) for i in range(6)]
    assert [BATCH] * 5 + [END] == [m[0] for m in messages]
    assert [0, 1, 2, 3, 4] == [int(m[1].batch) for m in messages[:5]]
    assert 5 == messages[5][1]


def test_the_producer_pulls_at_most_depth_ahead() -> None:
    """With nobody consuming, the producer pulls exactly depth batches."""
    pulled = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(100):
            pulled.append(i)
            yield torch.tensor(i)

    puller = start(3, "gen", source())
    wait_until(lambda: len(pulled) >= 3, "3 pulled")
    settle()
    assert 3 == len(pulled)
    puller.stop()
    thread = puller.channel.thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert puller.batches is None  # the producer let the source's iterator go


def test_an_error_is_the_same_object_with_a_note_and_the_epoch_goes_on() -> None:
    error = ValueError("v")

    def source() -> Iterator[torch.Tensor]:
        yield torch.tensor(0)
        raise error

    puller = start(2, "gen", source())
    assert BATCH == take(puller, 0)[0]
    kind, payload, _, _, _ = take(puller, 1)
    assert ERROR == kind
    assert payload is error
    assert any("raised by next(source) for batch 1" in n for n in error.__notes__)
    assert puller.after_error
    assert not puller.finished


def test_an_error_in_iter_source_ends_the_epoch() -> None:
    """Across epochs the next epoch's iter(source) failing is FAILED: nothing follows."""

    class Once:
        calls = 0

        def __iter__(self) -> Iterator[torch.Tensor]:
            self.calls += 1
            if self.calls > 1:
                raise OSError("gone")
            return iter([torch.tensor(0)])

    epochs = EpochSource(Once(), True)
    puller = Puller(Channel(4, "Once"), Staging(CPU), epochs)
    puller.open(0, forward=False)
    puller.asks_for_end = True
    puller.channel.thread = threading.current_thread()
    puller.channel.producing.set()  # as the iteration marks a producer it starts
    kinds = [take(puller, i)[0] for i in range(3)]
    assert [BATCH, END, FAILED] == kinds
    assert puller.finished


def test_timeout_while_the_producer_is_busy() -> None:
    """get() with a timeout names the phase the producer is in; nothing is lost."""
    inside = threading.Event()
    release = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        inside.set()
        release.wait(30)
        yield torch.tensor(0)

    puller = start(1, "Slow", source())
    inside.wait(10)
    with pytest.raises(PrefetchTimeoutError, match=r"from Slow; .* busy with next\(source\)"):
        take(puller, 0, 0.05)
    release.set()
    assert BATCH == take(puller, 0)[0]


def test_consumer_pulls_itself_when_the_producer_is_idle() -> None:
    """Nothing queued and the producer not pulling: the consumer pulls, in order, no slot."""
    puller = puller_over([torch.tensor(i) for i in range(3)])
    puller.channel.thread = threading.current_thread()  # a live "producer" that never pulls
    puller.channel.producing.set()  # as the iteration marks a producer it starts
    assert puller.channel.acquire(lambda: False)  # as if the producer held the only slot
    out = [take(puller, i) for i in range(4)]
    assert [BATCH, BATCH, BATCH, END] == [m[0] for m in out]
    assert [0, 1, 2] == [int(m[1].batch) for m in out[:3]]
    assert puller.batches is None


def test_consumer_waits_while_the_producer_pulls() -> None:
    """The producer inside next(source): the consumer waits for that batch; pulls never overlap."""
    in_next = threading.Event()
    spans: list[tuple[str, float, float]] = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(4):
            begin = time.monotonic()
            in_next.set()
            time.sleep(0.05)  # the work of a slow source
            spans.append((threading.current_thread().name, begin, time.monotonic()))
            yield torch.tensor(i)

    puller = start(1, "Slow", source())
    in_next.wait(10)
    out = [take(puller, i) for i in range(5)]
    assert [0, 1, 2, 3] == [int(m[1].batch) for m in out[:4]]
    assert "nostall-test-producer" == spans[0][0]  # the batch being pulled was waited for
    for (_, _, end), (_, begin, _) in itertools.pairwise(spans):
        assert end <= begin  # one puller at a time


def test_the_end_of_a_sized_epoch_is_pulled_only_when_asked() -> None:
    """len(source) batches pulled: the gate stays shut until the consumer asks for the end."""
    puller = Puller(Channel(4, "list"), Staging(CPU), EpochSource([1, 2], False))
    puller.open(0, forward=False)
    puller.channel.thread = threading.current_thread()
    puller.channel.producing.set()  # as the iteration marks a producer it starts
    assert [BATCH, BATCH] == [take(puller, i)[0] for i in range(2)]
    assert not puller.gate_open()
    assert puller.pull_here() is None  # not asked for: not pulled here either
    puller.ask_for_end()
    assert puller.gate_open()
    assert END == take(puller, 2)[0]


def test_stop_all_producers_stops_live_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit hook stops every live producer."""
    from nostall import _exit

    # The hook marks the process as exiting (loading pools then take no work): only here.
    monkeypatch.setattr(_exit, "exiting", threading.Event())
    puller = start(1, "gen", (torch.tensor(i) for i in range(1000)))
    wait_until(lambda: puller.pulled >= 1, "a batch pulled")
    stop_all_producers(timeout=10.0)
    assert puller.channel.thread is not None
    assert not puller.channel.thread.is_alive()


def test_a_pull_the_consumer_made_meanwhile_closes_the_gate_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer saw the gate open for the last batch; the consumer pulled it itself first.

    The producer must not then ask the source past its length (a RandomSampler would draw once
    more from the loader's generator, and the next epoch's order would change under a
    framework that takes len() batches and never asks for the end). This forces that
    interleaving, which a loaded machine produced now and then.
    """
    asked_past_end: list[bool] = []

    class Counted:
        def __len__(self) -> int:
            return 3

        def __iter__(self) -> Iterator[torch.Tensor]:
            yield from (torch.tensor([i]) for i in range(3))
            asked_past_end.append(True)

    consumer_pulled_last, producer_held = threading.Event(), threading.Event()
    original = Puller.wait_at_gate

    def slow_gate(self: Puller) -> bool:
        open_now = original(self)
        if self.expected is not None and self.pulled == self.expected - 1:
            producer_held.set()  # it saw the gate open for the last batch, and is held up
            consumer_pulled_last.wait(10)
        return open_now

    monkeypatch.setattr(Puller, "wait_at_gate", slow_gate)
    it = iter(nostall.prefetch(Counted(), "cpu", depth=1))
    got = [next(it).tolist() for _ in range(2)]
    assert producer_held.wait(10)
    got.append(next(it).tolist())  # nothing queued: the consumer pulls the last batch itself
    consumer_pulled_last.set()
    settle()
    assert [[0], [1], [2]] == got
    assert [] == asked_past_end
    it.close()
