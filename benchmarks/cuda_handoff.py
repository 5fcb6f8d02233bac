"""Where nostall's per-batch time goes on CUDA, for tiny batches from an instant source.

The bench's hand-off trial times a loop over an in-memory list, less a plain loop, per batch.
On a GPU that is the staging path (pin, copy, event, the consumer's wait) when the consumer
does nothing. This probe prints, in one run:

1. that loop's microseconds per batch, for pageable and pinned sources at depths 2 and 8,
   against a plain ``.to()`` loop (median (min-max) of 5 epochs);
2. each CUDA primitive of the path alone (``torch.utils.benchmark``): pinning, the copies,
   an event made and recorded, the stream context, the consumer's wait and ``record_stream``,
   so that their sum can be set against (1);
3. a cProfile of one epoch, by own time and by cumulative time. On Python 3.12 one profiler
   sees every thread (``sys.monitoring``); before, each new thread gets its own. Times under
   several threads include waits for the GIL: read them for calls, not for exact costs.

Run: ``PYTHONPATH=src python3 benchmarks/cuda_handoff.py [--device cuda] [--batches 2000]``.
Found on an H100 (2026-11-26): 260-320 us per batch, against 92.6 us at the first GPU run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from typing import Any

import torch
from torch.utils import benchmark

import nostall

Batch = tuple[torch.Tensor, torch.Tensor]


def epoch_us(loop: Any, n: int) -> float:
    """One pass over ``loop``, in microseconds per batch."""
    start = time.perf_counter()
    for _ in loop:
        pass
    return (time.perf_counter() - start) / n * 1e6


def loops(pageable: list[Batch], pinned: list[Batch], device: torch.device) -> None:
    """(1): the hand-off loop against a plain ``.to()`` loop."""
    n, rows = len(pageable), dict[str, list[float]]()
    for _ in range(5):
        plain = ((x.to(device), y.to(device)) for x, y in pageable)
        rows.setdefault("plain .to() loop", []).append(epoch_us(plain, n))
        for name, source in (("pageable", pageable), ("pinned", pinned)):
            for depth in (2, 8):
                with nostall.prefetch(source, device, depth=depth) as loop:
                    rows.setdefault(f"nostall {name} depth={depth}", []).append(epoch_us(loop, n))
    for name, us in rows.items():
        print(f"{name:32s} {statistics.median(us):8.1f} us/batch ({min(us):.1f}-{max(us):.1f})")


def primitive_timings(device: torch.device) -> dict[str, tuple[float, float]]:
    """Each CUDA call of the staging path alone: label -> (median, IQR) in microseconds."""
    x, copy = torch.zeros(8), torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    pinned, on_device = x.pin_memory(), x.to(device)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(copy)
    torch.cuda.synchronize(device)  # the event is done: query() answers without waiting
    statements = {
        "pin_memory (8 floats)": "x.pin_memory()",
        ".to(device, non_blocking) from pinned": "pinned.to(device, non_blocking=True)",
        ".to(device) from pageable": "x.to(device)",
        "Event() + record": "e = torch.cuda.Event(); e.record(copy)",
        "with torch.cuda.stream(copy)": "with torch.cuda.stream(copy): pass",
        "with torch.cuda.device(device)": "with torch.cuda.device(device): pass",
        "set_stream(copy), set_stream(default)": (
            "torch.cuda.set_stream(copy); torch.cuda.set_stream(default)"
        ),
        "torch.cuda.current_stream(index)": "torch.cuda.current_stream(index)",
        "is_pinned (pageable)": "x.is_pinned()",
        "is_pinned (pinned)": "pinned.is_pinned()",
        "torch.cuda.current_stream(device)": "torch.cuda.current_stream(device)",
        "stream.wait_event(event)": "torch.cuda.current_stream().wait_event(event)",
        "default.wait_event(event), the stream at hand": "default.wait_event(event)",
        "event.query() (done)": "event.query()",
        "record_stream": "on_device.record_stream(copy)",
        "is_current_stream_capturing": "torch.cuda.is_current_stream_capturing()",
        "a small kernel (add_)": "on_device.add_(1)",
    }
    default, index = torch.cuda.default_stream(device), on_device.device.index
    names = dict(x=x, pinned=pinned, on_device=on_device, copy=copy, event=event, device=device)
    names.update(default=default, index=index)
    found = {}
    for label, stmt in statements.items():
        timer = benchmark.Timer(stmt, globals={**names, "torch": torch}, label=label)
        m = timer.blocked_autorange(min_run_time=0.2)
        found[label] = (m.median * 1e6, m.iqr * 1e6)
    torch.cuda.synchronize(device)
    return found


def primitives(device: torch.device) -> None:
    """(2): each CUDA call of the staging path alone, in microseconds."""
    if device.type != "cuda":
        print("primitives: CUDA only")
        return
    for label, (median, iqr) in primitive_timings(device).items():
        print(f"{label:42s} {median:8.2f} us (IQR {iqr:.2f})")


def profiled(pageable: list[Batch], device: torch.device) -> None:
    """(3): a cProfile of one epoch at depth 2 from the pageable source."""
    profiles = [cProfile.Profile()]

    def in_each_new_thread(*_: Any) -> None:  # its first event: profile the thread
        threading.setprofile(None)
        profiles.append(cProfile.Profile())
        profiles[-1].enable()

    if sys.version_info < (3, 12):
        threading.setprofile(in_each_new_thread)
    profiles[0].enable()
    with nostall.prefetch(pageable, device, depth=2) as loop:
        for _ in loop:
            pass
    profiles[0].disable()
    threading.setprofile(None)
    for i, p in enumerate(profiles):
        p.disable()
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(p, stream=out).sort_stats(order).print_stats(16)
            print(f"===== cProfile {i} ({'main' if not i else 'thread'}), by {order}")
            print(out.getvalue()[-5000:])


def main() -> None:
    """Run the three parts in order on ``--device``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device(args.device)
    pageable = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(args.batches)]
    pinned: list[Batch] = pageable
    if device.type == "cuda":
        pinned = [(x.pin_memory(), y.pin_memory()) for x, y in pageable]
    loops(pageable, pinned, device)
    primitives(device)
    profiled(pageable, device)


if __name__ == "__main__":
    main()
