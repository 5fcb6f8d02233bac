"""The GIL convoy: the hand-off's cost per batch when both threads make GIL-free calls.

The CPU stand-in for a GPU's per-batch cost (see ``nostall.bench._convoy``): the source and
the step each make K calls per batch into C that busy-wait with the GIL released, as torch's
CUDA calls do. Every hot-path change is measured on it, against the checkout before it::

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/convoy.py --realtime --against /tmp/before/src --rounds 3

``--against`` runs this checkout and the other one in turn, each round a fresh process of each,
with this file's benchmark code (the other checkout's nostall is what is measured), and prints
both side by side: median (min-max) over every epoch of every round. As root, ``--realtime``
keeps the threads on the cores of a shared machine (``SCHED_FIFO`` 10).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
OURS = HERE.parent / "src"
CONVOY_FILE = OURS / "nostall" / "bench" / "_convoy.py"


def convoy_module() -> ModuleType:
    """``nostall.bench._convoy`` from this checkout, inside whichever nostall is imported.

    Loaded by path as a module of the imported ``nostall.bench``, so that its relative imports
    (``nostall.prefetch``) resolve to the checkout under test, also one without this module.
    """
    importlib.import_module("nostall.bench")  # the package its relative imports resolve in
    name = "nostall.bench._convoy"
    spec = importlib.util.spec_from_file_location(name, CONVOY_FILE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_case(text: str) -> tuple[float, float, int]:
    """``SOURCE_US,STEP_US,K``."""
    try:
        source_us, step_us, k = text.split(",")
        return float(source_us), float(step_us), int(k)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected SOURCE_US,STEP_US,K, got {text!r}") from e


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the convoy in this process; its figures as JSON-ready data (and print the table)."""
    convoy = convoy_module()
    cases = [convoy.Case(*c) for c in args.case] if args.case else convoy.CASES
    names = [n for n in args.contenders.split(",") if n]
    result = convoy.run_convoy(
        cases,
        batches=args.batches,
        epochs=args.epochs,
        threads=args.threads,
        names=names,
        realtime=args.realtime,
        progress=lambda what: print(what, file=sys.stderr, flush=True),
    )
    print(convoy.format_table(result))
    rows = [
        {
            "source_us": c.source_us,
            "step_us": c.step_us,
            "k": c.k,
            "contender": name,
            "us": us,
            "switches": result.switches[c][name],
        }
        for c, timings in result.us.items()
        for name, us in timings.items()
    ]
    meta = {k: getattr(result, k) for k in ("spin", "threads", "realtime", "batches")}
    return {**meta, "load_average": result.load_average, "rows": rows}


def against(args: argparse.Namespace) -> None:
    """Alternate this checkout and ``args.against`` for ``args.rounds`` rounds; compare."""
    passed = ["--batches", str(args.batches), "--epochs", str(args.epochs)]
    passed += ["--threads", str(args.threads), "--contenders", args.contenders]
    passed += ["--realtime"] if args.realtime else []
    for source_us, step_us, k in args.case or ():
        passed += ["--case", f"{source_us},{step_us},{k}"]
    checkouts = {"this": str(OURS), "other": str(Path(args.against).resolve())}
    figures: dict[str, list[dict[str, Any]]] = {"this": [], "other": []}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for who, src in checkouts.items():
                out = Path(tmp) / f"{who}-{round_}.json"
                env = {**os.environ, "PYTHONPATH": src}
                command = [sys.executable, __file__, *passed, "--json", str(out)]
                subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
                figures[who].append(json.loads(out.read_text()))
                print(f"round {round_ + 1}/{args.rounds}: {who} done", file=sys.stderr)
    loads.append(os.getloadavg()[0])
    merged: dict[tuple[float, float, int, str], dict[str, list[float]]] = {}
    for who, runs in figures.items():
        for data in runs:
            for row in data["rows"]:
                key = (row["source_us"], row["step_us"], row["k"], row["contender"])
                merged.setdefault(key, {}).setdefault(who, []).extend(row["us"])
    print(
        f"this checkout ({checkouts['this']}) against {checkouts['other']}: us per batch, "
        f"median (min-max) of {args.rounds} rounds x {args.epochs} epochs, rounds alternating; "
        f"load average {loads[0]:.2f} before, {loads[1]:.2f} after; real-time priority "
        f"{'asked' if args.realtime else 'not asked'}"
    )
    print("| source us | step us | K | contender | other | this | this / other |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (source_us, step_us, k, name), by in merged.items():
        this, other = by.get("this", []), by.get("other", [])
        if not this or not other:
            continue
        ratio = statistics.median(this) / statistics.median(other)
        print(
            f"| {source_us:g} | {step_us:g} | {k} | {name} | {_cell(other)} | {_cell(this)} | "
            f"{ratio:.2f} |"
        )


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table, write the JSON when asked; or compare two checkouts."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="loading threads of threads=N")
    parser.add_argument("--realtime", action="store_true", help="SCHED_FIFO 10 where allowed")
    parser.add_argument("--case", type=parse_case, action="append", help="SOURCE_US,STEP_US,K")
    parser.add_argument("--contenders", default="", help="comma-separated names (default: all)")
    parser.add_argument("--json", help="write the figures there")
    parser.add_argument("--against", help="another checkout's src folder, to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --against")
    args = parser.parse_args(argv)
    if args.against:
        against(args)
        return 0
    data = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
