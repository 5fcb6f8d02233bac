"""The torch internals nostall relies on (the DataLoader's above all), each with why.

A DataLoader iterates its ``_index_sampler`` (the batch sampler, or the sampler without
automatic batching, ``_auto_collation``); ``threads=`` iterates it the same way. A DataLoader
with ``persistent_workers=True`` keeps its live iterator (its worker processes) in
the private ``_iterator`` attribute; and a DataLoader refuses ``sampler`` and ``batch_sampler``
once built (its ``__setattr__`` checks a private flag). nostall reads the first to tell a fresh
epoch from a resumed one, and sets samplers on a private copy of the loader (resume, sharding),
or on the loader itself while its persistent iterator is created (:func:`attributes_swapped`:
the iterator takes its index sampler from the loader then, once); it is told when that iterator
starts an epoch it did not ask for (:func:`on_reset`, on the iterator's private ``_reset``).
A worker process that died while handing a batch over can make the multi-process iterator
re-raise a bare ``EOFError`` or ``ConnectionResetError`` from the fd-sharing connection before
it notices the death itself; :func:`dead_workers_behind` finds that iterator (``self`` in the
traceback's frames) and reads its ``_workers``, so the error can say which worker died.
``threads=`` pins a batch as the loader's iterator would, with torch's private ``pin_memory``
helper (:func:`pinning_like`); it gives each loading thread its own ``get_worker_info()``
(:func:`answer_worker_info_per_thread`, :class:`LoadingThreadInfo`), which means replacing
torch's function process-wide and building torch's private ``WorkerInfo``. ``collate_uint8``
builds a batch in shared memory in a DataLoader worker as ``default_collate`` does, with the
private ``UntypedStorage._new_shared`` (:func:`empty_shared_uint8`); ``collate_encoded``
collates as ``default_collate`` with bytes packed its own way, through the private ``collate``
and ``default_collate_fn_map`` that ``default_collate`` itself is made of (:func:`collate_with`).
``nostall.cuda.devices()`` asks CUDA for a device's free memory only where this process
already has a context, which torch's private ``_cuda_hasPrimaryContext`` tells
(:func:`has_cuda_context`). ``torch.distributions``' Gamma, Beta and Dirichlet draw through
the private ``torch._standard_gamma`` and ``torch._sample_dirichlet``, which take a
``generator=``: ``threads=`` routes their draws to each sample's own generator
(:data:`PRIVATE_SAMPLERS`, see :mod:`nostall._loading.own_draws`). Asked for each random call
a loading thread makes, ``torch.get_default_device()`` costs microseconds (it looks through
the mode stack and may make a tensor); :func:`default_device_is_cpu` answers at once where
neither a device mode nor the private ``_GLOBAL_DEVICE_CONTEXT`` is set, and asks it otherwise.
All were checked against the torch versions in :data:`CHECKED_TORCH`;
``tests/test_torch_compat.py`` fails on any other version until they are checked again.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data import DataLoader
from torch.utils.data._utils import collate as collate_utils
from torch.utils.data._utils import pin_memory as pin_memory_utils
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

#: The torch releases (major.minor) whose DataLoader internals these functions were checked on.
#: 2.11 by tests/test_torch_compat.py and the threads= pinning tests passing on it (CUDA 13, an
#: H100); its source was not read, and on that machine pinning_like's branches without an
#: accelerator, or on MPS, could not show.
CHECKED_TORCH = ("2.11", "2.13")

L = TypeVar("L", bound=DataLoader[Any])

#: torch's private random samplers behind ``torch.distributions`` (Gamma, Beta, Dirichlet),
#: called from Python with ``generator=None``; each takes a ``generator=``.
PRIVATE_SAMPLERS: tuple[Any, ...] = (torch._standard_gamma, torch._sample_dirichlet)


def default_device_is_cpu() -> bool:
    """Whether torch's default device is the CPU here, as ``torch.get_default_device()`` says.

    Its answer without its cost where nothing was set: no torch function mode is active in
    this thread (a ``with torch.device(...)`` is one) and no default device was set.
    """
    if (
        _function_modes is not None
        and _function_modes() == 0
        and getattr(_device_context, "device_context", None) is None
    ):
        return True
    return torch.get_default_device().type == "cpu"


#: How many torch function modes this thread has active (None where torch lacks it).
_function_modes = getattr(torch._C, "_len_torch_function_stack", None)
#: torch's thread-local holder of the default device ``torch.set_default_device`` set; one
#: object for the process's life (torch sets its attribute, never the name again).
_device_context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)


def live_iterator(loader: object) -> object | None:
    """The iterator a persistent-workers DataLoader keeps between epochs (None if none)."""
    return getattr(loader, "_iterator", None)


def on_reset(iterator: object, before: Callable[[], None]) -> None:
    """Call ``before()`` at each ``_reset`` of a persistent loader's live ``iterator``.

    Its loader calls ``_reset`` at each ``iter()`` after the first, before the new epoch's
    indices go to the workers. Set on the instance, holding it weakly (an iterator that
    referred to itself would outlive its loader's reference, and so would its workers).
    """
    alive = weakref.ref(iterator)

    def reset(loader: DataLoader[Any], first_iter: bool = False) -> None:
        before()
        it = alive()
        assert it is not None  # called through it
        type(it)._reset(it, loader, first_iter)  # type: ignore[attr-defined]

    iterator._reset = reset  # type: ignore[attr-defined]


def forget_iterator(loader: DataLoader[Any]) -> None:
    """Drop a persistent loader's live iterator: its next ``iter()`` starts new workers.

    As Lightning does once it shut them down (the old workers stop when the iterator is
    collected).
    """
    loader._iterator = None


def is_loader_iterator(value: object) -> bool:
    """Whether ``value`` is an iterator of a DataLoader (torch's private base class)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return isinstance(value, _BaseDataLoaderIter)


def copy_loader(loader: L, **attributes: Any) -> L:
    """A shallow copy of ``loader`` with ``attributes`` (e.g. ``sampler=...``) set on it.

    The copy has no live iterator: the original's worker processes stay with the original.
    Attributes a built DataLoader refuses (``sampler``, ``batch_sampler``) are set anyway: the
    copy is private and not iterated yet, which is when DataLoader allows them.
    """
    clone = copy.copy(loader)
    clone._iterator = None
    for name, value in attributes.items():
        object.__setattr__(clone, name, value)
    return clone


@contextlib.contextmanager
def attributes_swapped(loader: DataLoader[Any], **attributes: Any) -> Iterator[None]:
    """``loader`` with ``attributes`` set while the block runs, then as it was.

    For the ``iter()`` that creates a persistent loader's iterator, which takes the loader's
    ``collate_fn``, ``worker_init_fn``, index sampler and base seed (from ``generator``) once,
    for every later epoch: nostall's live in that iterator, the user's stay on the loader.
    ``batch_sampler`` is set past the DataLoader's check, as :func:`copy_loader` sets it.
    """
    before = {name: getattr(loader, name) for name in attributes}
    try:
        for name, value in attributes.items():
            object.__setattr__(loader, name, value)
        yield
    finally:
        for name, value in before.items():
            object.__setattr__(loader, name, value)


def pinning_like(loader: DataLoader[Any]) -> Callable[[Any], Any] | None:
    """What the loader's own iterator does to a batch for ``pin_memory=True``, or None.

    As ``_BaseDataLoaderIter`` decides: only with an accelerator, never on MPS; the batch's
    tensors are copied into memory pinned for that accelerator.
    """
    if not loader.pin_memory or not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type == "mps":
        return None
    device = accelerator.type
    return lambda batch: pin_memory_utils.pin_memory(batch, device)  # type: ignore[no-untyped-call]


def index_sampler(loader: DataLoader[Any]) -> Any:
    """What the loader's iterator draws indices from: batches of them, or one per sample."""
    return loader._index_sampler


def auto_collation(loader: DataLoader[Any]) -> bool:
    """Whether the loader fetches batches of indices and collates them (``batch_size`` set)."""
    return bool(loader._auto_collation)


def dead_workers_behind(error: BaseException, wait_s: float = 0.5) -> list[str]:
    """The dead worker processes of the DataLoader iterator that ``error`` came through.

    Empty when it came through no multi-process iterator, or none of its workers died: a
    worker torch no longer counts on (``_workers_status``) or that exited with code 0 ended
    as it should. torch re-raises the bare error right after finding every worker alive, so
    a worker that is dying is waited for, up to ``wait_s``. Each reads "pid P, killed by
    SIGKILL" or "pid P, exit code C". Never raises.
    """
    try:
        it = None
        tb = error.__traceback__
        while tb is not None and it is None:
            found = tb.tb_frame.f_locals.get("self")
            if isinstance(found, _MultiProcessingDataLoaderIter):
                it = found
            tb = tb.tb_next
        if it is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            expected = [w for w, up in zip(it._workers, it._workers_status, strict=False) if up]
            dead = [w for w in expected if not w.is_alive() and w.exitcode != 0]
            if dead or time.monotonic() >= deadline:
                return [_describe(w) for w in dead]
            time.sleep(0.02)
    except Exception:
        return []


def _describe(worker: Any) -> str:
    code = worker.exitcode
    if isinstance(code, int) and code < 0:
        try:
            return f"pid {worker.pid}, killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"pid {worker.pid}, exit code {code}"


#: torch's own ``get_worker_info`` (its function object, also after its code is replaced).
_torch_get_worker_info = torch.utils.data._utils.worker.get_worker_info

#: The :class:`LoadingThreadInfo` of the loading thread that reads it, and whether the dataset
#: asked for it there (``asked``). Kept in torch's worker module, so that a reload of this
#: module shares it with the code given to torch's function.
_loading: Any = torch.utils.data._utils.worker.__dict__.setdefault(
    "_nostall_loading", threading.local()
)


def _get_worker_info() -> Any:
    """``get_worker_info()``: the sample's info in a loading thread, else torch's own answer."""
    info = getattr(_loading, "info", None)
    if info is None:
        return _torch_get_worker_info()
    _loading.asked = True
    return info.worker_info()


def worker_info_asked() -> bool:
    """Whether ``get_worker_info()`` was asked in this thread since its loading info was set."""
    return bool(getattr(_loading, "asked", False))


def _forget_in_child() -> None:
    # A process forked from a loading thread is not one: its get_worker_info is torch's.
    _loading.info = None


os.register_at_fork(after_in_child=_forget_in_child)


def answer_worker_info_per_thread() -> None:
    """Make ``torch.utils.data.get_worker_info`` see the loading threads (once per process).

    torch keeps one worker info per process (a worker process sets it); loading threads need
    one each. The function is replaced, process-wide, by one that answers the info set by
    :class:`LoadingThreadInfo` in a loading thread and torch's own answer everywhere else, so
    other threads see no change. ``torch.thread_safe_generator()`` looks the function up in
    ``torch.utils.data`` on every call, so it finds the replacement. Code that bound torch's
    function before (``from torch.utils.data import get_worker_info``, the common way in a
    dataset that splits its shards by worker) holds torch's function object itself: its code
    is replaced by the same answer, read from torch's module (``_worker_info``) outside loading
    threads, so that such a dataset splits its shards between loading threads as between
    worker processes instead of giving each thread all of them. Checked on
    :data:`CHECKED_TORCH`, whose function only returns that global; a torch whose function
    does more keeps its code (``tests/test_torch_compat.py`` fails there until this is checked
    again). Calling it again changes nothing.
    """
    if torch.utils.data.get_worker_info is not _get_worker_info:
        torch.utils.data.get_worker_info = _get_worker_info
    torchs = _torch_get_worker_info
    if torchs.__code__.co_names == ("_worker_info",):  # torch's code, not replaced yet
        namespace: dict[str, Any] = {}
        exec(_PER_THREAD_SOURCE, namespace)  # a fixed source, compiled once
        torchs.__code__ = namespace["get_worker_info"].__code__


#: The code torch's ``get_worker_info`` runs once :func:`answer_worker_info_per_thread` ran,
#: with torch's worker module as its globals.
_PER_THREAD_SOURCE = """
def get_worker_info():
    info = getattr(_nostall_loading, "info", None)
    if info is None:
        return _worker_info
    _nostall_loading.asked = True
    return info.worker_info()
"""


class LoadingThreadInfo:
    """Within it, ``get_worker_info()`` in this thread answers a loading thread's info.

    The info is what torch's own thread workers build: its private
    ``torch.utils.data._utils.worker.WorkerInfo`` with ``worker_method="thread"`` and the
    sample's ``rng`` (``torch_generator``, ``random_generator``, ``numpy_generator``, which
    ``torch.thread_safe_generator()`` reads), made when first asked (:meth:`worker_info`):
    it is entered once a sample, and most samples never ask (a ``WorkerInfo`` costs
    microseconds, holding the GIL the other loading threads wait for). Needs
    :func:`answer_worker_info_per_thread` once. Checked on :data:`CHECKED_TORCH`, where
    ``WorkerInfo`` takes these fields; a torch whose ``WorkerInfo`` is missing or takes other
    fields raises when it is asked (AttributeError, TypeError), which the sample then raises
    as its error, and ``tests/test_torch_compat.py`` fails on that torch until this is checked
    again.
    """

    __slots__ = ("_info", "dataset", "rng", "seed", "worker", "workers")

    def __init__(self, *, worker: int, workers: int, seed: int, dataset: Any, rng: Any) -> None:
        self.worker, self.workers, self.seed = worker, workers, seed
        self.dataset, self.rng = dataset, rng
        self._info: Any = None

    def worker_info(self) -> Any:
        """torch's ``WorkerInfo`` of these fields (one, made on the first call)."""
        if self._info is None:
            self._info = torch.utils.data._utils.worker.WorkerInfo(
                id=self.worker,
                num_workers=self.workers,
                seed=self.seed,
                dataset=self.dataset,
                rng=self.rng,
                worker_method="thread",
            )
        return self._info

    def __enter__(self) -> LoadingThreadInfo:
        _loading.info, _loading.asked = self, False
        return self

    def __exit__(self, *exc: object) -> None:
        _loading.info = None


def empty_shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``shape`` in shared memory.

    Allocated there at once, as ``default_collate`` allocates its batch in a DataLoader
    worker: with the private ``torch.UntypedStorage._new_shared``, checked on
    :data:`CHECKED_TORCH`. A torch without it gets the same tensor the public way, made in
    ordinary memory then moved to shared memory (``share_memory_()``: one copy more).
    """
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        out = torch.empty(shape, dtype=torch.uint8)
        out.share_memory_()  # type: ignore[no-untyped-call]
        return out
    storage = new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def has_cuda_context(index: int) -> bool:
    """Whether this process already has a CUDA context on device ``index``, without making one.

    Asked of torch's private ``torch._C._cuda_hasPrimaryContext`` where torch has it (a
    CUDA build; the CPU-only build of 2.13 has none). Without it, only the current device of
    a process that initialised CUDA is known to have one: another device answers False, so
    that nothing creates a context (hundreds of MiB) on it to find out.
    """
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if probe is not None:
        return bool(probe(index))
    initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return bool(initialised and torch.cuda.current_device() == index)


def collate_with(samples: Any, extra: dict[type, Callable[..., Any]]) -> Any:
    """``default_collate(samples)``, with the fields of ``extra``'s types collated by its functions.

    ``default_collate`` is torch's private ``collate`` with ``default_collate_fn_map`` (a type
    to a function taking the list of fields and ``collate_fn_map=``); ``extra`` is merged over
    it. Checked on :data:`CHECKED_TORCH`.
    """
    table: dict[Any, Callable[..., Any]] = {**collate_utils.default_collate_fn_map, **extra}
    return collate_utils.collate(samples, collate_fn_map=table)
