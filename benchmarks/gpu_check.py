"""One command for a GPU machine: the CUDA tests, the simulated suite and the GPU benchmarks.

Runs with the interpreter it is started with, from a checkout (``src`` on ``PYTHONPATH``): no
virtual environment is made and nothing is installed, so it works on an offline machine that
already has torch. Each step runs as a subprocess with a time limit; its output goes to
``steps.log`` in the output folder, its status to ``summary.json`` and ``summary.md``, the
bench's records and chart beside them. Steps that need a GPU are skipped without one, and the
run then exits 0 if everything it could run passed; it exits 1 when a step failed or ran out
of time.

Run: ``make gpu-check PYTHON=python3`` (``GPU_CHECK_OUT=folder`` to choose where the figures go)
or ``PYTHONPATH=src python3 benchmarks/gpu_check.py --out out/gpu-check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Test modules that run nostall's CUDA code on the simulated CUDA (tests/simcuda).
SIMULATED = (
    "tests/test_simcuda.py",
    "tests/test_transfer_simulated.py",
    "tests/test_staging.py",
    "tests/test_staging_cuda.py",
    "tests/test_device.py",
    "tests/test_transforms.py",
    "tests/test_decode_simulated.py",
)


#: The suite step's tests: make test's (not perf) less the CUDA tests, which cuda-tests runs.
SUITE_MARKERS = "not cuda and not perf"


@dataclasses.dataclass(frozen=True)
class Step:
    """One subprocess of the check: ``argv`` after the interpreter, and its time limit."""

    name: str
    argv: tuple[str, ...]
    limit_s: float
    needs_gpu: bool
    what: str


@dataclasses.dataclass
class Outcome:
    """What a step did: ``passed``, ``failed``, ``timed out`` or ``skipped`` (and why)."""

    name: str
    status: str
    seconds: float
    returncode: int | None
    what: str
    note: str = ""


def plan(out: Path, *, suite: bool, workers: int) -> list[Step]:
    """The steps, most telling first, so that a run cut short has measured what matters."""
    # pytest-benchmark, where installed, warns under xdist, and the suite's warnings are errors.
    pytest = ("-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark", "-q", "-rfE")
    steps = [
        Step(
            "cuda-tests",
            (*pytest, "-m", "cuda", "tests"),
            240,
            True,
            "the tests marked cuda: stream safety, memory, placement on a real GPU",
        ),
        Step(
            "h2d",
            ("benchmarks/h2d.py", "--mb", "8,32,128"),
            120,
            True,
            "host-to-device GB/s: nostall against raw pinned and pageable copies",
        ),
        Step(
            "gpu-transforms",
            ("benchmarks/gpu_transforms.py", "--device", "cuda"),
            120,
            True,
            "normalising on the GPU against on the CPU: equal numbers, loader time",
        ),
        Step(
            "gpu-decode",
            ("benchmarks/gpu_decode.py", "--json", str(out / "gpu-decode.json")),
            240,
            True,
            "JPEGs decoded by nvJPEG against the best-practice DataLoader: samples/s, cores",
        ),
        Step(
            "probes",
            ("benchmarks/cuda_probes.py",),
            120,
            True,
            "what the simulated CUDA reasons about, seen on a GPU: memory, capture, threads",
        ),
        Step(
            "bench-cuda",
            (
                "-m",
                "nostall",
                "bench",
                "--device",
                "cuda",
                "--no-progress",
                "--json",
                str(out / "bench-cuda.json"),
                "--plot",
                str(out / "bench-cuda.png"),
            ),
            240,
            True,
            "nostall bench on CUDA: every contender side by side",
        ),
        Step(
            "simulated",
            (*pytest, *SIMULATED),
            240,
            False,
            "the simulated-CUDA suite (runs everywhere)",
        ),
    ]
    if suite:
        parallel = ("-n", str(workers)) if workers > 1 and _has("xdist") else ()
        steps.append(
            Step(
                "suite",
                # The CUDA tests ran alone in cuda-tests: run beside other processes' work on
                # the same GPU they measure memory and races that are not theirs. A -m here
                # replaces the one in pyproject's addopts, so perf stays out explicitly.
                (*pytest, *parallel, "-m", SUITE_MARKERS, "tests"),
                420,
                True,  # without a GPU, `make test` is the command that runs it
                "make test's suite but the CUDA tests (cuda-tests ran them alone), on this "
                "machine: it must pass on a GPU machine too",
            )
        )
    return steps


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cuda_available() -> bool:
    """Whether torch sees a CUDA device, asked in a subprocess so this process stays light."""
    probe = "import torch; print(torch.cuda.is_available())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), check=False
    )
    return done.stdout.strip() == "True"


def describe() -> str:
    """The machine and its torch, as the first lines of the log."""
    probe = (
        "import torch\n"
        "print('torch', torch.__version__, 'cuda', torch.version.cuda)\n"
        "for i in range(torch.cuda.device_count()):\n"
        "    p = torch.cuda.get_device_properties(i)\n"
        "    print(f'cuda:{i}', p.name, f'{p.total_memory / 2**30:.0f} GiB')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), check=False
    )
    return (
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs\n"
        + done.stdout
        + done.stderr
    )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The checkout's package first: nothing need be installed.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_step(step: Step, log: Path) -> Outcome:
    """Run ``step``, appending its output to ``log``; never raises for the step's failure."""
    start = time.perf_counter()
    with log.open("a") as sink:
        sink.write(f"\n===== {step.name}: {step.what}\n$ python {' '.join(step.argv)}\n")
        sink.flush()
        try:
            done = subprocess.run(
                [sys.executable, *step.argv],
                cwd=ROOT,
                env=_env(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=step.limit_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            seconds = time.perf_counter() - start
            sink.write(f"\n===== {step.name}: timed out after {seconds:.0f} s\n")
            return Outcome(step.name, "timed out", seconds, None, step.what)
    seconds = time.perf_counter() - start
    status = "passed" if done.returncode == 0 else "failed"
    with log.open("a") as sink:
        sink.write(f"\n===== {step.name}: {status} (exit {done.returncode}, {seconds:.0f} s)\n")
    return Outcome(step.name, status, seconds, done.returncode, step.what)


def write_summary(out: Path, header: str, outcomes: list[Outcome]) -> None:
    """``summary.json`` for tools, ``summary.md`` for people."""
    (out / "summary.json").write_text(
        json.dumps(
            {"machine": header, "steps": [dataclasses.asdict(o) for o in outcomes]}, indent=2
        )
    )
    lines = ["# gpu-check", "", "```", header.strip(), "```", ""]
    lines += ["| step | status | seconds | what |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        status = o.status + (f" ({o.note})" if o.note else "")
        lines.append(f"| {o.name} | {status} | {o.seconds:.0f} | {o.what} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run every step that this machine can run; 1 if any of them failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check")
    parser.add_argument(
        "--only", default="", help="comma-separated step names to run (default: all)"
    )
    parser.add_argument(
        "--no-suite", action="store_true", help="leave out make test's suite (the longest step)"
    )
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="pytest-xdist workers"
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "steps.log"
    log.write_text("")
    header = describe()
    print(header, end="", flush=True)
    gpu = cuda_available()
    chosen = {n for n in args.only.split(",") if n}
    outcomes: list[Outcome] = []
    for step in plan(out, suite=not args.no_suite, workers=args.workers):
        if chosen and step.name not in chosen:
            continue
        if step.needs_gpu and not gpu:
            why = "no CUDA device" + ("; make test runs it here" if step.name == "suite" else "")
            outcomes.append(Outcome(step.name, "skipped", 0.0, None, step.what, why))
        else:
            print(f"{step.name}: {step.what} ...", flush=True)
            outcomes.append(run_step(step, log))
        o = outcomes[-1]
        print(
            f"{o.name}: {o.status}{f' ({o.note})' if o.note else ''}, {o.seconds:.0f} s", flush=True
        )
        write_summary(out, header, outcomes)  # after each step: a run cut short still says
    print(f"log: {log}\nsummary: {out / 'summary.md'}")
    return 0 if all(o.status in ("passed", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
