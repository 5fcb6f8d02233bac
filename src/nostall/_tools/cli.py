"""The ``nostall`` command line. Each subcommand calls a library function usable from Python.

Exit statuses: 0 when the command did its work; 2 for bad usage, meaning what was typed on the
command line cannot work: argparse's own errors (with the usage line) and a
:class:`~nostall._exceptions.ConfigurationError` (one line, ``nostall CMD: error: ...``). Nothing
else is turned into a usage error: an exception raised while measuring, a ``ValueError`` from the
user's dataset or step included, propagates with its traceback (Python prints it, status 1), so
that the user sees the line of their own code that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from .. import __version__
from .._arguments import flag_count as _count
from .._exceptions import ConfigurationError, DeviceUnavailableError

if TYPE_CHECKING:
    import torch

_EXIT_STATUS = (
    "exit status: 0 done; 2 bad usage (a flag, a MODULE:FUNC that cannot be loaded, a device "
    "that is not here, a loader that cannot be measured); an exception raised by your own "
    "code is shown with its traceback (1); bench --check: 1 a claim failed, 3 too busy to judge"
)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the ``nostall`` command."""
    from ..bench._config import add_flags

    parser = argparse.ArgumentParser(
        prog="nostall",
        description="Keep the GPU fed: find and remove input-pipeline stalls in PyTorch training.",
        epilog=_EXIT_STATUS,
    )
    parser.add_argument("--version", action="version", version=f"nostall {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser(
        "bench",
        help="run the same workloads through the usual ways to load data and through nostall",
        description=(
            "Train small convnets on synthetic uint8 images whose loading costs a set multiple "
            "of the step's time (the load/compute ratio), and on JPEG files decoded, cropped and "
            "resized with PIL, through each contender: the serial DataLoader, the best-practice "
            "DataLoader (workers, pin_memory, persistent_workers), the seed design (thread + "
            "Queue(2)), installed peers (torchdata.nodes, prefetch_generator), on GPU a "
            "timm-style lookahead, and nostall.prefetch; then the hand-off cost per batch. "
            "Contenders alternate; every figure is a median with its min-max over the repeats. "
            "Ends with the conclusion in plain words."
        ),
    )
    add_flags(bench)
    bench.add_argument(
        "--check",
        action="store_true",
        help=(
            "also test the claims a sound install meets on a machine that is not busy; exit 1 "
            "if one fails, 3 if the machine was too busy to judge them"
        ),
    )
    bench.add_argument("--json", metavar="PATH", help="write every record as JSON to PATH")
    bench.add_argument(
        "--plot", metavar="PATH", help="write a PNG chart to PATH (needs matplotlib: nostall[plot])"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")

    devices = commands.add_parser(
        "devices",
        help="list the visible accelerators and the host",
        description=(
            "Each visible CUDA device (after CUDA_VISIBLE_DEVICES) with its compute capability, "
            "multiprocessors, free and total memory; with nvidia-ml-py installed "
            "(nostall[nvml]) also utilisation, PCIe link, temperature and power. Without CUDA, "
            "the CPU side: cores, memory, torch threads, MPS."
        ),
    )
    devices.add_argument("--json", action="store_true", help="print JSON instead of a table")

    memory = commands.add_parser(
        "memory",
        help="memory of each visible device and of the host",
        description=(
            "For each visible CUDA device, its free and total memory as the driver sees it "
            "(every process's use included), and the host's available and total memory; "
            "allocated, reserved and peak are this process's (in a script, call "
            "nostall.cuda.memory_report() to see your own). Without CUDA, the host alone."
        ),
    )
    memory.add_argument("--json", action="store_true", help="print JSON instead of lines")

    doctor = commands.add_parser(
        "doctor",
        help="diagnose your own loader and find a faster way to feed it",
        description=(
            "Import FACTORY (MODULE:FUNCTION, a function that builds your DataLoader and accepts "
            "num_workers, pin_memory, prefetch_factor and persistent_workers overrides where it "
            "can), optionally your training step (--step MODULE:FUNCTION, called with a batch "
            "on the device), and measure: the loader alone, the step alone, both together; "
            "then search loader settings with and without nostall.prefetch within the CPU and "
            "memory budgets, and say what to change."
        ),
        epilog=_EXIT_STATUS,
    )
    doctor.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="the function that builds your loader, e.g. train:make_loader",
    )
    doctor.add_argument(
        "--step",
        metavar="MODULE:FUNC",
        help="your training step, called as FUNC(batch) on the device",
    )
    doctor.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: CUDA when available, else cpu)",
    )
    doctor.add_argument(
        "--max-batches",
        type=_count,
        default=300,
        help="the most batches the settings search may pull (default: %(default)s)",
    )
    doctor.add_argument(
        "--transform",
        metavar="MODULE:NAME",
        help="what your pipeline applies to each batch on the device, as "
        "nostall.prefetch(loader, transform=NAME) does: measured with it",
    )
    doctor.add_argument(
        "--repeats",
        type=_count,
        default=3,
        help="runs of each compared setting; a speed-up is claimed only beyond their spread "
        "(default: %(default)s)",
    )
    doctor.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    doctor.add_argument(
        "--html", metavar="PATH", help="write a self-contained HTML report with a chart to PATH"
    )
    doctor.add_argument("--no-progress", action="store_true", help="no progress bar")

    tune = commands.add_parser(
        "tune",
        help="find the fastest loader settings for your loader (nostall.tune)",
        description=(
            "Import FACTORY (MODULE:FUNCTION, a function that builds your DataLoader and accepts "
            "num_workers, pin_memory, prefetch_factor and persistent_workers overrides where it "
            "can) and search num_workers, loading threads and nostall.prefetch's depth within "
            "the CPU and memory budgets; the leading settings and your loop as built are then "
            "measured again, in turns. Prints the best setting as code to paste, and its "
            "samples/s with their range beside your loop's."
        ),
        epilog=_EXIT_STATUS,
    )
    tune.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="the function that builds your loader, e.g. train:make_loader",
    )
    tune.add_argument(
        "--step", metavar="MODULE:FUNC", help="your training step, called as FUNC(batch)"
    )
    tune.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available)"
    )
    tune.add_argument(
        "--max-batches",
        type=_count,
        default=300,
        help="the most batches the search may pull, its runs measured again included "
        "(default: %(default)s)",
    )
    tune.add_argument(
        "--transform",
        metavar="MODULE:NAME",
        help="what your pipeline applies to each batch on the device (measured with it)",
    )
    tune.add_argument(
        "--repeats",
        type=_count,
        default=3,
        help="runs of the leading settings and of your loop measured again (default: "
        "%(default)s; 1: none, and no speed-up can be told)",
    )
    tune.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nostall`` command; returns the exit status (2 for bad usage).

    Only a :class:`ConfigurationError` is reported as bad usage; every other exception
    propagates unchanged (see the module docstring).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "bench": _bench,
        "doctor": _doctor,
        "devices": _devices,
        "memory": _memory,
        "tune": _tune,
    }
    try:
        return commands[args.command](args)
    except ConfigurationError as e:
        print(f"nostall {args.command}: error: {e}", file=sys.stderr)
        return 2


def _device(device: str | None) -> torch.device:
    """``--device``, checked before any measuring: one that names nothing here is bad usage.

    Resolved here, at the command line, rather than where the library resolves it again: a
    device error raised later (by the user's own code, say) is not the user's ``--device``.
    """
    import re

    from .._device import resolve_data_device

    try:
        return resolve_data_device(device)
    except (TypeError, ValueError, DeviceUnavailableError) as e:
        # The library's words name its argument (device='cuda:1'); here the flag was typed.
        said = re.sub(r"device='([^']*)'", r"--device \1", str(e))
        said = said.replace("device=None to pick the best one", "no --device to pick the best one")
        raise ConfigurationError(said) from e


def _devices(args: argparse.Namespace) -> int:
    import json

    from ..cuda._devices import devices, format_devices, host_info

    found, host = devices(), host_info()
    if args.json:
        print(json.dumps({"host": host, "devices": [d.to_dict() for d in found]}, indent=2))
    else:
        print(format_devices(found, host))
    return 0


def _memory(args: argparse.Namespace) -> int:
    import json

    import torch

    from ..cuda._devices import memory_report

    names = (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    reports = [memory_report(name) for name in [*names, "cpu"]]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(r.summary() for r in reports))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose
    from .doctor_report import check_output, write_reports
    from .specs import load_callable

    for path, flag in ((args.json, "--json"), (args.html, "--html")):
        check_output(path, flag)  # before minutes of measuring, not after
    device = _device(args.device)
    factory = load_callable(args.factory, "the loader factory")
    step = load_callable(args.step, "--step") if args.step else None
    transform = load_callable(args.transform, "--transform") if args.transform else None
    with _progress_bar(args.no_progress) as progress:
        # Not wrapped: what the user's factory, dataset, transform or step raises here keeps
        # its traceback. A factory that builds no iterable, or an empty loader, is a
        # ConfigurationError, reported by main() in one line.
        diagnosis = diagnose(
            factory,
            step=step,
            device=device,
            max_batches=args.max_batches,
            repeats=args.repeats,
            transform=transform,
            progress=progress,
        )
    print(diagnosis.summary())
    write_reports(diagnosis, args.json, args.html)
    for path in (args.json, args.html):
        if path:
            print(f"wrote {path}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .doctor import load_average, tune_summary
    from .doctor_report import check_output
    from .specs import checked_factory, load_callable
    from .tune import tune

    check_output(args.json, "--json")  # before minutes of measuring, not after
    device = _device(args.device)
    factory = load_callable(args.factory, "the loader factory")
    step = load_callable(args.step, "--step") if args.step else None
    transform = load_callable(args.transform, "--transform") if args.transform else None
    total = args.max_batches
    start = load_average()
    with _progress_bar(args.no_progress) as progress:
        # Not wrapped: what the user's own code raises keeps its traceback (see main()).
        result = tune(
            checked_factory(factory),
            max_batches=args.max_batches,
            device=device,
            step=step,
            transform=transform,
            repeats=args.repeats,
            on_trial=lambda s, rate, spent: progress(
                f"{s.describe()}: {rate:,.0f} samples/s", min(spent / total, 1.0)
            ),
        )
    end = load_average()
    print(tune_summary(result, factory, device, transform, (start, end)))
    if args.json:
        figures = {**result.to_dict(), "load_average": {"start": start, "end": end}}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..bench import checks, format_report, run_bench, write_json, write_plot
    from ..bench._config import from_flags
    from .doctor_report import check_output

    if args.plot:  # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "--plot needs matplotlib: pip install 'nostall[plot]'"
            ) from None
    for path, flag in ((args.json, "--json"), (args.plot, "--plot")):
        check_output(path, flag)
    _device(args.device)  # checked now; the config keeps what was typed (--json shows it)
    # The options argparse let through but the bench refuses are bad usage; nothing else is:
    # what run_bench raises below is a failure, shown with its traceback.
    try:
        config = from_flags(args)
    except (TypeError, ValueError) as e:
        raise ConfigurationError(str(e)) from e
    with _progress_bar(args.no_progress) as progress:
        result = run_bench(config, progress)
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    if not args.check:
        return 0
    found = checks(result)
    for c in found:
        mark = "not judged" if c.held is None else "held" if c.held else "FAILED"
        print(f"[{mark}] {c.claim}: {c.evidence}")
    if any(c.held is False for c in found):
        return 1
    # A busy machine leaves the claims unjudged: neither a pass nor a failure.
    return 3 if any(c.held is None for c in found) else 0


@contextlib.contextmanager
def _progress_bar(disabled: bool) -> Iterator[Callable[[str, float], None]]:
    """A rich progress bar on standard error, off when asked or when it is not a terminal.

    Yields ``progress(what, fraction_done)``.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=disabled or not sys.stderr.isatty(),
    )
    with bar:
        task = bar.add_task("starting", total=1.0)
        yield lambda what, done: bar.update(task, description=what, completed=done)
