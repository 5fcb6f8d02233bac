"""The bounded channel and the producer loop, driven directly."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nostall import PrefetchTimeoutError, ProducerDiedError
from nostall._channel import BATCH, END, ERROR, Channel, add_note, produce, stop_all_producers
from nostall._transfer import Staging


def start(channel: Channel, batches: object) -> threading.Thread:
    thread = threading.Thread(
        target=produce,
        args=(channel, iter(batches), Staging(torch.device("cpu"))),  # type: ignore[call-overload]
        name="nostall-test-producer",
        daemon=True,
    )
    channel.thread = thread
    thread.start()
    return thread


def test_messages_in_order_then_end() -> None:
    """Batches arrive in order, then the end with the count."""
    channel = Channel(2, "list")
    start(channel, [torch.tensor(i) for i in range(5)])
    kinds = [channel.get(i, None) for i in range(6)]
    assert [BATCH] * 5 + [END] == [k for k, _ in kinds]
    assert [0, 1, 2, 3, 4] == [int(p.batch) for _, p in kinds[:5]]
    assert 5 == kinds[5][1]


def test_slots_bound_what_is_in_flight() -> None:
    """With nobody consuming, the producer pulls exactly depth batches."""
    pulled = []

    def source():  # type: ignore[no-untyped-def]
        for i in range(100):
            pulled.append(i)
            yield torch.tensor(i)

    channel = Channel(3, "gen")
    thread = start(channel, source())
    time.sleep(0.3)
    assert 3 == len(pulled)
    channel.stop.set()
    thread.join(1)
    assert not thread.is_alive()


def test_error_message_carries_the_same_object() -> None:
    """An error in the source is sent as the object, with a note."""
    error = ValueError("v")

    def source():  # type: ignore[no-untyped-def]
        yield torch.tensor(0)
        raise error

    channel = Channel(2, "gen")
    start(channel, source())
    assert BATCH == channel.get(0, None)[0]
    kind, payload = channel.get(1, None)
    assert ERROR == kind
    assert payload is error


def test_timeout_while_the_producer_is_busy() -> None:
    """get() with a timeout names the phase the producer is in."""

    def source():  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        yield torch.tensor(0)

    channel = Channel(1, "Slow")
    start(channel, source())
    with pytest.raises(PrefetchTimeoutError, match=r"from Slow; .* busy with next\(source\)"):
        channel.get(0, 0.1)
    assert BATCH == channel.get(0, None)[0]


def test_get_without_a_producer_raises() -> None:
    """No thread and nothing queued: ProducerDiedError at once, not a hang."""
    with pytest.raises(ProducerDiedError):
        Channel(1, "x").get(0, None)


def test_stop_all_producers_stops_live_threads() -> None:
    """The exit hook stops every live producer."""
    channel = Channel(1, "gen")
    thread = start(channel, (torch.tensor(i) for i in range(1000)))
    time.sleep(0.05)
    stop_all_producers(timeout=2.0)
    assert not thread.is_alive()


def test_add_note_without_add_note_support() -> None:
    """On Python 3.10 the note is kept in __notes__ all the same."""

    class OldStyle(Exception):
        add_note = None  # type: ignore[assignment]

    error = OldStyle()
    del OldStyle.add_note
    add_note(error, "first")
    add_note(error, "second")
    assert ["first", "second"] == error.__notes__
