"""Running independent GPU work concurrently, each on its own stream, with the right waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._device import DeviceLike, resolve_device
from ._tree import iter_tensors


def run_concurrently(*fns: Callable[[], Any], device: DeviceLike = None) -> list[Any]:
    """Run each callable on its own CUDA stream; return their results in order.

    The waits the stream rules call for:
        * each side stream first waits for the work already queued on the caller's current
          stream (the inputs may still be being produced there: the classic race, a kernel on
          a new stream reading a tensor that ``normal_()`` on the default stream has not
          finished filling);
        * the caller's stream then waits for every side stream, so whatever comes next sees
          the results;
        * every CUDA tensor in the results is ``record_stream``-ed on the caller's stream, so
          the caching allocator does not reuse its memory while the caller may still read it.

    Off CUDA the callables simply run in order.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return [fn() for fn in fns]
    caller = torch.cuda.current_stream(dev)
    streams = [torch.cuda.Stream(dev) for _ in fns]  # type: ignore[no-untyped-call]
    results = []
    for fn, stream in zip(fns, streams, strict=True):
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            results.append(fn())
    for stream in streams:
        caller.wait_stream(stream)
    for result in results:
        for tensor in iter_tensors(result):
            if tensor.is_cuda:
                tensor.record_stream(caller)
    return results
