"""CUDA tensors in the simulation: CPU data behind a tensor that says it lives on a GPU.

:class:`SimTensor` is a wrapper subclass with a ``cuda:N`` device and a CPU tensor ``data``.
Every torch function called with one reaches ``__torch_function__``, which runs the function on
the CPU data under a dispatch mode that sees each ATen op: an op that is not a view is a
kernel on the calling thread's current stream of that device; its arguments are read or
written as the op's schema says; new storages are allocated from that stream's pool.
Copies between host and device are the patched ``Tensor.to`` / ``copy_`` / ``cpu`` / ``cuda``.

Invariants:
    * A storage is device memory iff the allocator knows it; a tensor whose storage is device
      memory is returned wrapped, anything else is returned as it is.
    * A plain CPU tensor with elements, given to a device op that is not a copy, raises the
      error torch raises and reports a wrong-device hazard (0-dim CPU tensors are allowed, as
      in torch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import _simulation
from ._hazards import Kind
from ._memory import weak_ref
from ._simulation import SimStream, active

#: Ops that allocate without writing.
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
#: Ops whose result the host needs (a value, or an output size that depends on the data).
_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique"}
#: Tensor attributes that must describe the wrapper (the device), not the CPU data.
_ON_WRAPPER = {"device", "is_cuda", "is_cpu", "get_device", "__hash__"}
#: Functions that may take a CPU tensor with elements beside device tensors.
_MIXING_ALLOWED = {"copy_", "__setitem__", "__getitem__", "record_stream"}


class SimTensor(torch.Tensor):
    """A tensor on a simulated GPU; ``data`` holds its values on the CPU."""

    data_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: int) -> SimTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=torch.device("cuda", device),
            requires_grad=False,
        )
        out.data_cpu = data
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SimTensor({self.data_cpu!r}, device='{self.device}')"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _ON_WRAPPER:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "untyped_storage":
            return args[0].data_cpu.untyped_storage()
        if name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            return _host_read(func, name, args[0], args[1:], kwargs)
        if name == "numpy":
            raise TypeError(
                f"can't convert {args[0].device} device type tensor to numpy. Use Tensor.cpu() "
                f"to copy the tensor to host memory first."
            )
        if name == "copy_":
            return _copy_into(args[0], args[1], bool(kwargs.get("non_blocking", False)))
        return run_on_device(func, name, args, kwargs)

    # torch annotates Tensor's as a plain function; a subclass overrides it as a classmethod,
    # as torch's own subclasses do.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(f"simulated CUDA: {func} reached dispatch with a wrapper (a bug here)")


def run_on_device(func: Any, name: str, args: Any, kwargs: Any, device: int | None = None) -> Any:
    """Run ``func`` on the CPU data of its device tensors, as kernels on the current stream."""
    flat, _ = tree_flatten((args, kwargs))
    sims = [a for a in flat if isinstance(a, SimTensor)]
    devices = {t.device.index for t in sims} | ({device} if device is not None else set())
    sim = active()
    if len(devices) > 1:
        sim.report(Kind.WRONG_DEVICE, f"{name} on tensors of devices {sorted(devices)}")
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{', '.join(f'cuda:{d}' for d in sorted(devices))}!"
        )
    if name not in _MIXING_ALLOWED:
        for a in flat:
            host = isinstance(a, torch.Tensor) and not isinstance(a, SimTensor) and a.dim() > 0
            if host and sim.memory.block_of(a) is None:
                sim.report(Kind.WRONG_DEVICE, f"{name} given a CPU tensor beside cuda ones")
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, cuda:{devices.pop()} and cpu!"
                )
    (index,) = devices
    wrappers = {id(t.data_cpu): t for t in sims}
    unwrapped = tree_map(lambda a: a.data_cpu if isinstance(a, SimTensor) else a, (args, kwargs))
    with Kernels(index):
        out = func(*unwrapped[0], **unwrapped[1])
    return wrap(out, index, wrappers)


def wrap(out: Any, index: int, wrappers: dict[int, SimTensor] | None = None) -> Any:
    """Wrap every tensor in ``out`` whose storage is device memory."""
    memory = active().memory
    wrappers = wrappers or {}

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, SimTensor):
            return x
        if id(x) in wrappers:
            return wrappers[id(x)]
        return SimTensor(x, index) if memory.block_of(x) is not None else x

    return tree_map(one, out)


class Kernels(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__
    """Sees each ATen op of a device function and books it as a kernel (see module docstring)."""

    def __init__(self, device: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        op = func.overloadpacket.__name__
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return func(*args, **kwargs)  # a view: no kernel, the same memory
        sim = active()
        stream = sim.current_stream(self.device)
        memory = sim.memory
        written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        named = list(zip((a.name for a in schema.arguments), args, strict=False))
        named += list(kwargs.items())
        source = args[1] if op == "copy_" else None
        if (  # ``device_tensor[...] = host_tensor``
            isinstance(source, torch.Tensor)
            and source.dim() > 0
            and memory.block_of(source) is None
        ):
            upload_into(args[0], source, bool(kwargs.get("non_blocking", False)), stream)
            return args[0]
        with sim.lock:
            step = sim.launch(stream)
            for arg_name, value in named:
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor):
                        block = memory.block_of(t)
                        if block is not None:
                            sim.access(block, stream, step, arg_name in written, op)
        out = func(*args, **kwargs)
        with sim.lock:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and memory.block_of(t) is None:
                    block = memory.allocate(
                        t.untyped_storage(), self.device, stream.id, sim.known, sim.host
                    )
                    if op not in _EMPTY:
                        sim.access(block, stream, step, True, op)
        if op in _HOST_READS:
            sim.host_sync(sim.clock_of(stream), f"{op} (the host needs the value)", self.device)
        return out


def kernel_on(stream: SimStream, data: torch.Tensor, write: bool, op: str) -> None:
    """Book one kernel on ``stream`` that reads or writes ``data``'s block (if device memory)."""
    sim = active()
    block = sim.memory.block_of(data)
    with sim.lock:
        step = sim.launch(stream)
        if block is not None:
            sim.access(block, stream, step, write, op)


def _copied(data: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return data.to(dtype, copy=True) if dtype is not None else data.clone()


def _host_read(func: Any, name: str, tensor: SimTensor, args: Any, kwargs: Any) -> Any:
    sim = active()
    stream = sim.current_stream(tensor.device.index)
    kernel_on(stream, tensor.data_cpu, False, name)
    sim.host_sync(sim.clock_of(stream), f"Tensor.{name}()", tensor.device.index)
    return func(tensor.data_cpu, *args, **kwargs)


def new_device_tensor(data: torch.Tensor, index: int, stream: SimStream, op: str) -> SimTensor:
    """Book ``data`` (a fresh CPU tensor) as memory written by one kernel on ``stream``."""
    sim = active()
    with sim.lock:
        step = sim.launch(stream)
        block = sim.memory.allocate(data.untyped_storage(), index, stream.id, sim.known, sim.host)
        sim.access(block, stream, step, True, op)
    return SimTensor(data, index)


def upload(src: torch.Tensor, index: int, non_blocking: bool, fresh: torch.Tensor) -> SimTensor:
    """Host-to-device: ``fresh`` (a private copy of ``src``) becomes device memory."""
    sim = active()
    stream = sim.current_stream(index)
    _check_upload(src, non_blocking, stream)
    out = new_device_tensor(fresh, index, stream, "copy (host to device)")
    _finish_upload(src, non_blocking, stream)
    return out


def upload_into(
    dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, stream: SimStream
) -> None:
    """Host-to-device into existing memory (``dst`` is the CPU stand-in of device memory)."""
    _check_upload(src, non_blocking, stream)
    kernel_on(stream, dst, True, "copy_ (host to device)")
    with torch._C.DisableTorchFunctionSubclass():
        dst.copy_(src)
    _finish_upload(src, non_blocking, stream)


def _check_upload(src: torch.Tensor, non_blocking: bool, stream: SimStream) -> None:
    sim = active()
    if non_blocking and not is_pinned(src):
        sim.report(
            Kind.PAGEABLE_NON_BLOCKING,
            f"non_blocking=True copy of a {tuple(src.shape)} tensor from unpinned memory",
        )
    sim.check_false_dependency(stream, "host-to-device copy")


def _finish_upload(src: torch.Tensor, non_blocking: bool, stream: SimStream) -> None:
    if non_blocking and is_pinned(src):
        return  # truly asynchronous
    sim = active()
    why = "pageable" if not is_pinned(src) else "blocking (non_blocking=False)"
    sim.host_sync(sim.clock_of(stream), f"{why} host-to-device copy", stream.device_index)


def download(
    src: SimTensor,
    dtype: torch.dtype | None,
    non_blocking: bool,
    memory_format: torch.memory_format = torch.preserve_format,
    into: bool = False,
) -> torch.Tensor:
    """Device-to-host: a read on the current stream; the host waits for it unless non_blocking.

    With ``non_blocking`` torch copies into pinned memory and returns at once: the result is a
    :class:`HostResult` whose use before the host knows the copy finished is a hazard. (Into
    an existing tensor, ``into``, the copy is as asynchronous but its reads are not seen.)
    """
    sim = active()
    index = src.device.index
    stream = sim.current_stream(index)
    kernel_on(stream, src.data_cpu, False, "copy (device to host)")
    out = _copied(src.data_cpu, dtype)
    if memory_format is not torch.preserve_format:
        out = out.contiguous(memory_format=memory_format)
    if not non_blocking:
        sim.host_sync(sim.clock_of(stream), "device-to-host copy", index)
        return out
    if into:
        return out
    with sim.lock:
        step = sim.known[stream.id].get(stream.id, 0)
    pending = out.as_subclass(HostResult)
    pending.copied_by = (stream.id, step)
    return mark_pinned(pending)


class HostResult(torch.Tensor):
    """The result of a ``non_blocking`` device-to-host copy, in pinned memory.

    Its values are there at once in the model; using them before the host knows the copy
    finished (a sync, or :meth:`Simulation.time_passes`) is reported, once per tensor.
    """

    copied_by: tuple[int, int]
    reported: bool  # set once its read before a sync was reported

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA and _simulation._ACTIVE is not None:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, HostResult):
                    _check_host_read(a, name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


#: What reading a tensor's description (not its values) calls.
_METADATA = {
    "shape", "dtype", "device", "is_cuda", "is_cpu", "size", "dim", "ndim", "numel", "stride",
    "is_pinned", "is_contiguous", "storage_offset", "requires_grad", "layout", "is_sparse",
    "is_nested", "is_quantized", "is_meta", "is_floating_point", "is_complex", "element_size",
    "nbytes", "itemsize", "untyped_storage", "data_ptr", "__hash__", "__len__", "get_device",
    "names", "grad", "grad_fn", "is_leaf", "_base", "_is_view", "pin_memory",
}  # fmt: skip


def _check_host_read(t: HostResult, what: str) -> None:
    sim = active()
    stream, step = t.copied_by
    with sim.lock:
        done = sim.host.get(stream, 0) >= step
    if not done and not getattr(t, "reported", False):
        t.reported = True
        sim.report(
            Kind.UNSYNCED_HOST_READ,
            f"{what} of a {tuple(t.shape)} tensor copied from the device with non_blocking=True "
            f"before the host synchronized with {sim.streams[stream]!r}",
        )


def peer_copy(src: SimTensor, index: int, dtype: torch.dtype | None) -> SimTensor:
    """Device-to-device across GPUs: each side's current stream waits for the other (as torch)."""
    sim = active()
    src_stream = sim.current_stream(src.device.index)
    dst_stream = sim.current_stream(index)
    dst_stream.wait_stream(src_stream)
    kernel_on(dst_stream, src.data_cpu, False, "copy (peer)")
    out = new_device_tensor(_copied(src.data_cpu, dtype), index, dst_stream, "copy (peer)")
    src_stream.wait_stream(dst_stream)
    return out


def _copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """``Tensor.copy_`` with a device tensor on either side."""
    sim = active()
    if isinstance(dst, SimTensor) and not isinstance(src, SimTensor) and src.dim() > 0:
        upload_into(dst.data_cpu, src, non_blocking, sim.current_stream(dst.device.index))
        return dst
    if not isinstance(dst, SimTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return dst.copy_(download(src, None, non_blocking, into=True))  # type: ignore[arg-type]
    if isinstance(src, SimTensor) and src.device != dst.device:
        moved = peer_copy(src, dst.device.index, None)
        into: torch.Tensor = run_on_device(torch.Tensor.copy_, "copy_", (dst, moved), {})
        return into
    out: torch.Tensor = run_on_device(
        torch.Tensor.copy_, "copy_", (dst, src), {"non_blocking": non_blocking}
    )
    return out


# --- pinned host memory ---------------------------------------------------------------------


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was pinned in the simulation."""
    if isinstance(t, SimTensor):
        return False
    ref = active().pinned.get(t.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def pin(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of ``t`` (``t`` itself if it already is)."""
    if is_pinned(t):
        return t
    return mark_pinned(t.clone())


def mark_pinned(t: torch.Tensor) -> torch.Tensor:
    """Book ``t``'s (fresh) storage as pinned memory; return ``t``."""
    sim = active()
    with torch._C.DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
    with sim.lock:
        sim.pinned[storage._cdata] = weak_ref(storage)
    return t
