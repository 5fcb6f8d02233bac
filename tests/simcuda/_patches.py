"""The torch surface the simulation replaces while it is active, and puts back afterwards."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

import nostall._staging.copy_streams
import nostall.transforms._decode

from ._hazards import Kind
from ._simulation import SimEvent, SimStream, active, device_index
from ._tensor import (
    SimTensor,
    download,
    is_pinned,
    peer_copy,
    pin,
    run_on_device,
    upload,
)

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "arange",
    "linspace",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
)
_TOTAL_MEMORY = 80 * 2**30


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return torch.device(device).type == "cuda"


def _factory(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        pinned = bool(kwargs.pop("pin_memory", False))
        if not _is_cuda(device):
            out = original(*args, **kwargs)
            return pin(out) if pinned else out
        index = device_index(device)
        kwargs["device"] = "cpu"
        return run_on_device(original, name, args, kwargs, device=index)

    return make


def _tensor_factory(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``torch.tensor(data, device="cuda")``: built on the host, then a pageable blocking copy."""

    def make(data: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if not _is_cuda(device):
            return original(data, *args, **kwargs)
        if isinstance(data, SimTensor) and name == "as_tensor":
            return data.to(device, kwargs.get("dtype"))
        kwargs["device"] = "cpu"
        host = original(data, *args, **kwargs)
        fresh = host.clone() if isinstance(data, torch.Tensor) else host
        return upload(host, device_index(device), False, fresh)

    return make


def _to(original: Callable[..., Any]) -> Callable[..., Any]:
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        copy = bool(kwargs.pop("copy", False))
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        fmt = torch.preserve_format if memory_format is None else memory_format
        if isinstance(self, SimTensor):
            same = device is not None and device.type == "cuda"
            if device is None or (same and device_index(device) == self.device.index):
                convert = {"dtype": dtype, "memory_format": fmt, "copy": copy}
                return run_on_device(original, "to", (self,), convert)
            if device.type == "cuda":
                moved = peer_copy(self, device_index(device), dtype)
                keep = fmt is torch.preserve_format
                return moved if keep else moved.contiguous(memory_format=fmt)
            return download(self, dtype, non_blocking, fmt)
        if device is not None and device.type == "cuda":
            fresh = original(self, dtype=dtype, memory_format=fmt, copy=True)
            return upload(self, device_index(device), non_blocking, fresh)
        return original(self, *args, **kwargs, copy=copy)

    return to


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> Any:
    return self.to(torch.device("cuda", device_index(device)), non_blocking=non_blocking)


def _cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, SimTensor):
            return download(self, None, False)
        return original(self, *args, **kwargs)

    return cpu


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if isinstance(self, SimTensor):
        raise RuntimeError(
            f"cannot pin '{self.type()}' only dense CPU tensors can be pinned"  # torch's words
        )
    return pin(self)


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    return is_pinned(self)


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    if not isinstance(self, SimTensor):
        raise NotImplementedError(
            "Could not run 'aten::record_stream' with arguments from the 'CPU' backend."
        )
    if not isinstance(stream, SimStream):
        kind = type(stream).__name__
        raise TypeError(f"record_stream(): argument 's' must be Stream, not {kind}")
    sim = active()
    if stream.device_index != self.device.index:
        sim.report(
            Kind.WRONG_DEVICE,
            f"record_stream of a {self.device} tensor on {stream!r}, a stream of another device",
        )
    block = sim.memory.block_of(self.data_cpu)
    with sim.lock:
        if block is not None and stream.id != block.stream:
            block.recorded.add(stream.id)


def _properties(device: Any = None) -> SimpleNamespace:
    index = device_index(device)
    return SimpleNamespace(
        name="Simulated GPU",
        major=9,
        minor=0,
        multi_processor_count=132,
        total_memory=_TOTAL_MEMORY,
        uuid=f"00000000-0000-0000-0000-{index:012d}",
    )


def _synchronize(device: Any = None) -> None:
    sim = active()
    index = device_index(device)
    sim.check_device_sync("torch.cuda.synchronize()")
    clock: dict[int, int] = {}
    with sim.lock:
        for stream in sim.streams.values():
            if stream.device_index == index:
                for key, value in sim.known[stream.id].items():
                    clock[key] = max(clock.get(key, 0), value)
    sim.host_sync(clock, "torch.cuda.synchronize()", index)


@contextlib.contextmanager
def _device_context(device: Any) -> Iterator[None]:
    sim = active()
    if device is None or (isinstance(device, int) and device < 0):
        yield
        return
    previous = sim.current_device()
    sim.set_device(device)  # torch's ExchangeDevice: eager
    try:
        yield
    finally:
        sim.set_device(previous, lazy=True)  # torch's MaybeSetDevice: no context made


def _sleep(cycles: int) -> None:
    """A kernel that only takes time: one step on the current stream."""
    sim = active()
    stream = sim.current_stream(None)
    with sim.lock:
        sim.launch(stream)


class _Graph:
    """``torch.cuda.CUDAGraph``: capture is bookkeeping; replay runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: SimStream | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        sim = active()
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, "
                               f"or `relaxed`, got {capture_error_mode}")  # fmt: skip
        self.stream = sim.current_stream(None)
        with sim.lock:
            sim.capturing[self.stream.id] = (capture_error_mode, threading.get_ident())

    def capture_end(self) -> None:
        sim = active()
        with sim.lock:
            if self.stream is not None:
                sim.capturing.pop(self.stream.id, None)

    def replay(self) -> None:
        return None


class _GraphContext:
    """``torch.cuda.graph``: sync, then capture on a side stream, as torch does."""

    def __init__(
        self,
        cuda_graph: _Graph,
        pool: Any = None,
        stream: SimStream | None = None,
        capture_error_mode: str = "global",
    ) -> None:
        self.graph = cuda_graph
        self.stream = stream if stream is not None else SimStream()
        self.mode = capture_error_mode
        self._context: Any = None

    def __enter__(self) -> None:
        _synchronize()
        torch.cuda.empty_cache()
        self._context = active().use_stream(self.stream)
        self._context.__enter__()
        self.graph.capture_begin(capture_error_mode=self.mode)

    def __exit__(self, *exc: object) -> None:
        self.graph.capture_end()
        self._context.__exit__(*exc)


def replacements() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for everything the simulation patches."""
    sim = active()
    cuda = torch.cuda
    out: list[tuple[Any, str, Any]] = [
        (cuda, "is_available", lambda: True),
        (cuda, "is_initialized", lambda: True),
        (cuda, "_lazy_init", lambda: None),
        (cuda, "init", lambda: None),
        (cuda, "device_count", lambda: sim.device_count),
        (cuda, "current_device", sim.current_device),
        (cuda, "set_device", sim.set_device),
        (cuda, "device", _device_context),
        (cuda, "Stream", SimStream),
        (cuda, "Event", SimEvent),
        (cuda, "current_stream", lambda device=None: sim.current_stream(device)),
        (cuda, "default_stream", lambda device=None: sim.default_stream(device)),
        (cuda, "set_stream", sim.set_stream),
        (cuda, "stream", sim.use_stream),
        (cuda, "synchronize", _synchronize),
        (cuda, "_sleep", _sleep),
        (cuda, "CUDAGraph", _Graph),
        (cuda, "graph", _GraphContext),
        (cuda, "is_current_stream_capturing", lambda: sim.current_stream(None).id in sim.capturing),
        (cuda, "is_bf16_supported", lambda *a, **k: True),
        (cuda, "get_device_properties", _properties),
        (cuda, "get_device_name", lambda device=None: _properties(device).name),
        (cuda, "get_device_capability", lambda device=None: (9, 0)),
        (
            cuda,
            "mem_get_info",
            lambda device=None: (
                _TOTAL_MEMORY - sim.memory.reserved(device_index(device)),
                _TOTAL_MEMORY,
            ),
        ),
        (cuda, "memory_allocated", lambda device=None: sim.memory.allocated(device_index(device))),
        (cuda, "memory_reserved", lambda device=None: sim.memory.reserved(device_index(device))),
        (
            cuda,
            "max_memory_allocated",
            lambda device=None: sim.memory.peak.get(device_index(device), 0),
        ),
        (cuda, "empty_cache", lambda: sim.memory.empty_cache(sim.known, sim.host)),
        (torch.Tensor, "to", _to(torch.Tensor.to)),
        (torch.Tensor, "cuda", _cuda),
        (torch.Tensor, "cpu", _cpu(torch.Tensor.cpu)),
        (torch.Tensor, "pin_memory", _pin_memory),
        (torch.Tensor, "is_pinned", _is_pinned),
        (torch.Tensor, "record_stream", _record_stream),
    ]
    # Streams nostall lends to its prefetchers, and its decode streams, belong to one
    # (simulated) CUDA world.
    out.append(
        (nostall._staging.copy_streams, "LENDER", nostall._staging.copy_streams.CopyStreams())
    )
    out.append((nostall.transforms._decode, "STREAMS", nostall.transforms._decode.DecodeStreams()))
    for name in _FACTORIES:
        out.append((torch, name, _factory(getattr(torch, name), name)))
    for name in ("tensor", "as_tensor"):
        out.append((torch, name, _tensor_factory(getattr(torch, name), name)))
    return out
