"""Observations on a real GPU of what the simulated CUDA reasons about: each probe prints a finding.

1. Reserved memory when a new prefetcher is made every epoch, against one prefetcher reused
   (each prefetcher's copy stream keeps its own cached blocks in PyTorch's allocator).
2. CUDA graph capture while a prefetcher's producer is pinning and copying, in the capture
   error modes ``global`` and ``thread_local``.
3. Where loading threads (``threads=``) run GPU work a dataset does in ``__getitem__``: their
   device and current stream.
4. A dict-like batch with ``.to()`` and no ``.pin_memory()`` (as Hugging Face's
   ``BatchEncoding``): whether its tensors arrive pinned-copied (asynchronously) or blocking.

Run on a machine with a GPU: ``PYTHONPATH=src python3 benchmarks/cuda_probes.py``. Each probe
is independent; one that raises is reported and the rest still run. Exit status 1 without a GPU.
"""

from __future__ import annotations

import collections
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import nostall

MIB = 2**20


def reserved_per_epoch() -> None:
    """Reserved MiB after each of 6 epochs: a prefetcher per epoch, then one reused."""
    data = [torch.randn(256, 1024) for _ in range(16)]  # 1 MiB batches
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    per_epoch = []
    for _ in range(6):
        for batch in nostall.prefetch(data, "cuda"):
            (batch * 2).sum()
        torch.cuda.synchronize()
        per_epoch.append(torch.cuda.memory_reserved() / MIB)
    torch.cuda.empty_cache()
    reused = []
    batches = nostall.prefetch(data, "cuda")
    for _ in range(6):
        for batch in batches:
            (batch * 2).sum()
        torch.cuda.synchronize()
        reused.append(torch.cuda.memory_reserved() / MIB)
    batches.close()
    print("  new prefetcher each epoch, reserved MiB:", [round(m) for m in per_epoch])
    print("  one prefetcher reused,     reserved MiB:", [round(m) for m in reused])


def graph_capture_while_prefetching() -> None:
    """Capture a small graph while the producer is busy, in each capture error mode."""
    pageable = [torch.randn(4096, 4096) for _ in range(24)]  # 64 MiB: pinning takes a while
    model = torch.nn.Linear(64, 64, device="cuda")
    static = torch.randn(8, 64, device="cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(static)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for mode in ("global", "thread_local", "relaxed"):
        batches = nostall.prefetch(pageable, "cuda", depth=1)
        it = iter(batches)
        captured = 0
        try:
            for _ in range(8):
                # Taking a batch frees the one slot: the producer starts pinning and copying
                # the next one (cudaHostAlloc, a copy, an event) while the capture runs.
                next(it)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode=mode):
                    for _ in range(50):
                        model(static)
                graph.replay()
                captured += 1
            rest = sum(1 for _ in it)
            outcome = f"8 of 8 captured and replayed; the epoch's other {rest} batches arrived"
        except Exception as e:  # the finding is the error itself
            first = str(e).splitlines()[0][:160] if str(e) else ""
            outcome = f"{captured} captured, then {type(e).__name__}: {first}"
        finally:
            batches.close()
        try:
            torch.cuda.synchronize()
            health = "CUDA usable afterwards"
        except Exception as e:
            health = f"CUDA broken afterwards: {type(e).__name__}: {e}"
        print(f"  capture_error_mode={mode!r}: {outcome}; {health}")


class _GpuWork(Dataset[torch.Tensor]):
    """Each sample is made on the GPU; records the device and stream its thread was on."""

    def __init__(self) -> None:
        self.seen: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        stream = torch.cuda.current_stream()
        with self.lock:
            self.seen[f"device {torch.cuda.current_device()}, stream {stream.stream_id}"] += 1
        return torch.full((4,), float(i), device="cuda")


def loading_threads_device_and_stream() -> None:
    """Which device and stream loading threads run a dataset's GPU work on."""
    dataset = _GpuWork()
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(consumer):
        for batch in nostall.prefetch(DataLoader(dataset, batch_size=4), "cuda", threads=2):
            batch.sum()
    print(f"  consumer's stream {consumer.stream_id}; loading threads ran on: {dict(dataset.seen)}")


class _BatchEncodingLike(collections.UserDict):  # type: ignore[type-arg]
    """A dict-like batch with ``.to()`` and no ``pin_memory()``, as Hugging Face's."""

    def to(self, device: Any, non_blocking: bool = False) -> _BatchEncodingLike:
        return _BatchEncodingLike(
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.items()}
        )


def dict_like_batches_copy() -> None:
    """Pinned-ness of a ``.to()``-only dict-like batch's tensors after nostall's staging."""
    from torch.profiler import ProfilerActivity, profile

    batches = [_BatchEncodingLike({"input_ids": torch.ones(512, 4096)}) for _ in range(4)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for batch in nostall.prefetch(batches, "cuda"):
            batch["input_ids"].sum()
        torch.cuda.synchronize()
    kinds = collections.Counter(
        e.name for e in prof.events() if "Memcpy" in e.name or "pin_memory" in e.name
    )
    print(f"  copies and pins seen by the profiler: {dict(kinds)}")


PROBES: tuple[Callable[[], None], ...] = (
    reserved_per_epoch,
    loading_threads_device_and_stream,
    dict_like_batches_copy,
    graph_capture_while_prefetching,  # last: a failed capture can leave CUDA unusable
)


def main() -> int:
    """Run every probe; 1 without a GPU."""
    if not torch.cuda.is_available():
        print("benchmarks/cuda_probes.py needs a CUDA device", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for probe in PROBES:
        print(f"{probe.__name__}: {(probe.__doc__ or '').splitlines()[0]}", flush=True)
        try:
            probe()
        except Exception:
            traceback.print_exc(limit=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
