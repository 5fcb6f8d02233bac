"""Where the per-batch time goes on a real GPU: the first thing to run when a GPU is lent.

One command of a few minutes on the GPU machine as it is (offline, ``PYTHONPATH=src``, torch
already there; py-spy used when installed). Every figure goes to one folder (``triage.md``,
``triage.json``, the py-spy profile):

1. each CUDA call of the staging path alone (``torch.utils.benchmark``);
2. the hand-off, microseconds per batch, median (min-max) of the epochs: tiny batches (two
   small tensors) and 8 MB ones, from pageable and pinned memory, with a step that does
   nothing and one that launches 20 small kernels (each releasing the GIL, as a training
   step's launches do); for a plain ``.to()`` loop, the seed's thread and ``Queue(2)``, and
   nostall running ahead, pulling inline, and choosing (its default);
3. host to device at 8, 32 and 128 MB (``benchmarks/h2d.py``);
4. the GIL convoy on the GPU machine's own cores (``benchmarks/convoy.py``'s cases);
5. py-spy profiles (``--gil``, then ``--idle``) of the slowest nostall variant of (2), or of
   the one ``--profile`` names, after a warm-up epoch.

Without a GPU it runs (2) on the CPU and (4), skips the rest, and exits 0.

Run: ``make gpu-triage PYTHON=python3`` (``GPU_TRIAGE_OUT=folder``), or
``PYTHONPATH=src python3 benchmarks/gpu_triage.py --out out/gpu-triage``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

import nostall
from nostall.bench._convoy import CASES, format_table, run_convoy

ROOT = Path(__file__).resolve().parent.parent
Batch = tuple[torch.Tensor, ...]

#: Batches per epoch by batch size, and epochs per loop (the first of each is a warm-up).
BATCHES = {"tiny": 2000, "8MB": 200}
EPOCHS = 5

#: The parts, in the order they run.
PARTS = ("primitives", "handoff", "h2d", "convoy", "profile")


class Report:
    """The lines of ``triage.md`` and the figures of ``triage.json``, written after each part."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.figures: dict[str, Any] = {}

    def say(self, line: str = "") -> None:
        """Print ``line`` and keep it for ``triage.md``."""
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        """Write both files as they stand (a run cut short keeps what it measured)."""
        (self.out / "triage.md").write_text("\n".join(self.lines) + "\n")
        (self.out / "triage.json").write_text(json.dumps(self.figures, indent=1))


def machine(device: torch.device) -> str:
    """One line: the GPU, torch, the cores this process may use, the load."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{gpu}; torch {torch.__version__}; Python {sys.version.split()[0]}; {cores} cores "
        f"usable; load average {load}"
    )


def primitives(report: Report, device: torch.device) -> None:
    """(1) each CUDA call alone (``benchmarks/cuda_handoff.py``'s list)."""
    from cuda_handoff import primitive_timings  # beside this script

    report.say("## 1. Each CUDA call alone (us, median of timed blocks)")
    report.say()
    found = primitive_timings(device)
    for label, (median, iqr) in found.items():
        report.say(f"- {label}: {median:.2f} us (IQR {iqr:.2f})")
    report.figures["primitives_us"] = {label: median for label, (median, _) in found.items()}
    report.say()


def _plain(source: list[Batch], device: torch.device, pinned: bool) -> Iterable[Batch]:
    return (tuple(t.to(device, non_blocking=pinned) for t in batch) for batch in source)


def _seed(source: list[Batch], device: torch.device) -> Iterator[Batch]:
    """The seed's design: a thread copying on a side stream into a ``Queue(2)`` (unsafe)."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    items: queue.Queue[Any] = queue.Queue(2)

    def run() -> None:
        for batch in source:
            if stream is not None:
                with torch.cuda.stream(stream):
                    batch = tuple(t.to(device, non_blocking=True) for t in batch)
            items.put(batch)
        items.put(items)

    threading.Thread(target=run, daemon=True).start()
    while (batch := items.get()) is not items:
        yield batch


def _nostall(source: list[Batch], device: torch.device, way: str) -> nostall.Prefetcher[Any]:
    prefetcher = nostall.prefetch(source, device)
    if way != "auto":
        prefetcher._lineage.overlap.fix(inline=way == "inline")
    return prefetcher


def loops(source: list[Batch], device: torch.device, pinned: bool) -> dict[str, Callable[[], Any]]:
    """Each way to deliver ``source``, an epoch per call."""
    made = {way: _nostall(source, device, way) for way in ("ahead", "inline", "auto")}
    return {
        "plain .to() loop": lambda: _plain(source, device, pinned),
        "seed thread+Queue(2)": lambda: _seed(source, device),
        "nostall ahead": lambda: made["ahead"],
        "nostall inline": lambda: made["inline"],
        "nostall (auto)": lambda: made["auto"],
    }


def step_of(kind: str, device: torch.device) -> Callable[[Any], None]:
    """The consumer's step: nothing, or 20 small kernel launches."""
    if kind == "empty":
        return lambda batch: None
    scratch = torch.zeros(16, device=device)

    def launches(batch: Any) -> None:
        for _ in range(20):
            scratch.add_(1)

    return launches


def sources(device: torch.device) -> dict[tuple[str, bool], list[Batch]]:
    """(size, pinned) -> batches."""
    found: dict[tuple[str, bool], list[Batch]] = {}
    for size, n in BATCHES.items():
        pageable: list[Batch]
        if size == "tiny":
            pageable = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
        else:
            one = torch.zeros(2 * 1024 * 1024)  # 8 MB of float32, shared: the copy is the cost
            pageable = [(one, torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
        found[(size, False)] = pageable
        if device.type == "cuda":
            found[(size, True)] = [tuple(t.pin_memory() for t in b) for b in pageable]
    return found


def handoff(report: Report, device: torch.device) -> str:
    """(2) the hand-off matrix; returns the slowest nostall variant, for the profile."""
    report.say("## 2. The hand-off: us per batch, median (min-max) of the epochs")
    report.say()
    rows: dict[str, dict[str, list[float]]] = {}
    for (size, pinned), source in sources(device).items():
        for step_kind in ("empty", "20 launches"):
            step = step_of(step_kind, device)
            setting = f"{size}, {'pinned' if pinned else 'pageable'}, step: {step_kind}"
            ways = loops(source, device, pinned)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for epoch in range(EPOCHS + 1):
                for name, make in ways.items():
                    torch.cuda.synchronize(device) if device.type == "cuda" else None
                    start = time.perf_counter()
                    count = 0
                    for batch in make():
                        step(batch)
                        count += 1
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if epoch:
                        times[name].append((time.perf_counter() - start) / count * 1e6)
            rows[setting] = times
            for make in ways.values():
                if callable(close := getattr(make(), "close", None)):
                    close()  # the prefetchers' threads end before the next setting
            cells = ", ".join(
                f"{name} {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})"
                for name, t in times.items()
            )
            report.say(f"- {setting}: {cells}")
            report.save()
    report.figures["handoff_us"] = rows
    report.say()
    slowest = max(
        ((s, n) for s, t in rows.items() for n in t if n.startswith("nostall")),
        key=lambda sn: statistics.median(rows[sn[0]][sn[1]]),
    )
    return f"{slowest[0]} | {slowest[1]}"


def h2d(report: Report, out: Path) -> None:
    """(3) host to device at 8, 32, 128 MB, as benchmarks/h2d.py measures it."""
    report.say("## 3. Host to device (benchmarks/h2d.py)")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "h2d.py"), "--min-run-time", "0.3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "120"},
    )
    (out / "h2d.txt").write_text(done.stdout + done.stderr)
    report.say("```")
    for line in done.stdout.splitlines()[-20:]:
        report.say(line)
    report.say("```")
    report.say()


def convoy(report: Report, batches: int) -> None:
    """(4) the GIL convoy on this machine's cores."""
    report.say("## 4. The GIL convoy on this machine's cores")
    result = run_convoy(CASES, batches=batches, epochs=1 if EPOCHS == 1 else 3, realtime=True)
    report.say("```")
    for line in format_table(result).splitlines():
        report.say(line)
    report.say("```")
    report.figures["convoy_us"] = {
        f"{c.source_us:g},{c.step_us:g},{c.k}": t for c, t in result.us.items()
    }
    report.say()


def profile(report: Report, out: Path, variant: str, device: torch.device) -> None:
    """(5) py-spy on one nostall variant, when py-spy is installed.

    py-spy attaches once the profiled process has run a warm-up epoch (imports and CUDA's
    start excluded), twice: samples holding the GIL (``--gil``: what runs between the GIL-free
    calls), then every sample with idle ones (``--idle``: where each thread waits).
    """
    report.say(f"## 5. py-spy on a nostall variant: {variant}")
    spy = shutil.which("py-spy")
    if spy is None:
        report.say("py-spy is not installed: skipped (carry its wheel to profile)")
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--variant", variant, "--device", str(device)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "warm":
            report.say("the profiled process ended before its warm-up epoch: skipped")
            return
        for view, flags in (("gil", ["--gil"]), ("idle", ["--idle"])):
            target = out / f"pyspy-{view}.txt"
            command = [spy, "record", *flags, "--threads", "--rate", "500", "-f", "raw"]
            command += ["--duration", "4", "-o", str(target), "--pid", str(child.pid)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
            report.say(f"py-spy {view} view: exit {done.returncode}; stacks in {target.name}")
            if target.exists():
                _top_frames(report, target.read_text(), view)
    finally:
        child.kill()
        child.wait()
    report.say()


def _top_frames(report: Report, folded: str, view: str) -> None:
    """The 15 leaf frames with most samples, per thread, from py-spy's folded stacks."""
    leaves: dict[str, int] = {}
    total = 0
    for line in folded.splitlines():
        frames, _, samples = line.rpartition(" ")
        if not samples.isdigit():
            continue
        parts = frames.split(";")
        key = f"{parts[0]}: {parts[-1]}" if len(parts) > 1 else parts[-1]
        leaves[key] = leaves.get(key, 0) + int(samples)
        total += int(samples)
    what = "samples holding the GIL" if view == "gil" else "all samples, idle ones too"
    report.say(f"top frames by {what} ({total} samples):")
    for leaf, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:15]:
        report.say(f"- {n / max(total, 1):.0%} {leaf}")


def run_variant(variant: str, device: torch.device, seconds: float = 12.0) -> None:
    """The profiled process: one variant of (2), repeated for ``seconds`` after a warm-up epoch."""
    setting, name = variant.split(" | ")
    size, memory, step_text = (part.strip() for part in setting.split(","))
    pinned = memory == "pinned"
    source = sources(device)[(size, pinned)]
    step = step_of(step_text.removeprefix("step: "), device)
    make = loops(source, device, pinned)[name]
    for batch in make():
        step(batch)
    print("warm", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for batch in make():
            step(batch)


def main() -> int:
    """Run the parts in order; exit 0 unless a part raised."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu-triage")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--convoy-batches", type=int, default=1500)
    parser.add_argument("--quick", action="store_true", help="a few batches of each (a test)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the profiled run of (5)
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--profile",
        help="the variant of (2) to profile, as 'tiny, pageable, step: empty | nostall inline' "
        "(default: the slowest nostall variant measured)",
    )
    parser.add_argument("--tiny-batches", type=int, default=BATCHES["tiny"])
    parser.add_argument(
        "--sizes", default=",".join(BATCHES), help="the batch sizes of (2), comma-separated"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts: {sorted(parts - set(PARTS))} unknown; choose from {PARTS}")
    BATCHES["tiny"] = args.tiny_batches
    sizes = args.sizes.split(",")
    if not set(sizes) <= set(BATCHES):
        parser.error(f"--sizes: choose from {', '.join(BATCHES)}; got {args.sizes!r}")
    for size in set(BATCHES) - set(sizes):
        del BATCHES[size]
    device = torch.device(args.device)
    if args.quick:
        global EPOCHS
        BATCHES.update({size: {"tiny": 20, "8MB": 4}[size] for size in BATCHES})
        EPOCHS, args.convoy_batches = 1, 20
    if args.variant:
        run_variant(args.variant, device)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    started = time.perf_counter()
    report.say(f"# GPU triage: {machine(device)}")
    report.say()
    if device.type != "cuda":
        report.say("No GPU: the hand-off on the CPU and the convoy only.")
        report.say()
    elif "primitives" in parts:
        primitives(report, device)
        report.save()
    slowest = handoff(report, device) if "handoff" in parts else None
    report.save()
    if device.type == "cuda" and "h2d" in parts:
        h2d(report, out)
        report.save()
    if "convoy" in parts:
        convoy(report, args.convoy_batches)
        report.save()
    variant = args.profile or slowest
    if "profile" in parts and variant is not None:
        profile(report, out, variant, device)
    report.say(f"triage took {time.perf_counter() - started:.0f} s")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
