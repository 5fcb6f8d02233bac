"""The DataLoader internals nostall relies on (``nostall._torch_compat``), on the torch at hand.

These are premises about torch, not about nostall: when torch changes them, these tests fail
first, and the version pin says when they were last checked.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader, SequentialSampler
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import nostall
from nostall._torch_compat import CHECKED_TORCH, copy_loader, dead_workers_behind, live_iterator


def test_the_installed_torch_is_one_these_internals_were_checked_on() -> None:
    """A new torch release: check the premises below, then add it to CHECKED_TORCH."""
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert major_minor in CHECKED_TORCH, (
        f"torch {torch.__version__}: check nostall._torch_compat against it, then add "
        f"{major_minor!r} to CHECKED_TORCH"
    )


def test_a_persistent_loader_keeps_its_iterator_where_nostall_reads_it() -> None:
    loader = DataLoader(
        as_dataset(list(range(4))), batch_size=2, num_workers=1, persistent_workers=True
    )
    assert live_iterator(loader) is None  # fresh: no workers yet
    list(loader)
    first = live_iterator(loader)
    assert first is not None
    list(loader)
    assert live_iterator(loader) is first  # the same workers, epoch after epoch
    first._shutdown_workers()  # type: ignore[attr-defined]


def test_a_built_loader_refuses_a_sampler_and_a_copy_takes_one() -> None:
    loader = DataLoader(as_dataset(list(range(6))), batch_size=2)
    reverse = list(reversed(range(6)))
    with pytest.raises(ValueError, match="sampler attribute should not be set"):
        loader.sampler = reverse
    clone = copy_loader(
        loader,
        sampler=reverse,
        batch_sampler=torch.utils.data.BatchSampler(reverse, 2, drop_last=False),
    )
    assert [b.tolist() for b in clone] == [[5, 4], [3, 2], [1, 0]]
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]  # the original unchanged
    assert isinstance(loader.sampler, SequentialSampler)


def test_a_copy_leaves_the_original_its_workers() -> None:
    loader = DataLoader(
        as_dataset(list(range(4))), batch_size=2, num_workers=1, persistent_workers=True
    )
    list(loader)
    workers = live_iterator(loader)
    assert isinstance(workers, _MultiProcessingDataLoaderIter)
    clone = copy_loader(loader)
    assert live_iterator(clone) is None
    assert live_iterator(loader) is workers
    workers._shutdown_workers()


@pytest.fixture
def no_sigchld_handler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Without torch's SIGCHLD handler: the bare error is what is under test.

    The handler would raise its own account of a worker's death into the main thread.
    """
    monkeypatch.setattr(signal_handling, "_set_SIGCHLD_handler", lambda: None)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGCHLD, previous)


def _kill_workers(it: Any) -> None:
    """SIGKILL the iterator's workers and reap them."""
    for worker in it._workers:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=60)
        assert not worker.is_alive()


@pytest.mark.usefixtures("no_sigchld_handler")
def test_a_bare_queue_error_comes_through_while_the_worker_looks_alive() -> None:
    """torch re-raises the queue's own error while no worker is seen dead.

    The helper finds the iterator the error came through and, once the worker is dead, names
    it, waiting a while for a worker that is dying; not a worker torch no longer counts on.
    """
    loader = DataLoader(as_dataset(list(range(8))), batch_size=2, num_workers=1)
    it = iter(loader)
    assert isinstance(it, _MultiProcessingDataLoaderIter)
    next(it)

    def ended(*args: object, **kwargs: object) -> None:
        raise EOFError

    it._data_queue.get = ended  # type: ignore[method-assign]
    with pytest.raises(EOFError) as caught:
        next(it)
    assert [] == dead_workers_behind(caught.value, wait_s=0.1)  # its worker is alive
    worker = it._workers[0]
    assert worker.pid is not None  # started
    os.kill(worker.pid, signal.SIGKILL)  # dying, not yet reaped: the helper waits for it
    (dead,) = dead_workers_behind(caught.value, wait_s=60)
    assert f"pid {worker.pid}, killed by SIGKILL" == dead
    it._workers_status[0] = False  # torch no longer counts on it
    assert [] == dead_workers_behind(caught.value, wait_s=0)
    it._shutdown_workers()


class _Ends(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        raise EOFError


def test_an_error_through_no_dataloader_iterator_names_no_worker() -> None:
    with pytest.raises(EOFError) as caught:
        next(iter(DataLoader(_Ends(), batch_size=2)))  # a loader without worker processes
    assert [] == dead_workers_behind(caught.value)


@pytest.mark.usefixtures("no_sigchld_handler")
@pytest.mark.parametrize(
    ("error", "named"),
    [
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (EOFError(), True),
        # torch's own account (it saw the death), and an error of another kind: no note.
        (RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed."), False),
        (TimeoutError("DataLoader timed out after 2 seconds"), False),
    ],
)
def test_a_worker_dead_behind_an_error_is_named_once(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, named: bool
) -> None:
    """The producer's note says which worker died where torch's error does not say it."""
    original = _MultiProcessingDataLoaderIter._try_get_data

    def dies(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._rcvd_idx == 2:  # the third batch: its worker dies handing it over
            _kill_workers(self)
            raise error
        return original(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_try_get_data", dies)
    loader = DataLoader(as_dataset(list(range(16))), batch_size=2, num_workers=1)
    with nostall.prefetch(loader, "cpu") as prefetcher:
        batches = iter(prefetcher)
        seen = [next(batches).tolist(), next(batches).tolist()]
        with pytest.raises(type(error)) as caught:
            next(batches)
    assert caught.value is error
    assert [[0, 1], [2, 3]] == seen  # every batch before it
    (note,) = [n for n in getattr(error, "__notes__", []) if n.startswith("nostall:")]
    assert "raised by next(source) for batch 2" in note
    assert named == ("a DataLoader worker having died (pid " in note), note
    assert named == ("killed by SIGKILL" in note), note
