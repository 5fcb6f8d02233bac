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
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from ._arguments import flag_count as _count
from ._arguments import flag_list as _list_of
from ._arguments import flag_number as _number
from ._arguments import flag_positive as _positive
from ._exceptions import ConfigurationError, DeviceUnavailableError

if TYPE_CHECKING:
    import torch

_EXIT_STATUS = (
    "exit status: 0 done; 2 bad usage (a flag, a MODULE:FUNC that cannot be loaded, a device "
    "that is not here); an exception raised by your own code is shown with its traceback (1)"
)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the ``nostall`` command."""
    from .bench import BenchConfig

    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        prog="nostall",
        description="Keep the GPU fed: find and remove input-pipeline stalls in PyTorch training.",
        epilog=_EXIT_STATUS,
    )
    parser.add_argument("--version", action="version", version=f"nostall {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser(
        "bench",
        help="run one workload through the usual ways to load data and through nostall",
        description=(
            "Train a small convnet on synthetic uint8 images whose loading costs a set multiple "
            "of the step's time (the load/compute ratio), through each contender: the serial "
            "DataLoader, the best-practice DataLoader (workers, pin_memory, persistent_workers), "
            "the seed design (thread + Queue(2)), installed peers (torchdata.nodes, "
            "prefetch_generator), on GPU a timm-style lookahead, and nostall.prefetch. "
            "Contenders alternate; medians of --repeats. Prints a table per ratio with the "
            "winner, hand-off overhead, on CUDA host-to-device GB/s, and the targets."
        ),
    )
    bench.add_argument(
        "--batches",
        type=_count,
        default=defaults.batches,
        help="batches per epoch (default: %(default)s)",
    )
    bench.add_argument(
        "--batch-size",
        type=_count,
        default=defaults.batch_size,
        help="images per batch (default: %(default)s)",
    )
    bench.add_argument(
        "--image-size",
        type=_count,
        default=defaults.image_size,
        help="image height and width in pixels (default: %(default)s)",
    )
    bench.add_argument(
        "--width",
        type=_count,
        default=defaults.width,
        help="convnet width, which scales the step's cost (default: %(default)s)",
    )
    bench.add_argument(
        "--ratios",
        type=_list_of(_positive),
        default=defaults.ratios,
        metavar="R,R,...",
        help="load/compute ratios to sweep: loading a batch costs R times the "
        "step (default: 0.25,0.5,1,2,4)",
    )
    bench.add_argument(
        "--depths",
        type=_list_of(_count),
        default=defaults.depths,
        metavar="D,D,...",
        help="nostall prefetch depths to sweep (default: 2)",
    )
    bench.add_argument(
        "--io-share",
        type=_number(float, 0, strict=False),
        default=defaults.io_share,
        help="share of each sample's loading cost spent waiting (I/O-like "
        "sleep) rather than computing (hashing, like decoding); 0 to 1 "
        "(default: %(default)s)",
    )
    bench.add_argument(
        "--workers",
        type=_count,
        default=None,
        help="DataLoader workers for the best-practice loader (default: the "
        "cores left after the step's threads, at most 8)",
    )
    bench.add_argument(
        "--compute-threads",
        type=_count,
        default=None,
        help="torch threads for the step on CPU (default: half the cores)",
    )
    bench.add_argument(
        "--repeats",
        type=_count,
        default=defaults.repeats,
        help="repeats of every measurement (default: %(default)s)",
    )
    bench.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: CUDA when available, else cpu)",
    )
    bench.add_argument(
        "--contenders",
        type=lambda s: tuple(p.strip() for p in s.split(",")),
        default=(),
        metavar="NAME,...",
        help="run only these contenders (default: all that can run here)",
    )
    bench.add_argument(
        "--handoff-batches",
        type=_count,
        default=defaults.handoff_batches,
        help="batches in the hand-off overhead test (default: %(default)s)",
    )
    bench.add_argument(
        "--h2d-mb",
        type=_list_of(_positive),
        default=defaults.h2d_mb,
        metavar="MB,MB,...",
        help="batch sizes for the host-to-device test on CUDA (default: 8,32,128)",
    )
    bench.add_argument(
        "--epochs",
        type=_number(int, 0, strict=False),
        default=defaults.epochs,
        help="epochs in the epoch-boundary test, 0 to skip it (default: %(default)s)",
    )
    bench.add_argument(
        "--epochs-ratio",
        type=_positive,
        default=defaults.epochs_ratio,
        help="load/compute ratio of the epoch-boundary test (default: "
        "%(default)s: a loader with time to spare, so that what a boundary "
        "costs is not hidden by, nor mistaken for, a slow loader)",
    )
    bench.add_argument(
        "--gpu-transforms",
        action="store_true",
        help="also compare normalising images in the loader (CPU) with "
        "normalising them on the device (nostall.transforms): loader "
        "workers each needs, bytes moved per sample",
    )
    bench.add_argument(
        "--transform-image-size",
        type=_count,
        default=defaults.transform_image_size,
        help="image size of the --gpu-transforms test (default: %(default)s)",
    )
    bench.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
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
    from ._device import resolve_device

    try:
        return resolve_device(device)
    except (TypeError, ValueError, DeviceUnavailableError) as e:
        raise ConfigurationError(str(e)) from e


def _devices(args: argparse.Namespace) -> int:
    import json

    from ._devices import devices, format_devices, host_info

    found, host = devices(), host_info()
    if args.json:
        print(json.dumps({"host": host, "devices": [d.to_dict() for d in found]}, indent=2))
    else:
        print(format_devices(found, host))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ._doctor import check_output, diagnose, write_reports
    from ._specs import load_callable

    for path, flag in ((args.json, "--json"), (args.html, "--html")):
        check_output(path, flag)  # before minutes of measuring, not after
    device = _device(args.device)
    factory = load_callable(args.factory, "the loader factory")
    step = load_callable(args.step, "--step") if args.step else None
    transform = load_callable(args.transform, "--transform") if args.transform else None
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=args.no_progress or not sys.stderr.isatty(),
    )
    with bar:
        task = bar.add_task("starting", total=1.0)

        def progress(phase: str, done: float) -> None:
            bar.update(task, description=phase, completed=done)

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


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, format_report, run_bench, write_json, write_plot

    if args.plot:  # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "--plot needs matplotlib: pip install 'nostall[plot]'"
            ) from None
    _device(args.device)  # checked now; the config keeps what was typed (--json shows it)
    # The options argparse let through but the bench refuses are bad usage; nothing else is:
    # what run_bench raises below is a failure, shown with its traceback.
    try:
        config = BenchConfig(
            batches=args.batches,
            batch_size=args.batch_size,
            image_size=args.image_size,
            width=args.width,
            ratios=args.ratios,
            depths=args.depths,
            io_share=args.io_share,
            workers=args.workers,
            compute_threads=args.compute_threads,
            repeats=args.repeats,
            device=args.device,
            contenders=args.contenders,
            handoff_batches=args.handoff_batches,
            h2d_mb=args.h2d_mb,
            epochs=args.epochs,
            epochs_ratio=args.epochs_ratio,
            gpu_transforms=args.gpu_transforms,
            transform_image_size=args.transform_image_size,
            progress=not args.no_progress,
        )
    except (TypeError, ValueError) as e:
        raise ConfigurationError(str(e)) from e
    result = run_bench(config)
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
