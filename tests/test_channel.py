"""The bounded hand-off, driven directly: slots, order, timeouts, a dead producer, auto growth."""

from __future__ import annotations

import threading

import pytest
import torch

from nostall import PrefetcherClosedError, PrefetchTimeoutError, ProducerDiedError
from nostall._engine.channel import BATCH, END, Channel, Kind, Message


def message(i: int, kind: Kind = BATCH) -> Message:
    return kind, torch.tensor(i), 0, None, None


def never() -> bool:
    return False


def live_producer(channel: Channel) -> threading.Event:
    """A "producer" thread that stays alive until the returned event is set."""
    done = threading.Event()
    channel.thread = threading.Thread(target=done.wait, args=(30,), name="nostall-test-fake")
    channel.producing.set()  # as the iteration marks it when it starts a producer thread
    channel.thread.start()
    return done


def test_messages_come_out_in_the_order_they_were_put() -> None:
    channel = Channel(3, "list")
    done = live_producer(channel)
    for i in range(3):
        assert channel.acquire(never)
        channel.put(message(i))
    assert [0, 1, 2] == [int(channel.get(i, None)[1]) for i in range(3)]
    done.set()


def test_slots_bound_what_is_in_flight() -> None:
    """With ``depth`` messages queued the producer cannot take another slot until one is taken."""
    channel = Channel(2, "list")
    done = live_producer(channel)
    assert channel.acquire(never)
    assert channel.acquire(never)
    channel.put(message(0))
    channel.put(message(1))
    blocked = threading.Event()
    got: list[bool] = []

    def third() -> None:
        blocked.set()
        got.append(channel.acquire(never))

    producer = threading.Thread(target=third)
    producer.start()
    blocked.wait(5)
    assert not got  # still waiting (it polls; a free slot would have been taken at once)
    channel.get(0, None)
    producer.join(10)
    assert [True] == got
    done.set()


def test_acquire_gives_up_waiting_without_holding_a_slot() -> None:
    """``give_up`` is asked while no slot is free; a free slot is taken without asking it."""
    channel = Channel(1, "list")
    assert channel.acquire(lambda: True)  # a free slot: taken (the producer looks again)
    assert not channel.acquire(lambda: True)  # none free: given up, none held
    channel.give_back()
    assert channel.acquire(never)  # the one slot is free again: giving up took none


def test_give_back_frees_the_slot() -> None:
    channel = Channel(1, "list")
    assert channel.acquire(never)
    channel.give_back()
    assert channel.acquire(never)


def test_wake_to_stop_releases_a_producer_waiting_for_a_slot() -> None:
    channel = Channel(1, "list")
    assert channel.acquire(never)
    answers: list[bool] = []
    producer = threading.Thread(target=lambda: answers.append(channel.acquire(never)))
    producer.start()
    channel.wake_to_stop()
    producer.join(10)
    assert [False] == answers


def test_put_ready_grows_the_depth_to_hold_carried_messages() -> None:
    """Messages carried over from a deeper channel: the depth grows, the invariant holds."""
    channel = Channel(1, "list")
    for i in range(3):
        channel.put_ready(message(i))
    assert 3 == channel.depth
    channel.thread = threading.current_thread()
    channel.producing.set()  # as the iteration marks a producer it starts
    assert [0, 1, 2] == [int(channel.get(i, None)[1]) for i in range(3)]
    for _ in range(3):  # every slot came back
        assert channel.acquire(never)


def test_timeout_names_what_the_producer_is_doing() -> None:
    channel = Channel(1, "Slow", phase=lambda: "next(source) for batch 0")
    done = live_producer(channel)
    with pytest.raises(PrefetchTimeoutError, match=r"from Slow; .* busy with next\(source\)") as e:
        channel.get(0, 0.05)
    assert (0, "next(source) for batch 0", "nostall-test-fake") == (
        e.value.batch,
        e.value.phase,
        e.value.thread,
    )
    assert channel.acquire(never)  # nothing was lost: a message put now is the next one
    channel.put(message(7))
    assert 7 == int(channel.get(0, 1.0)[1])
    done.set()


def test_pull_here_is_asked_only_when_nothing_is_queued_and_no_timeout_is_set() -> None:
    channel = Channel(1, "list")
    done = live_producer(channel)
    asked: list[int] = []

    def pull_here() -> Message | None:
        asked.append(1)
        return message(9)

    assert channel.acquire(never)
    channel.put(message(0))
    assert 0 == int(channel.get(0, None, pull_here)[1])  # queued: taken, not pulled here
    assert 9 == int(channel.get(1, None, pull_here)[1])  # nothing queued: pulled here
    assert 1 == len(asked)
    assert channel.acquire(never)  # the message pulled here took no slot
    channel.give_back()
    with pytest.raises(PrefetchTimeoutError):
        channel.get(2, 0.05, pull_here)  # with a timeout it only waits
    assert 1 == len(asked)
    done.set()


def test_an_exception_of_a_pull_here_keeps_no_frame_of_the_consumer() -> None:
    """A pull in the consumer's thread is not made while the queue's Empty is being handled.

    Otherwise what the pull raises, even one its source catches and keeps (accelerate's loader
    yields its last batch inside ``except StopIteration``), chains that Empty, whose traceback
    holds the training loop's frames: the prefetcher and its thread were never collected.
    """
    channel = Channel(1, "list")
    done = live_producer(channel)
    raised: list[BaseException] = []

    def pull_here() -> Message | None:
        try:
            raise StopIteration
        except StopIteration as e:
            raised.append(e)
        return message(1)

    try:
        channel.get(0, None, pull_here)
    finally:
        done.set()
    assert None is raised[0].__context__


def test_a_dead_producer_is_reported_not_waited_for() -> None:
    channel = Channel(1, "x")
    with pytest.raises(ProducerDiedError):
        channel.get(0, None)  # none at all
    # It ends as produce() ends: clearing ``producing`` as its last step.
    channel.producing.set()
    channel.thread = threading.Thread(target=channel.producing.clear, name="nostall-test-dead")
    channel.thread.start()
    channel.thread.join()
    with pytest.raises(ProducerDiedError, match="nostall-test-dead") as e:
        channel.get(0, None, lambda: pytest.fail("a dead producer's source is not pulled here"))
    assert "nostall-test-dead" == e.value.thread


def test_a_consumer_waiting_when_the_channel_is_let_go_is_told_why() -> None:
    """Let go while the consumer waits (close() in another thread): why, never "a bug"."""
    channel = Channel(1, "x")
    waiting = threading.Event()

    def producer() -> None:  # ends without a message once the channel is let go, as produce()
        waiting.wait(60)
        channel.stop.wait(60)

    channel.thread = threading.Thread(target=producer)
    channel.thread.start()

    def close() -> None:
        waiting.set()
        channel.wake_to_stop("it was closed")

    threading.Timer(0.05, close).start()
    with pytest.raises(PrefetcherClosedError, match=r"waited for batch 4 .*: it was closed"):
        channel.get(4, None)
    channel.thread.join()


def test_the_last_message_of_a_producer_that_ended_is_delivered() -> None:
    channel = Channel(1, "x")

    def produce_then_end() -> None:
        assert channel.acquire(never)
        channel.put(message(3, END))

    channel.thread = threading.Thread(target=produce_then_end)
    channel.thread.start()
    channel.thread.join()
    assert END == channel.get(0, None)[0]


def test_auto_depth_doubles_when_the_queue_runs_dry_up_to_its_limit() -> None:
    channel = Channel(1, "list", max_depth=1)
    done = live_producer(channel)
    channel.limit_growth(4)
    depths = []
    for i in range(4):
        channel.get(i, None, lambda i=i: message(i))  # type: ignore[misc]  # nothing queued each time: it grows
        depths.append(channel.depth)
    assert [2, 4, 4, 4] == depths
    held = [channel.acquire(never) for _ in range(4)]
    assert all(held)  # 4 slots, all free
    done.set()


def test_drain_frees_the_slots_of_what_it_takes() -> None:
    channel = Channel(2, "list")
    for i in range(2):
        assert channel.acquire(never)
        channel.put(message(i))
    assert [0, 1] == [int(m[1]) for m in channel.drain()]
    assert channel.acquire(never)
    assert channel.acquire(never)


def test_slots_count_what_is_free_and_wake_a_waiter() -> None:
    """Slots: taken and given back, read without a private field, a waiter woken."""
    from nostall._engine.channel import Slots

    slots = Slots(2)
    assert slots.acquire()
    assert slots.acquire()
    assert 0 == slots.value
    assert not slots.acquire(blocking=False)
    assert not slots.acquire(timeout=0.01)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(timeout=60)))
    waiter.start()
    slots.release()
    waiter.join(60)
    assert [True] == got
    slots.release(2)
    assert 2 == slots.value
