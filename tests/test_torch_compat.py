"""The DataLoader internals nostall relies on (``nostall._torch_compat``), on the torch at hand.

These are premises about torch, not about nostall: when torch changes them, these tests fail
first, and the version pin says when they were last checked.
"""

from __future__ import annotations

import ast
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader, SequentialSampler
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import nostall
from nostall._torch_compat import (
    CHECKED_TORCH,
    LoadingThreadInfo,
    answer_worker_info_per_thread,
    copy_loader,
    dead_workers_behind,
    default_device_is_cpu,
    empty_shared_uint8,
    live_iterator,
)


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


def test_a_loading_threads_worker_info_is_torchs_thread_worker_info() -> None:
    """In the block, get_worker_info() here is torch's WorkerInfo for a thread; after it, None."""
    answer_worker_info_per_thread()
    dataset, rng = as_dataset([1, 2]), object()
    with LoadingThreadInfo(worker=1, workers=4, seed=7, dataset=dataset, rng=rng) as info:
        seen = torch.utils.data.get_worker_info()
        again = torch.utils.data.get_worker_info()
    assert torch.utils.data.get_worker_info() is None
    assert isinstance(seen, torch.utils.data._utils.worker.WorkerInfo)  # torch's own class
    fields = (seen.id, seen.num_workers, seen.seed, seen.dataset, seen.rng, seen.worker_method)
    assert (1, 4, 7, dataset, rng, "thread") == fields
    assert info.worker_info() is seen
    assert again is seen  # one WorkerInfo for the block, as a worker process has one


def test_other_threads_get_torchs_own_worker_info() -> None:
    """While one thread holds a loading thread's info, another thread still gets None."""
    answer_worker_info_per_thread()
    seen: list[object] = []
    with LoadingThreadInfo(worker=0, workers=1, seed=0, dataset=None, rng=None):
        other = threading.Thread(target=lambda: seen.append(torch.utils.data.get_worker_info()))
        other.start()
        other.join(timeout=60)
    assert [None] == seen


@pytest.mark.skipif(
    not hasattr(torch, "thread_safe_generator"),
    reason=f"torch {torch.__version__} has no torch.thread_safe_generator()",
)
def test_thread_safe_generator_reads_the_loading_threads_generator() -> None:
    """torch.thread_safe_generator() looks get_worker_info up on each call: it finds ours."""

    class Rng:
        torch_generator = torch.Generator().manual_seed(3)

    answer_worker_info_per_thread()
    with LoadingThreadInfo(worker=0, workers=1, seed=3, dataset=None, rng=Rng()):
        assert Rng.torch_generator is torch.thread_safe_generator()
    assert torch.thread_safe_generator() is None


def test_default_device_is_cpu_answers_as_torch_does() -> None:
    """Its quick answer where nothing is set; torch's own under a device mode or default.

    Asked in a thread of its own: a default device set there stays there.
    """
    answers: list[tuple[bool, bool]] = []

    def ask() -> None:
        def both() -> tuple[bool, bool]:
            return default_device_is_cpu(), torch.get_default_device().type == "cpu"

        answers.append(both())
        with torch.device("meta"):
            answers.append(both())
        torch.set_default_device("meta")
        try:
            answers.append(both())
        finally:
            torch.set_default_device(None)
        answers.append(both())

    asking = threading.Thread(target=ask)
    asking.start()
    asking.join(30)
    assert [(True, True), (False, False), (False, False), (True, True)] == answers


def test_an_empty_shared_tensor_is_in_shared_memory() -> None:
    """The uint8 tensor of the shape asked for, its storage shared."""
    out = empty_shared_uint8((2, 3, 4))
    shared = out.is_shared()  # type: ignore[no-untyped-call]
    assert (torch.uint8, (2, 3, 4), True) == (out.dtype, tuple(out.shape), shared)


def test_an_empty_shared_tensor_without_new_shared_is_still_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without UntypedStorage._new_shared: the same tensor, by share_memory_()."""
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None)
    out = empty_shared_uint8((2, 3, 4))
    shared = out.is_shared()  # type: ignore[no-untyped-call]
    assert (torch.uint8, (2, 3, 4), True) == (out.dtype, tuple(out.shape), shared)


#: Names nostall's modules import torch under are found per file; these say what was touched.
_REPLACES = "replaces torch's {} process-wide"
_PRIVATE = "uses torch's private {}"


def _torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or to something imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _dotted(node: ast.expr, torch_names: set[str]) -> list[str] | None:
    """``torch.a.b`` as ["torch", "a", "b"], when the chain starts at a torch name; else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in torch_names:
        return None
    return [node.id, *reversed(parts)]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _by_name(node: ast.AST, torch_names: set[str]) -> tuple[str, list[str], ast.expr] | None:
    """``getattr(torch.a, "b")`` (hasattr, setattr) as ("getattr", ["torch", "a", "b"], torch.a)."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return None
    chain = _dotted(node.args[0], torch_names)
    return None if chain is None else (node.func.id, [*chain, node.args[1].value], node.args[0])


def _private_torch_uses(path: Path) -> list[str]:
    """Where ``path`` imports, reads or replaces what torch does not make public."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = _torch_names(tree)
    # ``torch.a._b.c`` is one use, said once: by its outermost attribute, or by the getattr
    # that looks a name up in it.
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    inner |= {id(hit[2]) for node in ast.walk(tree) if (hit := _by_name(node, torch_names))}
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            if any(map(_is_private, names)):
                found.append(f"{where} {_PRIVATE.format('.'.join(names))}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(map(_is_private, alias.name.split("."))):
                    found.append(f"{where} {_PRIVATE.format(alias.name)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain = None if id(node) in inner else _dotted(node, torch_names)
            if chain is not None and any(map(_is_private, chain[1:])):
                found.append(f"{where} {_PRIVATE.format('.'.join(chain))}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                chain = _dotted(target, torch_names)
                if chain is not None and len(chain) > 1:
                    found.append(f"{where} {_REPLACES.format('.'.join(chain))}")
        elif (lookup := _by_name(node, torch_names)) is not None:
            how, chain, _ = lookup
            if how == "setattr":
                found.append(f"{where} {_REPLACES.format('.'.join(chain))}")
            elif any(map(_is_private, chain[1:])):
                found.append(f"{where} {_PRIVATE.format('.'.join(chain))}")
    return found


def test_no_module_but_torch_compat_touches_torchs_private_api() -> None:
    """Private torch names and torch functions replaced are all in _torch_compat, checked there.

    Only what names torch itself is seen (``torch.x._y``, ``from torch._z import``, a
    ``getattr`` on a torch object, an assignment to a torch attribute): a private attribute
    of an object held in a variable (``loader._index_sampler``) is not.
    """
    package = Path(nostall.__file__).parent
    found = [
        use
        for path in sorted(package.rglob("*.py"))
        if path.name != "_torch_compat.py"
        for use in _private_torch_uses(path)
    ]
    assert [] == found


def test_the_private_api_check_finds_each_way_of_touching_it(tmp_path: Path) -> None:
    """A canary module with one use of each kind: the check names every one, and no more."""
    canary = tmp_path / "canary.py"
    canary.write_text(
        "import torch\n"
        "import torch.utils.data as data\n"
        "from torch.utils.data import DataLoader\n"
        "from torch.utils.data._utils import pin_memory\n"
        "from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter\n"
        "info = torch.utils.data._utils.worker.WorkerInfo\n"
        "new_shared = getattr(torch.UntypedStorage, '_new_shared', None)\n"
        "data.get_worker_info = lambda: None\n"
        "setattr(torch.utils.data, 'get_worker_info', None)\n"
        "sampler = DataLoader._index_sampler\n"
        "public = torch.utils.data.get_worker_info, getattr(torch, 'cuda'), DataLoader.__iter__\n"
        "loader = object()\n"
        "loader._private = 1\n"
    )
    assert [
        "canary.py:4 uses torch's private torch.utils.data._utils.pin_memory",
        "canary.py:5 uses torch's private "
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter",
        "canary.py:6 uses torch's private torch.utils.data._utils.worker.WorkerInfo",
        "canary.py:7 uses torch's private torch.UntypedStorage._new_shared",
        "canary.py:8 replaces torch's data.get_worker_info process-wide",
        "canary.py:9 replaces torch's torch.utils.data.get_worker_info process-wide",
        "canary.py:10 uses torch's private DataLoader._index_sampler",
    ] == sorted(_private_torch_uses(canary), key=lambda use: int(use.split()[0].split(":")[1]))


def test_a_bound_get_worker_info_answers_per_loading_thread() -> None:
    """``from torch.utils.data import get_worker_info`` sees a loading thread's info too.

    Datasets that split shards by worker bind the function so; without the per-thread answer
    every loading thread would read every shard of an IterableDataset.
    """
    # torch's function object itself, as a dataset module imported before nostall binds it
    # (``torch.utils.data.get_worker_info`` is nostall's once an earlier test replaced it).
    bound = torch.utils.data._utils.worker.get_worker_info

    answer_worker_info_per_thread()
    seen: list[object] = []

    def load() -> None:
        with LoadingThreadInfo(worker=2, workers=3, seed=5, dataset=None, rng=None):
            info = bound()
            seen.append(None if info is None else (info.id, info.num_workers))
        seen.append(bound())

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    assert [(2, 3), None] == seen
    assert bound() is None  # elsewhere: torch's own answer
