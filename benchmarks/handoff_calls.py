"""What nostall calls per batch on its CUDA hand-off path: Python functions and torch.cuda calls.

The loop of ``benchmarks/cuda_handoff.py`` (an in-memory list of two tiny tensors, a consumer
doing nothing), run twice, for ``--n1`` and ``--n2`` batches, each under cProfile in every
thread; the difference of the call counts divided by ``n2 - n1`` is what one batch costs in
calls, the setup of each run cancelled out. Printed:

1. nostall's own functions, calls per batch;
2. what nostall calls outside itself (torch, the simulation's stand-ins for torch.cuda),
   builtins aside unless ``--all``;
3. torch.cuda's own Python (stream and device contexts, device-index lookups), by anyone.

Without a GPU (or with ``--simulated``) the loop runs on the simulated CUDA of the tests
(``tests/simcuda``), whose stand-ins replace torch.cuda's functions. ``--torch-python`` then
runs torch's own ``torch.cuda.stream``, ``torch.cuda.device`` and ``current_stream`` Python
over the simulation, so that (3) counts what a GPU machine runs. Counts, not times: the
simulation's costs are not a GPU's.

``--device cpu`` counts the hand-off to the CPU instead (no CUDA, simulated or not).
After the tables, the modules a batch passes through: those with a call per batch or more.

Run: ``PYTHONPATH=src python3 benchmarks/handoff_calls.py [--torch-python] [--pinned]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import linecache
import pstats
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import nostall

Func = tuple[str, int, str]


def profiled_loop(n: int, depth: int, pinned: bool, path: str, device: str) -> pstats.Stats:
    """One pass of ``n`` batches through ``nostall.prefetch(list, device)``, every thread seen.

    ``path``: who pulls the batches, as the threads run (``any``), the producer thread alone
    (``producer``: a ``timeout=`` keeps the consumer from pulling), or the consumer alone
    (``consumer``: the producer thread waits for a slot until the end).
    """
    source = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
    if pinned:
        source = [(x.pin_memory(), y.pin_memory()) for x, y in source]
    profiles = [cProfile.Profile()]

    def in_each_new_thread(*_: Any) -> None:  # its first event: profile the thread
        threading.setprofile(None)
        profiles.append(cProfile.Profile())
        profiles[-1].enable()

    if sys.version_info < (3, 12):  # from 3.12 one profiler sees every thread
        threading.setprofile(in_each_new_thread)
    profiles[0].enable()
    timeout = 60.0 if path == "producer" else None
    held = held_producer() if path == "consumer" else contextlib.nullcontext()
    with nostall.prefetch(source, device, depth=depth, timeout=timeout) as loop, held:
        got = sum(1 for _ in loop)
    profiles[0].disable()
    threading.setprofile(None)
    assert got == n, f"{got} batches of {n}"
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        p.disable()  # ended threads: already off
        stats.add(p)
    return stats


@contextlib.contextmanager
def held_producer() -> Iterator[None]:
    """The producer thread takes no slot in the block, then ends: the consumer pulls all."""
    from nostall._engine.channel import Channel

    acquire, released = Channel.acquire, threading.Event()

    def held(self: Channel, *args: Any, **kwargs: Any) -> bool:
        if threading.current_thread().name.startswith("nostall"):
            while not (released.wait(0.01) or self.stop.is_set()):
                pass
            return False
        return acquire(self, *args, **kwargs)

    Channel.acquire = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        released.set()
        Channel.acquire = acquire  # type: ignore[method-assign]


def _label(func: Func) -> str:
    file, line, name = func
    if file == "~":
        return name  # a builtin
    short = file.rsplit("/src/", 1)[-1].rsplit("/site-packages/", 1)[-1]
    short = "simcuda/" + file.rsplit("/simcuda/", 1)[-1] if "/simcuda/" in file else short
    text = linecache.getline(file, line).strip()[:60] if name == "<lambda>" else ""
    return f"{short}:{line}({name}) {text}".rstrip()


def counts(stats: pstats.Stats) -> list[dict[str, int]]:
    """[nostall's functions, what nostall calls outside itself, torch.cuda's Python]."""
    own: dict[str, int] = {}
    out: dict[str, int] = {}
    cuda: dict[str, int] = {}
    ours = "/nostall/"
    for func, (_, calls, _, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = _label(func)
        if ours in func[0]:
            own[key] = own.get(key, 0) + calls
            continue
        if "/torch/cuda/" in func[0] or "/torch/_utils" in func[0]:
            cuda[key] = cuda.get(key, 0) + calls
        from_us = sum(c[0] for f, c in callers.items() if ours in f[0])
        if from_us:
            out[key] = out.get(key, 0) + from_us
    return [own, out, cuda]


@contextlib.contextmanager
def simulated(torch_python: bool) -> Iterator[None]:
    """The simulated CUDA of the tests; with ``torch_python``, torch's own contexts over it."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from simcuda import simulated_cuda
    from torch.cuda import _utils

    real_stream, real_device = torch.cuda.stream, torch.cuda.device
    with simulated_cuda() as sim:
        if torch_python:

            def exchange(index: int, lazy: bool = False) -> int:
                if index < 0:
                    return -1
                previous = sim.current_device()
                sim.set_device(index, lazy=lazy)
                return previous

            def current_stream(device: Any = None) -> Any:  # torch's, over the simulation
                torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
                return sim.current_stream(_utils._get_device_index(device, optional=True))

            cuda: Any = torch.cuda
            cuda.stream, cuda.device, cuda.current_stream = real_stream, real_device, current_stream
            cuda._exchange_device = exchange
            cuda._maybe_exchange_device = lambda index: exchange(index, lazy=True)
        yield
        assert sim.hazards == [], sim.hazards


def main() -> None:
    """Count, then print the three tables of calls per batch."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n1", type=int, default=200)
    parser.add_argument("--n2", type=int, default=1200)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--pinned", action="store_true", help="a pinned source")
    parser.add_argument("--path", choices=("any", "producer", "consumer"), default="any")
    parser.add_argument("--simulated", action="store_true", help="even where a GPU is")
    parser.add_argument("--torch-python", action="store_true", help="see the module's doc")
    parser.add_argument("--all", action="store_true", help="builtins too, in table 2")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the target")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    fake = not cpu and (args.simulated or not torch.cuda.is_available())
    with simulated(args.torch_python) if fake else contextlib.nullcontext():
        few = counts(
            profiled_loop(args.n1, args.depth, args.pinned and not cpu, args.path, args.device)
        )
        many = counts(
            profiled_loop(args.n2, args.depth, args.pinned and not cpu, args.path, args.device)
        )
    span = args.n2 - args.n1
    titles = ["nostall's functions", "called by nostall, outside it", "torch.cuda's Python"]
    kind = "CPU" if cpu else "simulated CUDA" if fake else "CUDA"
    print(f"calls per batch ({kind}, torch {torch.__version__}, pulls: {args.path})")
    for i, (title, a, b) in enumerate(zip(titles, few, many, strict=True)):
        rows = [((b.get(k, 0) - a.get(k, 0)) / span, k) for k in set(a) | set(b)]
        rows = [(per, k) for per, k in rows if abs(per) >= 0.01]
        print(f"===== {title}: {sum(per for per, _ in rows):.2f} per batch")
        for per, key in sorted(rows, key=lambda r: (-r[0], r[1])):
            if args.all or not (key.startswith(("<", "{")) and "torch" not in key):
                print(f"{per:7.2f}  {key}")
        if i == 0:
            print(f"===== nostall's modules: {', '.join(modules(rows))}")


def modules(rows: list[tuple[float, str]]) -> list[str]:
    """The modules a batch passes through: those with a call per batch or more, on average.

    A call every few batches (a pace decision) does not count.
    """
    per_module: dict[str, float] = {}
    for per, key in rows:
        module = key.split(":", 1)[0]
        per_module[module] = per_module.get(module, 0.0) + per
    return sorted(m for m, per in per_module.items() if per >= 0.5)


if __name__ == "__main__":
    main()
