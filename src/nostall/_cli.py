"""The ``nostall`` command line. Each subcommand calls a library function usable from Python."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text})")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (got {text})")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the ``nostall`` command."""
    parser = argparse.ArgumentParser(
        prog="nostall",
        description="Keep the GPU fed: find and remove input-pipeline stalls in PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"nostall {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser(
        "bench",
        help="run a slow loader and a slow step serially and through nostall.prefetch",
        description=(
            "Side-by-side demo: a loader that takes --load-ms per batch and a step that computes "
            "for --step-ms per batch, run serially and through nostall.prefetch, alternating, "
            "--repeats times each. Prints the median epoch times and the speed-up."
        ),
    )
    bench.add_argument("--batches", type=_positive_int, default=40, help="batches per epoch")
    bench.add_argument("--batch-size", type=_positive_int, default=32, help="samples per batch")
    bench.add_argument(
        "--load-ms", type=_non_negative_float, default=25.0, help="loading time per batch (ms)"
    )
    bench.add_argument(
        "--step-ms", type=_non_negative_float, default=25.0, help="compute time per batch (ms)"
    )
    bench.add_argument("--depth", type=_positive_int, default=2, help="batches fetched ahead")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="runs of each way")
    bench.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N (default: CUDA when available)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nostall`` command; returns the exit status (2 for bad usage)."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from ._demo import format_demo, run_demo
        from ._exceptions import DeviceUnavailableError

        try:
            result = run_demo(
                batches=args.batches,
                load_ms=args.load_ms,
                step_ms=args.step_ms,
                batch_size=args.batch_size,
                depth=args.depth,
                repeats=args.repeats,
                device=args.device,
            )
        except (DeviceUnavailableError, ValueError) as e:
            print(f"nostall bench: error: {e}", file=sys.stderr)
            return 2
        print(format_demo(result))
    return 0
