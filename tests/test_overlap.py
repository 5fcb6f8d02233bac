"""Pulling ahead or inline: the rule on a fake clock, and the batches whatever the way."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall import PrefetcherClosedError
from nostall._engine.overlap import Overlap, Phase


class FakePuller:
    """Records every switch it is told of."""

    def __init__(self) -> None:
        self.inline = False
        self.switches: list[bool] = []

    def set_inline(self, inline: bool) -> None:
        self.inline = inline
        self.switches.append(inline)


class Clock:
    """``time.perf_counter`` for the overlap: moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def run(
    overlap: Overlap, puller: FakePuller, clock: Clock, batches: int, ahead: float, inline: float
) -> None:
    """Hand out ``batches``, each taking ``ahead`` or ``inline`` seconds as the puller pulls."""
    for _ in range(batches):
        clock.now += inline if puller.inline else ahead
        overlap.handed_out(puller, depth=2)


def small(clock: Clock, **changes: Any) -> Overlap:
    settings: dict[str, Any] = dict(warmup=2, window=4, window_s=0.0, margin=0.05, hold=8)
    settings.update(max_hold=64, clock=clock)
    settings.update(changes)
    return Overlap(**settings)


def test_inline_is_chosen_when_it_is_faster_by_the_margin(clock: Clock) -> None:
    """Ahead 1.0 s a batch, inline 0.5: probed after the warm-up, switched, and kept."""
    overlap, puller = small(clock), FakePuller()
    run(overlap, puller, clock, 40, ahead=1.0, inline=0.5)
    assert overlap.inline
    assert puller.inline
    assert (False, 1.0, 0.5) == overlap.probes[0]
    assert [True] == puller.switches[:1]  # switched once to probe, and stayed


def test_ahead_is_kept_when_inline_is_not_faster_by_the_margin(clock: Clock) -> None:
    """Inline 3% faster is within the margin: the producer keeps running ahead."""
    overlap, puller = small(clock), FakePuller()
    run(overlap, puller, clock, 25, ahead=1.0, inline=0.97)
    assert not overlap.inline
    assert not puller.inline
    assert [True, False] == puller.switches[:2]  # probed inline, then back


def test_the_way_in_use_is_left_only_for_one_faster_by_the_margin(clock: Clock) -> None:
    """Inline in use, ahead 3% faster: it stays inline (no flapping between equals)."""
    overlap, puller = small(clock), FakePuller()
    run(overlap, puller, clock, 2 + 4 + 3 + 4, ahead=1.0, inline=0.5)
    assert (True, True) == (overlap.inline, puller.inline)
    run(overlap, puller, clock, 8 + 4 + 3 + 4, ahead=0.97, inline=1.0)
    assert (True, 0.97, 1.0) == pytest.approx(overlap.probes[-1])  # in use, ahead, inline
    assert (True, True) == (overlap.inline, puller.inline)


def test_a_probe_of_the_worse_way_stops_early(clock: Clock) -> None:
    """Inline 3x slower: the probe ends once it took longer than the whole ahead window."""
    overlap, puller = small(clock), FakePuller()
    run(overlap, puller, clock, 2 + 4 + 3 + 2, ahead=1.0, inline=3.0)
    assert [True, False] == puller.switches  # 2 of 4 inline batches were enough
    assert Phase.HOLD is overlap.phase
    assert [] == overlap.probes  # lost before its window ended: nothing to compare


def test_a_clearly_worse_way_stops_after_one_window_of_batches(clock: Clock) -> None:
    """A long first window (window_s) and inline 3x slower: stopped after ``window`` batches."""
    overlap, puller = small(clock, window_s=20.0), FakePuller()
    run(overlap, puller, clock, 2 + 20 + 3, ahead=1.0, inline=3.0)  # 20 s of ahead, settled
    assert Phase.SECOND is overlap.phase
    run(overlap, puller, clock, 4, ahead=1.0, inline=3.0)  # 12 s of 20: not past the window
    assert (Phase.HOLD, [True, False]) == (overlap.phase, puller.switches)


def test_a_far_worse_way_stops_after_a_quarter_window(clock: Clock) -> None:
    """Batches slow enough that a window is many seconds: a way 3x slower stops after 4."""
    overlap, puller = small(clock, window=16, window_s=0.0), FakePuller()
    run(overlap, puller, clock, 2 + 16 + 3, ahead=1.0, inline=3.0)
    assert Phase.SECOND is overlap.phase
    run(overlap, puller, clock, 3, ahead=1.0, inline=3.0)
    assert Phase.SECOND is overlap.phase  # 3 batches: not enough to judge
    run(overlap, puller, clock, 1, ahead=1.0, inline=3.0)
    assert (Phase.HOLD, [True, False]) == (overlap.phase, puller.switches)


def test_a_confirmed_choice_is_held_longer_each_time(clock: Clock) -> None:
    """Each probe that confirms the way in use doubles the hold, quadruples it when clear."""
    overlap, puller = small(clock, hold=8, max_hold=10_000), FakePuller()
    run(overlap, puller, clock, 2 + 4 + 3 + 4, ahead=1.0, inline=1.04)
    assert 16 == overlap.hold  # 1.04 is not 1.5 times 1.0: doubled
    run(overlap, puller, clock, 16 + 4 + 3 + 8, ahead=1.0, inline=2.0)
    assert 64 == overlap.hold  # twice as slow: quadrupled


def test_a_new_choice_starts_the_hold_again(clock: Clock) -> None:
    overlap, puller = small(clock, hold=8), FakePuller()
    run(overlap, puller, clock, 2 + 4 + 3 + 4, ahead=1.0, inline=1.04)
    assert (16, False) == (overlap.hold, overlap.inline)
    run(overlap, puller, clock, 16 + 4 + 3 + 4, ahead=1.0, inline=0.5)
    assert (8, True) == (overlap.hold, overlap.inline)


def test_a_pass_boundary_interrupts_a_probe_and_keeps_the_way_in_use(clock: Clock) -> None:
    """An epoch's end mid-probe: nothing is timed across it; the new puller pulls ahead."""
    overlap, puller = small(clock), FakePuller()
    run(overlap, puller, clock, 2 + 4 + 3 + 1, ahead=1.0, inline=0.5)  # inside the inline window
    assert (True, Phase.SECOND) == (puller.inline, overlap.phase)
    overlap.interrupted(None)
    fresh = FakePuller()
    fresh.inline = True  # as left by the probe, say
    overlap.interrupted(fresh)
    assert not fresh.inline
    assert (Phase.HOLD, overlap.warmup) == (overlap.phase, overlap.left)


def test_a_slow_window_is_timed_for_at_least_window_s(clock: Clock) -> None:
    """Fast batches: the first window lasts ``window_s``, not only ``window`` batches."""
    overlap, puller = small(clock, window_s=1.0), FakePuller()
    run(overlap, puller, clock, 2 + 4, ahead=0.01, inline=0.01)
    assert Phase.FIRST is overlap.phase  # 4 batches of 0.01 s: not a second yet
    run(overlap, puller, clock, 100, ahead=0.01, inline=0.01)
    assert Phase.FIRST is not overlap.phase


def test_fix_keeps_one_way(clock: Clock) -> None:
    overlap, puller = small(clock), FakePuller()
    overlap.fix(inline=True)
    overlap.interrupted(puller)
    run(overlap, puller, clock, 1000, ahead=0.1, inline=10.0)
    assert [True] == puller.switches


# -- the batches, whatever the way ---------------------------------------------------------------


@pytest.fixture
def restless(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefetcher's overlap probes all the time: the way changes every few batches."""
    import nostall._engine.lineage as lineage

    monkeypatch.setattr(
        lineage, "Overlap", lambda: Overlap(warmup=1, window=2, window_s=0.0, hold=2, max_hold=3)
    )


def _noisy_steps(batches: Iterator[Any]) -> list[int]:
    """Consume, with steps of uneven length so that either way wins some probes."""
    got = []
    for i, batch in enumerate(batches):
        got.append(int(batch.sum()))
        if i % 3 == 0:
            torch.randn(200, 200) @ torch.randn(200, 200)
    return got


@pytest.mark.usefixtures("restless")
@pytest.mark.parametrize("across_epochs", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_once_in_order_while_the_way_changes(across_epochs: bool, workers: int) -> None:
    """Three epochs of a shuffled DataLoader: the same batches as the loader's own."""

    def loader() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(3)
        return DataLoader(
            as_dataset(range(90)),
            batch_size=3,
            shuffle=True,
            generator=g,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    plain = loader()
    want = []
    for _ in range(3):
        want += [int(b.sum()) for b in plain]
    prefetcher = nostall.prefetch(loader(), "cpu", across_epochs=across_epochs)
    got = []
    for _ in range(3):
        got += _noisy_steps(iter(prefetcher))
    assert want == got
    switches = prefetcher._lineage.overlap.switches
    assert switches > 10, "the way hardly changed: this proves nothing"


@pytest.mark.usefixtures("restless")
def test_an_error_mid_epoch_while_the_way_changes() -> None:
    """A batch that raises: the rest of the epoch follows it, in order, as with the loader."""

    class Flaky(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            if i in (7, 23):
                raise ValueError(f"sample {i}")
            return torch.tensor([i])

    got: list[int | str] = []
    prefetcher = nostall.prefetch(DataLoader(Flaky(), batch_size=None), "cpu")
    it = iter(prefetcher)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except ValueError as e:
            got.append(str(e))
            continue
        got.append(int(batch))
    want: list[int | str] = [f"sample {i}" if i in (7, 23) else i for i in range(40)]
    assert want == got


@pytest.mark.usefixtures("restless")
def test_resume_mid_epoch_while_the_way_changes() -> None:
    """A state saved while the way changes resumes at the next batch."""

    def loader() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(5)
        return DataLoader(as_dataset(range(60)), batch_size=2, shuffle=True, generator=g)

    full = [int(b.sum()) for b in loader()]
    for stop in (5, 17, 29):
        first = nostall.prefetch(loader(), "cpu")
        it = iter(first)
        head = [int(next(it).sum()) for _ in range(stop)]
        state = first.state_dict()
        first.close()
        second = nostall.prefetch(loader(), "cpu")
        second.load_state_dict(state)
        assert full == head + [int(b.sum()) for b in second]


def test_close_reaches_a_consumer_pulling_inline_behind_a_slow_pull() -> None:
    """Switched inline while the producer is inside a slow pull: close() still ends next()."""
    release, entered = threading.Event(), threading.Event()

    def source() -> Iterator[torch.Tensor]:
        for i in range(10):
            if i == 3:
                entered.set()
                release.wait(30)  # the producer stays inside the source until the test ends
            yield torch.tensor([i])

    prefetcher = nostall.prefetch(source(), "cpu")
    prefetcher._lineage.overlap.fix(inline=False)
    it = iter(prefetcher)
    try:
        assert [0, 1, 2] == [int(next(it)) for _ in range(3)]
        assert entered.wait(10), "the producer never reached batch 3"
        prefetcher._lineage.overlap.fix(inline=True)
        puller = it._puller
        assert puller is not None
        puller.set_inline(True)  # as a probe switches it
        closer = threading.Timer(0.2, prefetcher.close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(PrefetcherClosedError):
            next(it)
        assert time.monotonic() - start < 10  # the close, not the end of the slow pull
        release.set()  # the producer leaves the source: close() stops waiting for it
        closer.join()
    finally:
        release.set()


@pytest.mark.filterwarnings("error")
def test_pulling_inline_across_epochs_draws_nothing_ahead() -> None:
    """Inline, each epoch opens at its first pull, in this thread: no "drawn ahead" warning."""
    loader = DataLoader(as_dataset(range(12)), batch_size=3)  # draws its base seed at iter()
    prefetcher = nostall.prefetch(loader, "cpu", across_epochs=True)
    prefetcher._lineage.overlap.fix(inline=True)
    for _ in range(3):
        assert [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] == [b.tolist() for b in prefetcher]
