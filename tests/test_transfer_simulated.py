"""nostall's CUDA path, unmodified, on the simulated CUDA (``tests/simcuda``), via the public API.

Every scenario checks the values against the CPU and that the simulation found no hazard. Each
protection of :class:`nostall._staging.cuda.CudaStaging` then has a canary: the same run with that
one protection removed, which the simulation must flag with the matching hazard. Consumers run
their "model" both on the default stream and on a side stream: a default-stream consumer can
hide a missing ``record_stream`` or wait.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from helpers import Hidden, as_dataset
from simcuda import STREAM_POOL, Kind, SimStream, Simulation, simulated_cuda

import nostall
from nostall import transforms as T
from nostall._engine.channel import Channel
from nostall._staging.cuda import CudaStaging
from nostall.cuda import _streams
from nostall.transforms import _random, _tensors

CONSUMERS = ["default", "side"]


@pytest.fixture
def sim() -> Iterator[Simulation]:
    with simulated_cuda() as s:
        yield s


def _images(n: int = 6, batch: int = 4, hw: tuple[int, int] = (20, 24)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 256, (batch, 3, *hw), dtype=torch.uint8, generator=g) for _ in range(n)
    ]


def _model(batch: Any) -> torch.Tensor:
    """The consumer's work: reads every tensor of the batch, makes a new one."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(_leaves(batch))
    return torch.stack([t.float().sum() for t in tensors]) * 2


def _leaves(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _leaves(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _leaves(v)


def _consume(
    sim: Simulation, batches: Any, consumer: str = "default", limit: int | None = None
) -> list[torch.Tensor]:
    """Run the model on each batch on the consumer's stream; the host waits only at the end."""
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with torch.cuda.stream(stream):
        for i, batch in enumerate(batches):
            with sim.model_work():
                outs.append(_model(batch))
            if limit is not None and i + 1 == limit:
                break
    torch.cuda.synchronize()
    return [o.cpu() for o in outs]


def _expected(batches: Any) -> list[torch.Tensor]:
    return [_model(b) for b in batches]


def sim_id(stream: object) -> int:
    """The simulation's number for ``stream``, which torch.cuda made (a ``SimStream`` here)."""
    assert isinstance(stream, SimStream)
    return stream.id


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# --- scenarios: no hazard, right values ------------------------------------------------------


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("depth", [1, 3])
def test_plain_batches(sim: Simulation, consumer: str, depth: int) -> None:
    data = _images()
    got = _consume(sim, nostall.prefetch(data, "cuda", depth=depth), consumer)
    _same(got, _expected(data))
    assert sim.hazards == []


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_nested_batches(sim: Simulation, consumer: str) -> None:
    data = [
        {"pair": Pair(im, torch.arange(4)), "names": ["a", "b"], "step": i, "w": [im[:, 0]]}
        for i, im in enumerate(_images())
    ]
    p = nostall.prefetch(data, "cuda")
    got = _consume(sim, p, consumer)
    _same(got, _expected(data))
    assert sim.hazards == []


def _pipeline() -> T.Compose:
    return T.Compose(
        [
            T.RandomResizedCrop(12, seed=1),
            T.RandomHorizontalFlip(seed=2),
            T.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4]),
            T.ChannelsLast(),
            T.ToDtype(torch.bfloat16),
        ]
    )


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_transform_on_the_copy_stream(sim: Simulation, consumer: str) -> None:
    data = _images()
    got = _consume(sim, nostall.prefetch(data, "cuda", transform=_pipeline()), consumer)
    reference = _pipeline()
    _same(got, _expected([reference(b) for b in data]))
    assert sim.hazards == []


def _made_on_the_device(n: int) -> Iterator[dict[str, torch.Tensor]]:
    """A source that decodes on the GPU: its batches are written on its thread's stream."""
    for i in range(n):
        yield {"image": torch.full((4, 3, 8, 8), i, dtype=torch.uint8, device="cuda"),
               "label": torch.tensor([i])}  # fmt: skip


@pytest.mark.parametrize("transform", [None, T.ToDtype(torch.float32, on="image")])
def test_batches_the_source_put_on_the_device(sim: Simulation, transform: Any) -> None:
    p = nostall.prefetch(_made_on_the_device(6), "cuda", depth=3, transform=transform)
    got = _consume(sim, p, "side")
    want = [_model(b) for b in _cpu_made(6, transform)]
    _same(got, want)
    assert sim.hazards == []


def _cpu_made(n: int, transform: Any) -> list[Any]:
    out = []
    for i in range(n):
        b = {"image": torch.full((4, 3, 8, 8), i, dtype=torch.uint8), "label": torch.tensor([i])}
        out.append(b if transform is None else transform(b))
    return out


class Pinnable:
    """A batch object with its own ``.to()`` and ``.pin_memory()``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> Pinnable:
        return type(self)(self.x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Pinnable:
        return type(self)(self.x.pin_memory())


class Unpinnable:
    """A batch object with ``.to()`` only."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> Unpinnable:
        return Unpinnable(self.x.to(device, non_blocking=non_blocking))


def test_objects_that_move_and_pin_themselves(sim: Simulation) -> None:
    data = _images(4)
    p = nostall.prefetch([Pinnable(x) for x in data], "cuda")
    got = [o.cpu() for o in _consume_objects(sim, p)]
    _same(got, _expected(data))
    assert sim.hazards == []


def test_objects_that_cannot_pin_are_copied_blocking_with_a_warning(sim: Simulation) -> None:
    data = _images(4)
    p = nostall.prefetch([Unpinnable(x) for x in data], "cuda")
    with pytest.warns(UserWarning, match=r"Unpinnable objects have \.to\(\) but no \.pin_memory"):
        got = [o.cpu() for o in _consume_objects(sim, p)]
    _same(got, _expected(data))
    # Never non_blocking from pageable memory; the copy is synchronous, as the warning says.
    assert sim.kinds() == {Kind.HOST_SYNC}
    assert all("pageable host-to-device copy" in h.message for h in sim.hazards)


def _consume_objects(sim: Simulation, p: Any) -> list[torch.Tensor]:
    outs = []
    for obj in p:
        with sim.model_work():
            outs.append(_model(obj.x))
    torch.cuda.synchronize()
    return outs


def test_across_epochs(sim: Simulation) -> None:
    loader = torch.utils.data.DataLoader(
        as_dataset(torch.arange(48.0).reshape(24, 2)), batch_size=4
    )
    p = nostall.prefetch(loader, "cuda", across_epochs=True)
    got = _consume(sim, p, "side") + _consume(sim, p, "side")
    _same(got, _expected(loader) * 2)
    assert sim.hazards == []


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_source(sim: Simulation, workers: int) -> None:
    loader = torch.utils.data.DataLoader(
        as_dataset(torch.arange(96.0).reshape(24, 4)), batch_size=4, num_workers=workers
    )
    got = _consume(sim, nostall.prefetch(loader, "cuda", transform=T.ToDtype(torch.float16)))
    _same(got, _expected([b.half() for b in loader]))
    assert sim.hazards == []


def test_loading_threads_across_epochs_with_a_transform(sim: Simulation) -> None:
    """threads=: batches the threads made cross on the copy stream like any other."""
    loader = torch.utils.data.DataLoader(
        as_dataset(torch.arange(96.0).reshape(24, 4)), batch_size=4
    )
    p = nostall.prefetch(
        loader, "cuda", threads=3, across_epochs=True, transform=T.ToDtype(torch.float16)
    )
    got = _consume(sim, p, "side") + _consume(sim, p)
    _same(got, _expected([b.half() for b in loader]) * 2)
    assert sim.hazards == []


def test_resume_mid_epoch(sim: Simulation) -> None:
    data = _images(8)
    p = nostall.prefetch(data, "cuda", transform=T.RandomHorizontalFlip(seed=3))
    first = _consume(sim, p, "side", limit=3)
    state = p.state_dict()
    q = nostall.prefetch(data, "cuda", transform=T.RandomHorizontalFlip(seed=3))
    q.load_state_dict(state)
    rest = _consume(sim, q, "side")
    flip = T.RandomHorizontalFlip(seed=3)
    _same(first + rest, _expected([flip(b) for b in data]))
    assert sim.hazards == []


@pytest.mark.parametrize("options", [{"depth": "auto"}, {"timeout": 30.0}])
def test_auto_depth_and_timeout(sim: Simulation, options: dict[str, Any]) -> None:
    data = _images(8)
    got = _consume(sim, nostall.prefetch(data, "cuda", **options), "side")
    _same(got, _expected(data))
    assert sim.hazards == []


def test_second_gpu_while_the_current_device_is_the_first(sim: Simulation) -> None:
    data = _images(5)
    p = nostall.prefetch(data, "cuda:1", transform=T.Normalize([0.5] * 3, [0.25] * 3))
    outs = []
    for batch in p:
        assert batch.device == torch.device("cuda", 1)
        with sim.model_work():
            outs.append(_model(batch))  # on cuda:1's current stream
    torch.cuda.synchronize(1)
    norm = T.Normalize([0.5] * 3, [0.25] * 3)
    _same([o.cpu() for o in outs], _expected([norm(b) for b in data]))
    assert torch.cuda.current_device() == 0
    assert sim.hazards == []


@contextlib.contextmanager
def _consumer_pulls_first() -> Iterator[threading.Event]:
    """Hold the producer back until the consumer has pulled two batches itself (a fixed schedule).

    The second of them is pulled after the model's work on the first is queued.
    """
    pulled = threading.Event()
    acquire = Channel.acquire
    stage = CudaStaging.stage
    count = [0]

    def held(self: Channel, give_up: Callable[[], bool]) -> bool:
        if threading.current_thread().name.startswith("nostall"):
            pulled.wait(10.0)
        return acquire(self, give_up)

    def staged_by(self: CudaStaging, batch: Any) -> Any:
        out = stage(self, batch)
        if not threading.current_thread().name.startswith("nostall"):
            count[0] += 1
            if count[0] == 2:
                pulled.set()
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Channel, "acquire", held)
        m.setattr(CudaStaging, "stage", staged_by)
        yield pulled


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_a_batch_the_consumer_pulls_itself(sim: Simulation, consumer: str) -> None:
    data = _images(4)
    with _consumer_pulls_first() as pulled:
        got = _consume(sim, nostall.prefetch(data, "cuda", transform=_pipeline()), consumer)
    assert pulled.is_set()
    reference = _pipeline()
    _same(got, _expected([reference(b) for b in data]))
    assert sim.hazards == []


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_no_batch_is_handed_out_during_graph_capture(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """In the capturing thread a batch is refused; the producer copies the next meanwhile.

    What the model holds for certain about capture (see ``simcuda``): the producer's pinning,
    copies and events on its own streams are not part of the capture in any mode (as an H100
    with torch 2.11 showed), and nothing nostall does may sync or join the capture.
    """
    data = _images(4)
    capturing, staged = threading.Event(), _count_stages(monkeypatch)
    acquire = Channel.acquire

    def held(self: Channel, give_up: Callable[[], bool]) -> bool:
        if threading.current_thread().name.startswith("nostall"):
            capturing.wait(10.0)  # the producer starts once the capture has begun
        return acquire(self, give_up)

    monkeypatch.setattr(Channel, "acquire", held)
    it = iter(nostall.prefetch(data, "cuda", depth=2))
    first = next(it)  # pulled by the consumer itself: the producer is held
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        capturing.set()
        staged.wait_for(3)  # the producer pinned, copied and recorded during the capture
        assert torch.cuda.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
            next(it)
        static = first.float() * 2  # captured
    graph.replay()
    rest = list(it)  # nothing was taken: the refused batch is the next one
    _same([_model(b).cpu() for b in [first, *rest]], _expected(data))
    assert static.device.type == "cuda"
    assert sim.hazards == []


class _Stages:
    """How many batches staging has staged: to wait for the producer, with a deadline."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def wait_for(self, n: int, timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.count >= n, timeout), self.count


def _count_stages(monkeypatch: pytest.MonkeyPatch) -> _Stages:
    stages = _Stages()
    stage = CudaStaging.stage

    def counted(self: CudaStaging, batch: Any) -> Any:
        out = stage(self, batch)
        with stages.changed:
            stages.count += 1
            stages.changed.notify_all()
        return out

    monkeypatch.setattr(CudaStaging, "stage", counted)
    return stages


def test_to_device_from_pinned_memory(sim: Simulation) -> None:
    batch: dict[str, Any] = {"x": torch.arange(12.0).reshape(3, 4), "names": ["a"]}
    moved = nostall.cuda.to_device(nostall.cuda.pin_memory(batch), "cuda", non_blocking=True)
    assert moved["x"].device == torch.device("cuda", 0)
    assert moved["names"] == ["a"]
    assert torch.equal(moved["x"].cpu(), batch["x"])
    assert sim.hazards == []


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_run_concurrently(sim: Simulation, consumer: str) -> None:
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        x = torch.arange(8.0, device="cuda")  # written on the caller's stream
        a, b = nostall.cuda.run_concurrently(lambda: x * 2, lambda: x + 1)
        total = a + b  # read on the caller's stream
        del a, b
        torch.full((8,), 0.0, device="cuda")  # may reuse their memory: record_stream held it
        assert torch.equal(total.cpu(), torch.arange(8.0) * 3 + 1)  # on the stream that wrote it
    assert sim.hazards == []


def test_profile_and_timer_on_the_device(sim: Simulation) -> None:
    data = _images(4)
    p = nostall.prefetch(data, "cuda", profile=True)
    with nostall.cuda.Timer("cuda") as timer:
        got = _consume(sim, p)
    _same(got, _expected(data))
    assert timer.seconds >= 0.0
    assert p.report().batches == 4
    assert sim.hazards == []


# --- canaries: one protection removed, the simulation must see it ----------------------------


def _no_op(*args: Any) -> None:
    return None


def _wait_always(self: CudaStaging, on_device: list[torch.Tensor]) -> None:
    self.stream.wait_stream(torch.cuda.current_stream(self.device))


CANARIES: list[tuple[str, str, Callable[..., Any], str, Kind]] = [
    # (what is removed, method, replacement, consumer, expected hazard)
    ("the consumer's wait", "_wait", _no_op, "side", Kind.UNORDERED),
    ("the consumer's wait", "_wait", _no_op, "default", Kind.UNORDERED),
    ("record_stream for the consumer", "_keep_for_consumer", _no_op, "side", Kind.REUSE),
    ("record_stream for the consumer", "_keep_for_consumer", _no_op, "default", Kind.REUSE),
    ("waiting only when needed", "_after_source", _wait_always, "default", Kind.FALSE_DEPENDENCY),
]


@pytest.mark.parametrize("shape", ["tensor", "tuple"])
@pytest.mark.parametrize(
    ("removed", "method", "replacement", "consumer", "kind"),
    CANARIES,
    ids=[f"{c[0]}-{c[3]}" for c in CANARIES],
)
def test_canary(
    sim: Simulation,
    monkeypatch: pytest.MonkeyPatch,
    removed: str,
    method: str,
    replacement: Callable[..., Any],
    consumer: str,
    kind: Kind,
    shape: str,
) -> None:
    """Each protection removed is caught, for one-tensor batches and for (images, labels).

    The common batch, (images, labels), is staged in one pass, without the walk.
    """
    monkeypatch.setattr(CudaStaging, method, replacement)
    images = _images(8)
    batches = images if shape == "tensor" else [(x, x.sum((1, 2, 3))) for x in images]
    # With a timeout the producer stages every batch: a small one the consumer pulled itself
    # would be copied on its own stream, where neither protection is needed.
    _consume(sim, nostall.prefetch(batches, "cuda", depth=2, timeout=30.0), consumer)
    assert kind in sim.kinds(), f"removing {removed} went unseen: {sim.hazards}"


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("kind", [tuple, list])
def test_tuples_and_lists_of_host_tensors(sim: Simulation, consumer: str, kind: type) -> None:
    """The common batch, pinned or not, a view with gaps among them: right values, no hazard."""
    images = _images(6)
    batches = [kind([x, x[:, :, ::2], x.sum((1, 2, 3)).pin_memory()]) for x in images]
    got = _consume(sim, nostall.prefetch(batches, "cuda", depth=2), consumer)
    _same(got, _expected(batches))
    assert sim.hazards == []


def _shrinking(n: int = 8) -> list[torch.Tensor]:
    """Batches of 8, 7, 6, ... images: no two the same size, each smaller than the last."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 256, (n - i, 3, 20, 24), dtype=torch.uint8, generator=g) for i in range(n)
    ]


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_shrinking_batches(sim: Simulation, consumer: str) -> None:
    """The allocator splits the freed blocks of larger batches for smaller ones: still safe."""
    data = _shrinking()
    got = _consume(sim, nostall.prefetch(data, "cuda", depth=2), consumer)
    _same(got, _expected(data))
    assert sim.hazards == []


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_canary_record_stream_with_shrinking_batches(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, consumer: str
) -> None:
    """Without record_stream, a smaller batch's copy lands in a larger batch's freed block.

    An allocator that reused only blocks of the very same size never saw it: it takes the
    caching allocator's best fit and block splitting to.
    """
    monkeypatch.setattr(CudaStaging, "_keep_for_consumer", _no_op)
    _consume(sim, nostall.prefetch(_shrinking(), "cuda", depth=2, timeout=30.0), consumer)
    assert Kind.REUSE in sim.kinds(), f"removing record_stream went unseen: {sim.hazards}"


def test_canary_wait_when_the_consumer_pulls(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CudaStaging, "_after_source", _wait_always)
    with _consumer_pulls_first():
        _consume(sim, nostall.prefetch(_images(4), "cuda"), "side")
    assert Kind.FALSE_DEPENDENCY in sim.kinds()


TO_FLOAT = T.ToDtype(torch.float32, on="image")


#: The source-kernels wait made on another stream than the one the source ran on: the current
#: stream of the current device (the original bug), or of the target device.
WRONG_SOURCE_WAITS = {
    "the current device's stream": "self.stream.wait_stream(torch.cuda.current_stream())",
    "the target's current stream": (
        "self.stream.wait_stream(torch.cuda.current_stream(self.device))"
    ),
}


@pytest.mark.parametrize(
    ("method", "transform", "kind"),
    [
        ("_after_source", None, Kind.UNORDERED),  # the wait for the source's own kernels
        ("_after_source", TO_FLOAT, Kind.UNORDERED),
        ("_keep_for_copy_stream", TO_FLOAT, Kind.REUSE),  # record_stream of device inputs
        *[
            (f"_after_source={w}", t, Kind.UNORDERED)
            for w in WRONG_SOURCE_WAITS
            for t in (None, TO_FLOAT)
        ],
    ],
)
def test_canary_batches_the_source_put_on_the_device(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, method: str, transform: Any, kind: Kind
) -> None:
    if "=" in method:  # the wait kept, on the wrong stream
        method, wrong = method.split("=")
        edit = ("self.stream.wait_stream(self.source_stream)", WRONG_SOURCE_WAITS[wrong])
        monkeypatch.setattr(CudaStaging, method, mutant(CudaStaging, method, *edit))
    else:
        monkeypatch.setattr(CudaStaging, method, _no_op)
    # With a timeout the consumer never pulls a batch itself: the source always runs in the
    # producer thread, on the default stream, which only the side consumer's waits could order.
    p = nostall.prefetch(_made_on_the_device(8), "cuda", depth=3, transform=transform, timeout=30.0)
    _consume(sim, p, "side")
    assert kind in sim.kinds()


def test_canary_non_blocking_from_pageable_memory(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unpinned(self: CudaStaging, out: list[torch.Tensor]) -> Callable[[torch.Tensor], Any]:
        def move(t: torch.Tensor) -> torch.Tensor:
            moved = t.to(self.device, non_blocking=True)
            out.append(moved)
            return moved

        return move

    monkeypatch.setattr(CudaStaging, "_leaf_mover", unpinned)
    _consume(sim, nostall.prefetch(_images(3), "cuda"))
    assert Kind.PAGEABLE_NON_BLOCKING in sim.kinds()


def test_canary_pinning_turned_off_syncs_the_producer(sim: Simulation) -> None:
    _consume(sim, nostall.prefetch(_images(3), "cuda", pin_memory=False))
    assert sim.kinds() == {Kind.HOST_SYNC}


def test_canary_blocking_upload_in_a_transform(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in (_random, _tensors):  # the flip's index, Normalize's coefficients
        monkeypatch.setattr(module, "upload", lambda t, device: t.to(device))
    transform = T.Compose([T.RandomHorizontalFlip(seed=0), T.Normalize([0.5] * 3, [0.2] * 3)])
    _consume(sim, nostall.prefetch(_images(3), "cuda", transform=transform))
    assert Kind.HOST_SYNC in sim.kinds()


def test_canary_streams_of_the_wrong_device(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hand_out(self: CudaStaging, staged: Any) -> Any:
        consumer = torch.cuda.current_stream()  # the current device's, not the batch's
        self._wait(consumer, staged.ready)
        self._keep_for_consumer(consumer, staged.tensors)
        return staged.batch

    monkeypatch.setattr(CudaStaging, "hand_out", hand_out)
    p = nostall.prefetch(_images(4), "cuda:1")
    for batch in p:
        with sim.model_work():
            _model(batch)
    assert {Kind.WRONG_DEVICE, Kind.UNORDERED} <= sim.kinds()


def mutant(owner: Any, name: str, old: str, new: str) -> Any:
    """``owner.name`` recompiled from its own source with ``old`` replaced by ``new``.

    A canary built so tests the code as it is: when the source no longer holds ``old``
    exactly once, the canary fails here, not silently. The copy runs in its module's globals
    (a method's zero-argument ``super()`` included).
    """
    found = inspect.getattr_static(owner, name)
    function = found.__func__ if isinstance(found, staticmethod) else found
    source = textwrap.dedent(inspect.getsource(function))
    assert 1 == source.count(old), f"{name} no longer reads {old!r}: update the canary"
    body = textwrap.indent(source.replace(old, new), "    ")
    code = f"def _make(__class__):\n{body}\n    return {function.__name__}\n"
    namespace = dict(function.__globals__)
    exec(compile(code, inspect.getsourcefile(function) or "<mutant>", "exec"), namespace)
    made = namespace["_make"](owner if isinstance(owner, type) else None)
    return staticmethod(made) if isinstance(found, staticmethod) else made


RUN_CONCURRENTLY = {
    "wait for the inputs": ("stream.wait_stream(caller)", "pass"),
    "wait for the results": ("caller.wait_stream(stream)", "pass"),
    "record_stream": ("tensor.record_stream(caller)", "pass"),
}


@pytest.mark.parametrize(
    ("removed", "kind"),
    [
        ("wait for the inputs", Kind.UNORDERED),
        ("wait for the results", Kind.UNORDERED),
        ("record_stream", Kind.REUSE),
        ("nothing", None),
    ],
)
def test_canary_run_concurrently(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, removed: str, kind: Kind | None
) -> None:
    """The real ``nostall.cuda.run_concurrently``, with one of its protections edited out."""
    if removed in RUN_CONCURRENTLY:
        edited = mutant(_streams, "run_concurrently", *RUN_CONCURRENTLY[removed])
        monkeypatch.setattr(nostall.cuda, "run_concurrently", edited)
    x = torch.arange(8.0, device="cuda")
    made = sim._made.get(0, 0)
    a, b = nostall.cuda.run_concurrently(lambda: x * 2, lambda: x + 1)
    total = a + b  # the caller reads the results
    del a, b
    # Streams come from a pool: a later Stream() is the CUDA stream that made ``a``. Work
    # there need not wait for the caller, so only record_stream keeps ``a``'s memory from it.
    for _ in range(STREAM_POOL - 2):
        torch.cuda.Stream()  # type: ignore[no-untyped-call]
    again = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    assert sim_id(again) == 1 + made % STREAM_POOL
    with torch.cuda.stream(again):
        torch.full((8,), 0.0, device="cuda")
    assert torch.equal(total.cpu(), torch.arange(8.0) * 3 + 1)
    assert sim.kinds() == (set() if kind is None else {kind})


def test_canary_objects_that_cannot_pin_copied_non_blocking(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    def non_blocking_always(
        self: CudaStaging, out: list[torch.Tensor], due: list[Any]
    ) -> Callable[[Any], Any]:
        def move(obj: Any) -> Any:
            return obj.to(self.device, non_blocking=True)  # pinned or not

        return move

    monkeypatch.setattr(CudaStaging, "_object_mover", non_blocking_always)
    _consume_objects(sim, nostall.prefetch([Unpinnable(x) for x in _images(3)], "cuda"))
    assert Kind.PAGEABLE_NON_BLOCKING in sim.kinds()


class SlottedPinnable:
    """A batch object with ``__slots__`` (no ``__dict__``), ``.to()`` and ``.pin_memory()``."""

    __slots__ = ("x",)

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> SlottedPinnable:
        return SlottedPinnable(self.x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> SlottedPinnable:
        return SlottedPinnable(self.x.pin_memory())


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_slotted_objects_are_protected_too(sim: Simulation, consumer: str) -> None:
    """Their tensors get record_stream like any other: no memory reused under the consumer."""
    data = _images(8)
    p = nostall.prefetch([SlottedPinnable(x) for x in data], "cuda", depth=2)
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with torch.cuda.stream(stream):
        for obj in p:
            with sim.model_work():
                outs.append(_model(obj.x))
    torch.cuda.synchronize()
    _same([o.cpu() for o in outs], _expected(data))
    assert sim.hazards == []


# --- copy streams: one per live prefetcher, lent again after it (issue: reserved memory) ------


def _copy_stream_of(p: Any) -> Any:
    return p._staging.stream


def test_a_prefetcher_per_epoch_keeps_reserved_memory_flat(sim: Simulation) -> None:
    """``for b in nostall.prefetch(loader)`` in the epoch loop: one copy stream, flat memory.

    Each prefetcher used to take a new stream of PyTorch's pool, whose own cached blocks the
    next epoch's prefetcher could not reuse (seen on an H100: 6, 8, ..., 16 MiB over 6 epochs).
    """
    from helpers import wait_for_no_nostall_threads

    data = _images(6)
    streams, reserved = set(), []
    for _ in range(6):
        p = nostall.prefetch(data, "cuda")
        streams.add(_copy_stream_of(p).id)
        _same(_consume(sim, p), _expected(data))
        del p
        assert not wait_for_no_nostall_threads(timeout=5.0)
        reserved.append(torch.cuda.memory_reserved())
    assert 1 == len(streams)
    assert reserved[1:] == reserved[:1] * 5, reserved
    assert sim.hazards == []


def test_prefetchers_alive_together_copy_on_streams_of_their_own(sim: Simulation) -> None:
    """Training and validation prefetchers never share a copy stream, interleaved or not."""
    train = nostall.prefetch(_images(4), "cuda")
    val = nostall.prefetch(_images(4), "cuda")
    assert _copy_stream_of(train).id != _copy_stream_of(val).id
    for a, b in zip(train, val, strict=True):
        with sim.model_work():
            _model(a) + _model(b)
    train.close()
    val.close()
    assert sim.hazards == []


def test_a_lent_copy_stream_is_reused_safely_by_the_next_prefetcher(sim: Simulation) -> None:
    """The next borrower's copies reuse the blocks the previous one's consumer still reads.

    The consumer keeps reading the old prefetcher's last batch on a side stream after that
    prefetcher is gone; record_stream keeps its block out of the pool, so the new prefetcher's
    copies on the same stream cannot overwrite it.
    """
    import gc

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    first = nostall.prefetch(_images(2), "cuda")
    with torch.cuda.stream(side):
        kept = list(first)
    stream = _copy_stream_of(first).id
    first.close()
    del first
    gc.collect()
    second = nostall.prefetch(_images(4), "cuda")
    assert _copy_stream_of(second).id == stream
    with torch.cuda.stream(side):
        for b in second:
            with sim.model_work():
                _model(b)
        with sim.model_work():
            outs = [_model(b) for b in kept]  # read after the new copies were queued
    del kept
    torch.cuda.synchronize()
    _same([o.cpu() for o in outs], _expected(_images(2)))
    assert sim.hazards == []


# --- every device tensor handed out is protected (issue: unprotected tensors) ----------------


class Tagged(torch.Tensor):
    """A Tensor subclass that may carry more tensors in its attributes."""


class KeptIn:
    """A batch whose ``.to()`` keeps its copy in a container of ``kind`` (pinned first)."""

    def __init__(self, x: torch.Tensor, kind: str) -> None:
        self.x, self.kind = x, kind
        self.held = self._hold(x)

    def _hold(self, x: torch.Tensor) -> Any:
        if self.kind == "deque":
            return collections.deque([x])
        if self.kind == "set":
            return {x}
        if self.kind == "frozenset":
            return frozenset([x])
        tagged = torch.zeros(1).as_subclass(Tagged)
        tagged.payload = x  # type: ignore[attr-defined]
        return tagged

    def to(self, device: Any, non_blocking: bool = False) -> KeptIn:
        out = KeptIn.__new__(KeptIn)
        out.kind = self.kind
        out.x = None  # type: ignore[assignment]
        out.held = out._hold(self.x.to(device, non_blocking=non_blocking))
        return out

    def pin_memory(self) -> KeptIn:
        return KeptIn(self.x.pin_memory(), self.kind)

    def tensor(self) -> torch.Tensor:
        if isinstance(self.held, Tagged):
            return self.held.payload  # type: ignore[attr-defined,no-any-return]
        return next(iter(self.held))  # type: ignore[no-any-return]


def _consume_dropping(sim: Simulation, batches: Any, consumer: str, read: Any) -> list[Any]:
    """Read each batch on the consumer's stream and drop it at once, as a training loop does."""
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with torch.cuda.stream(stream):
        for batch in batches:
            with sim.model_work():
                outs.append(_model(read(batch)))
            del batch
    torch.cuda.synchronize()
    return [o.cpu() for o in outs]


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("kind", ["deque", "set", "frozenset", "tensor attribute"])
def test_copies_an_object_keeps_anywhere_are_protected(
    sim: Simulation, consumer: str, kind: str
) -> None:
    """A deque, a set, a frozenset, a Tensor subclass's attribute: record_stream reaches them."""
    data = _images(8)
    p = nostall.prefetch([KeptIn(x, kind) for x in data], "cuda", depth=2)
    got = _consume_dropping(sim, p, consumer, lambda b: b.tensor())
    _same(got, _expected(data))
    assert sim.hazards == []


def test_tensors_nostall_cannot_find_are_warned_about_once(sim: Simulation) -> None:
    """Where nostall cannot protect a batch's memory it says so, once per type, with the fix."""
    p = nostall.prefetch([Hidden(x) for x in _images(3)], "cuda")
    with pytest.warns(UserWarning, match=r"Hidden\.to\(\) returned a Hidden in which nostall") as w:
        batches = list(p)
    assert 3 == len(batches)
    assert 1 == sum("cannot find" in str(x.message) for x in w)


class Holder:
    """Neither a container nor an object with ``.to()``: a plain attribute holder."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def _held_on_the_device(n: int) -> Iterator[Holder]:
    for i in range(n):
        yield Holder(torch.full((4, 3, 8, 8), float(i), device="cuda"))


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_device_tensors_the_source_holds_in_plain_objects_are_protected(
    sim: Simulation, consumer: str
) -> None:
    """No transform, a side-stream consumer: the source's own blocks are recorded for it."""
    got = _consume_dropping(sim, nostall.prefetch(_held_on_the_device(6), "cuda"), consumer,
                            lambda b: b.x)  # fmt: skip
    _same(got, [_model(torch.full((4, 3, 8, 8), float(i))) for i in range(6)])
    assert sim.hazards == []


# --- dict-like batches with .to() and no .pin_memory() (Hugging Face's BatchEncoding) --------


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """As ``transformers.BatchEncoding``: a UserDict with ``.to()`` and no ``pin_memory()``."""

    def to(self, device: Any, non_blocking: bool = False) -> Encoding:
        return Encoding(
            {
                k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
                for k, v in self.items()
            }
        )


@dataclasses.dataclass
class Fields:
    """A dataclass batch with its own ``.to()`` and no ``pin_memory()``."""

    ids: torch.Tensor

    def to(self, device: Any, non_blocking: bool = False) -> Fields:
        return Fields(self.ids.to(device, non_blocking=non_blocking))


@pytest.mark.parametrize("make", [lambda x: Encoding({"ids": x}), Fields])
def test_dict_like_batches_are_pinned_and_copied_asynchronously(sim: Simulation, make: Any) -> None:
    """Values pinned as torch's pin_memory does, then one non_blocking .to(): no host sync."""
    data = _images(4)
    p = nostall.prefetch([make(x) for x in data], "cuda")
    got = _consume_dropping(
        sim, p, "side", lambda b: b["ids"] if isinstance(b, Encoding) else b.ids
    )
    _same(got, _expected(data))
    assert sim.hazards == []


class Opaque:
    """``.to()`` only, its tensors pinned already, not a Mapping or dataclass."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: Any, non_blocking: bool = False) -> Opaque:
        return Opaque(self.x.to(device, non_blocking=non_blocking))


def test_objects_whose_tensors_are_all_pinned_go_non_blocking_without_a_warning(
    sim: Simulation,
) -> None:
    data = _images(4)
    p = nostall.prefetch([Opaque(x.pin_memory()) for x in data], "cuda")
    got = _consume_dropping(sim, p, "side", lambda b: b.x)  # warnings are errors here
    _same(got, _expected(data))
    assert sim.hazards == []


# --- loading threads on the prefetcher's device and stream (issue: threads= and GPU work) -----


class DecodedOnTheGpu(torch.utils.data.Dataset[torch.Tensor]):
    """Makes each sample on the current device, as ``decode_jpeg(device="cuda")`` does.

    Notes the device and stream each call ran on.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.seen.append((torch.cuda.current_device(), sim_id(torch.cuda.current_stream())))
        return torch.full((3, 8, 8), float(i), device="cuda") * 2


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_loading_threads_run_on_the_prefetchers_device_and_source_stream(
    sim: Simulation, consumer: str, device: str
) -> None:
    """Samples the loading threads make on the GPU: on the target device, before collate.

    Ordered before the collate and the copy whoever pulls the batch (the consumer pulls the
    first two itself).
    """
    dataset = DecodedOnTheGpu(16)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    p = nostall.prefetch(loader, device, threads=2)
    index = torch.device(device).index
    stream = torch.cuda.Stream(index) if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with _consumer_pulls_first() as pulled, torch.cuda.device(index), torch.cuda.stream(stream):
        for batch in p:
            assert batch.device == torch.device(device)
            with sim.model_work():
                outs.append(_model(batch))
            del batch
    torch.cuda.synchronize(index)
    assert pulled.is_set()
    samples = torch.arange(16.0).repeat_interleave(192).reshape(4, 4, 3, 8, 8) * 2
    _same([o.cpu() for o in outs], _expected(list(samples)))
    staging = p._staging
    assert isinstance(staging, CudaStaging)
    source_stream = sim_id(staging.source_stream)
    assert {(index, source_stream)} == set(dataset.seen)
    assert sim.hazards == []


# --- views with gaps are made contiguous before pinning --------------------------------------


@pytest.mark.parametrize("pinned_by", ["prefetch", "pin_memory"])
def test_views_with_gaps_are_pinned_without_their_gaps(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, pinned_by: str
) -> None:
    """``x[:, ::4]`` pinned as it is pins (and copies) four times its data: compact it first."""
    pin = torch.Tensor.pin_memory
    spans: list[tuple[int, int]] = []

    def noting(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        spans.append((t.numel(), t.untyped_storage().nbytes() // t.element_size()))
        return pin(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", noting)
    whole = torch.arange(4 * 64.0).reshape(4, 64)
    views = [whole[:, ::4], whole.t()]  # gaps; dense (a transpose): pinned as it is
    if pinned_by == "prefetch":
        got = [b.cpu() for b in nostall.prefetch(views, "cuda")]
    else:
        got = [b.cpu() for b in nostall.cuda.pin_memory(views)]
    assert all(torch.equal(v, g) for v, g in zip(views, got, strict=True))
    assert [(64, 64), (256, 256)] == spans  # the view's data alone, then the whole transpose
    assert sim.hazards == []


# --- the protections no test noticed the removal of (issue: the model must catch them) -------


@pytest.mark.parametrize("removed", [False, True])
def test_canary_the_producer_makes_no_context_on_another_gpu(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, removed: bool
) -> None:
    """A rank on cuda:1 (``set_device(1)``, as under torchrun): nothing nostall does touches GPU 0.

    ``torch.cuda.stream(s)`` makes the previous stream's device current again on exit, with
    an eager ``cudaSetDevice`` that creates that device's context: without the producer's
    ``set_device``, its copy-stream block would end on GPU 0 every batch, and every rank
    would hold a context (hundreds of MiB) there. Its known resting stream (on the target,
    set back after each block) also keeps it on the target: the canary removes both.
    """
    if removed:
        settle = "self._settle(torch.cuda.current_stream(self.index))"
        edit = (f"torch.cuda.set_device(self.device)\n    {settle}", "pass")
        monkeypatch.setattr(CudaStaging, "start_thread", mutant(CudaStaging, "start_thread", *edit))
    torch.cuda.set_device(1)
    data, reference = _images(4), _pipeline()
    got = _consume(sim, nostall.prefetch(data, "cuda", transform=_pipeline()), "side")
    _same(got, _expected([reference(b) for b in data]))
    if removed:
        assert Kind.STRAY_CONTEXT in sim.kinds(), f"removing set_device went unseen: {sim.hazards}"
    else:
        assert {1} == sim.contexts
        assert sim.hazards == []


@pytest.mark.parametrize("removed", [False, True])
def test_canary_normalize_shared_by_prefetchers_alive_together(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, removed: bool
) -> None:
    """One Normalize for training and validation: each copy stream uploads its own coefficients.

    Without the stream in the cache key, one prefetcher's copy stream reads coefficients the
    other's uploaded, with no wait between the two streams.
    """
    if removed:
        edit = (
            "key = (device, dtype, scale, current_stream(device))",
            "key = (device, dtype, scale)",
        )
        monkeypatch.setattr(
            T.Normalize, "_coefficients", mutant(T.Normalize, "_coefficients", *edit)
        )
    norm = T.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])
    data = _images(4)
    train = iter(nostall.prefetch(data, "cuda", transform=norm))
    outs = [_model(next(train))]  # the first batch's coefficients are cached by now
    val = nostall.prefetch(data, "cuda", transform=norm)
    for a, b in zip(train, val, strict=False):
        with sim.model_work():
            outs += [_model(a), _model(b)]
    torch.cuda.synchronize()
    reference = T.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])
    want = _expected([reference(b) for b in data])
    _same(
        [o.cpu() for o in outs],
        [want[0], *[w for pair in zip(want[1:], want, strict=False) for w in pair]],
    )
    if removed:
        assert Kind.UNORDERED in sim.kinds(), f"one cache for all went unseen: {sim.hazards}"
    else:
        assert sim.hazards == []


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("removed", [False, True])
def test_canary_the_consumer_waits_only_for_its_own_batch(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch, consumer: str, removed: bool
) -> None:
    """Handing out batch k waits for batch k's event, not for the batches copied ahead of it.

    A hand-out that waits for the whole copy stream (``wait_stream``) is correct but makes the
    model's kernels wait for copies of batches they do not read yet: the overlap is lost.
    Once the producer runs ahead, it is let stage the next batch before one is taken, so
    the copy stream holds work ahead of the batch handed out.
    """
    if removed:
        edit = ("self._wait(consumer, staged.ready)", "consumer.wait_stream(self.stream)")
        monkeypatch.setattr(CudaStaging, "hand_out", mutant(CudaStaging, "hand_out", *edit))
    staged = _count_stages(monkeypatch)
    data = _images(6)
    to_half = T.ToDtype(torch.float16)
    p = nostall.prefetch(data, "cuda", depth=2, transform=to_half)
    it = iter(p)
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with contextlib.closing(p), torch.cuda.stream(stream):
        for i in range(len(data)):
            # The first two batches are pulled in step with the loop while nostall checks
            # the source for global random draws (nostall._sources.global_draws); then the producer
            # runs ahead, and the next batch is staged before this one is taken.
            if i >= 2:
                staged.wait_for(min(i + 2, len(data)))
            batch = next(it)
            with sim.model_work():
                outs.append(_model(batch))
            del batch
    torch.cuda.synchronize()
    _same([o.cpu() for o in outs], _expected([to_half(b) for b in data]))
    if removed:
        assert Kind.LOST_OVERLAP in sim.kinds(), f"over-waiting went unseen: {sim.hazards}"
    else:
        assert sim.hazards == []


# --- after review: the source after the caller's work; mappings that share storage -----------


def test_the_source_reads_device_data_after_the_work_that_wrote_it(sim: Simulation) -> None:
    """A dataset normalised on the GPU just before the loop: the source stream waits for it.

    As in the plain loop, which reads it on the same stream; the wait is made once, where the
    epoch opens (a loop on another stream than the one that wrote the data races without
    nostall too).
    """
    consumer = "default"
    x = torch.arange(48.0, device="cuda").reshape(12, 4)
    x.mul_(2)  # queued on the default stream, not finished as far as the host knows
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    got = _consume(sim, (b for (b,) in nostall.prefetch(loader, "cuda")), consumer)
    _same(got, _expected(list(torch.split(torch.arange(48.0).reshape(12, 4) * 2, 4))))
    assert sim.hazards == []


class SharedItems(collections.abc.MutableMapping):  # type: ignore[type-arg]
    """A mapping whose shallow copy shares its items (kept in an attribute), with ``.to()``."""

    def __init__(self, items: dict[str, torch.Tensor]) -> None:
        self._d = items

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._d[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._d[key] = value

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def to(self, device: Any, non_blocking: bool = False) -> SharedItems:
        return SharedItems({k: v.to(device, non_blocking=non_blocking) for k, v in self.items()})


def test_a_mapping_whose_copy_shares_its_items_is_left_as_it_was(sim: Simulation) -> None:
    """Pinning a copy of it would write pinned tensors into the user's own object."""
    batches = [SharedItems({"x": x}) for x in _images(2)]
    with pytest.warns(UserWarning, match="may be from pageable memory"):
        got = [b["x"].cpu() for b in nostall.prefetch(batches, "cuda")]
    _same(got, _images(2))
    assert not any(b["x"].is_pinned() for b in batches)


def test_an_object_with_to_and_no_tensors_is_not_warned_about(sim: Simulation) -> None:
    """A tokenizer's output without return_tensors: nothing to protect, nothing to say."""
    batches = [Encoding({"ids": [1, 2, 3]}) for _ in range(2)]
    assert [[1, 2, 3]] * 2 == [b["ids"] for b in nostall.prefetch(batches, "cuda")]


def test_canary_a_small_batch_the_consumer_pulls_copied_off_its_stream(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer's own small pull copied on the copy stream, with no wait: seen."""
    edit = (
        "copies.append(t.to(device, non_blocking=pinned))",
        "torch.cuda.set_stream(self.stream); copies.append(t.to(device, non_blocking=pinned)); "
        "torch.cuda.set_stream(self._known.pulling.rest)",
    )
    monkeypatch.setattr(CudaStaging, "_stage_here", mutant(CudaStaging, "_stage_here", *edit))
    images = _images(4)
    batches = [(x, x.sum((1, 2, 3))) for x in images]
    with _consumer_pulls_first() as pulled:
        _consume(sim, nostall.prefetch(batches, "cuda", depth=2), "side")
    assert pulled.is_set()
    assert Kind.UNORDERED in sim.kinds(), sim.hazards


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_small_batches_the_consumer_pulls_itself(sim: Simulation, consumer: str) -> None:
    """(images, labels) pulled by the consumer, copied on its stream, then the producer's."""
    images = _images(6)
    batches = [(x, x.sum((1, 2, 3))) for x in images]
    with _consumer_pulls_first() as pulled:
        got = _consume(sim, nostall.prefetch(batches, "cuda", depth=2), consumer)
    assert pulled.is_set()
    _same(got, _expected(batches))
    assert sim.hazards == []
