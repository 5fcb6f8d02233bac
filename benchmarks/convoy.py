"""The GIL convoy: the hand-off's cost per batch when both threads make GIL-free calls.

The CPU stand-in for a GPU's per-batch cost (see ``nostall.bench._convoy``): the source and
the step each make K calls per batch into C that busy-wait with the GIL released, as torch's
CUDA calls do. Every hot-path change is measured on it.

Run (as root, ``--realtime`` keeps the threads on the cores of a shared machine)::

    .venv/bin/python benchmarks/convoy.py [--realtime] [--batches 3000] [--epochs 5]
    PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/convoy.py ...   # another checkout
"""

from __future__ import annotations

import argparse
import json
import sys

from nostall.bench._convoy import CASES, CONTENDERS, Case, format_table, run_convoy


def parse_case(text: str) -> Case:
    """``SOURCE_US,STEP_US,K``."""
    try:
        source_us, step_us, k = text.split(",")
        return Case(float(source_us), float(step_us), int(k))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected SOURCE_US,STEP_US,K, got {text!r}") from e


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table, write the JSON when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="loading threads of threads=N")
    parser.add_argument("--realtime", action="store_true", help="SCHED_FIFO 10 where allowed")
    parser.add_argument("--case", type=parse_case, action="append", help="SOURCE_US,STEP_US,K")
    parser.add_argument(
        "--contenders", default="", help=f"comma-separated, of: {[k.name for k in CONTENDERS]}"
    )
    parser.add_argument("--json", help="write the figures there")
    args = parser.parse_args(argv)
    names = [n for n in args.contenders.split(",") if n]
    result = run_convoy(
        args.case or CASES,
        batches=args.batches,
        epochs=args.epochs,
        threads=args.threads,
        names=names,
        realtime=args.realtime,
        progress=lambda what: print(what, file=sys.stderr, flush=True),
    )
    print(format_table(result))
    if args.json:
        rows = [
            {"source_us": c.source_us, "step_us": c.step_us, "k": c.k, "contender": name, "us": us}
            for c, timings in result.us.items()
            for name, us in timings.items()
        ]
        meta = {k: getattr(result, k) for k in ("spin", "threads", "realtime", "batches")}
        with open(args.json, "w") as f:
            json.dump({**meta, "load_average": result.load_average, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
