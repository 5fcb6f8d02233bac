"""The study scripts in benchmarks/ run on the CPU, with tiny settings."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/SCRIPT ARGS``, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def run_here(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The script's ``main()`` with ``ARGS``, in this process: what :func:`run` gives, lighter.

    For scripts that start no process of their own and change nothing of the process but
    torch's intra-op thread count (put back): an interpreter and torch's import less, seconds
    each. Their warnings are printed, as in a process of their own (here they would be errors).
    """
    path = SCRIPTS / script
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    out, err = io.StringIO(), io.StringIO()
    argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [str(path), *args]
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        with (
            redirect_stdout(out),
            redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("default")
            try:
                code = module.main()
            except SystemExit as e:
                code = e.code
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    finally:
        sys.argv = argv
        sys.modules.pop(spec.name, None)
        torch.set_num_threads(threads)
    returncode = code if isinstance(code, int) else 0 if code is None else 1
    return subprocess.CompletedProcess(sys.argv, returncode, out.getvalue(), err.getvalue())


def test_gpu_transforms_agree_and_are_measured() -> None:
    """Both ways of normalising give the same numbers (exit 0) and a rate per worker count."""
    args = ("--batches", "2", "--batch-size", "4", "--image-size", "16")
    done = run_here("gpu_transforms.py", *args)
    assert 0 == done.returncode, done.stderr
    assert "device-side normalise" in done.stdout
    assert "largest difference between the two ways' first batches" in done.stdout


def test_gpu_decode_measures_both_ways(tmp_path: Path) -> None:
    """Samples/s and cores per 1,000 samples/s for the DataLoader and the decode on the device."""
    out = tmp_path / "decode.json"
    args = ["--ways", "dataloader:1,decode:0", "--images", "12", "--files", "4"]
    args += ["--batch-size", "4", "--size", "16", "--repeats", "1", "--json", str(out)]
    done = run("gpu_decode.py", *args, "--jpeg-cache", str(tmp_path / "jpeg"))
    assert 0 == done.returncode, done.stderr
    assert "cores per 1000/s" in done.stdout
    figures = json.loads(out.read_text())["ways"]
    assert set(figures) == {"dataloader:1", "decode:0"}
    assert all(w["samples_per_s"][0] > 0 and w["per_1000"] > 0 for w in figures.values())


def test_epoch_boundaries_measures_every_way() -> None:
    """The four ways of crossing an epoch boundary, each with its ratio to the steady interval."""
    done = run_here("epoch_boundaries.py", "--epochs", "2", "--batches", "3", "--batch-size", "4")
    assert 0 == done.returncode, done.stderr
    for way in ("workers restarted", "persistent workers", "nostall across_epochs"):
        assert way in done.stdout


def test_soak_runs_its_rounds_and_reports_growth(tmp_path: Path) -> None:
    """The soak's warm-up and one round, checked exact; its growth line and JSON."""
    out = tmp_path / "soak.json"
    done = run_here("soak.py", "--seconds", "0", "--json", str(out))
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "growth after warm-up" in done.stdout
    assert out.read_text().startswith("{")


def test_h2d_refuses_without_a_gpu() -> None:
    """Host-to-device rates need CUDA: without it, a clear line and exit status 1."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA suite measures it")
    done = run_here("h2d.py")
    assert 1 == done.returncode
    assert "needs a CUDA device" in done.stderr


def test_gpu_check_without_a_gpu_skips_what_needs_one(tmp_path: Path) -> None:
    """`make gpu-check` on a machine without CUDA: GPU steps skipped, exit 0, a summary."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: gpu-check runs those steps")
    done = run_here(
        "gpu_check.py", "--out", str(tmp_path), "--only", "cuda-tests,h2d,bench-cuda,suite"
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    summary = (tmp_path / "summary.md").read_text()
    for step in ("cuda-tests", "h2d", "bench-cuda", "suite"):
        assert f"| {step} | skipped (no CUDA device" in summary


def _gpu_check() -> Any:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPTS))
    return gpu_check


#: Collects with pytest.main once per selection (its arguments, one JSON list each on stdin),
#: all in one process, each selection's test ids after a line of its own.
_COLLECT = """
import json, sys
import pytest
for line in sys.stdin:
    print("== selection", flush=True)
    if pytest.main(["--collect-only", "-q", *json.loads(line)]) != 0:
        sys.exit(1)
    sys.stdout.flush()
"""


def _collected(*selections: tuple[str, ...]) -> list[set[str]]:
    """Each selection's test ids, as ``pytest --collect-only -q *selection`` lists them.

    One process collects them all, one pytest session each: a process per selection paid
    for an interpreter, torch and the module's import again.
    """
    # pytest-benchmark (on the GPU machine) warns, as an error here, when it finds xdist's
    # worker variables inherited from a parallel run: it exited 3 there.
    plugins = ["-p", "no:cacheprovider", "-p", "no:benchmark"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT],
        input="".join(json.dumps([*plugins, *args]) + "\n" for args in selections),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=SCRIPTS.parent,
    )
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    parts = done.stdout.split("== selection\n")[1:]
    assert len(selections) == len(parts), done.stdout[-3000:]
    return [{line for line in part.splitlines() if "::" in line} for part in parts]


def test_gpu_check_runs_make_tests_tests_once_with_the_cuda_ones_alone(tmp_path: Path) -> None:
    """cuda-tests and the suite together select make test's tests, each once.

    The CUDA tests run only in cuda-tests, with no other test process on the GPU; the suite's
    own -m replaces pyproject's "not perf", which must still hold.
    """
    steps = {s.name: s for s in _gpu_check().plan(tmp_path, suite=True, workers=8)}

    def markers(step: str) -> str:
        argv: list[str] = steps[step].argv
        return argv[argv.index("-m", 2) + 1]  # after "-m pytest"

    module = "tests/test_prefetcher.py"  # it has cuda and perf tests
    make_test, cuda, suite = _collected(
        (module,), ("-m", markers("cuda-tests"), module), ("-m", markers("suite"), module)
    )
    assert cuda
    assert suite
    assert set() == cuda & suite
    assert make_test == cuda | suite


def test_gpu_check_fails_when_a_step_fails(tmp_path: Path) -> None:
    """A step that fails makes the whole check exit 1, and the summary names it."""
    gpu_check = _gpu_check()
    step = gpu_check.Step("boom", ("-c", "raise SystemExit(3)"), 30, False, "exits 3")
    outcome = gpu_check.run_step(step, tmp_path / "steps.log")
    assert ("failed", 3) == (outcome.status, outcome.returncode)
    slow = gpu_check.Step("slow", ("-c", "import time; time.sleep(60)"), 0.5, False, "sleeps")
    assert "timed out" == gpu_check.run_step(slow, tmp_path / "steps.log").status


def test_threads_reads_a_stream_with_threads_and_workers() -> None:
    """The streaming JPEG shards: a row for each way asked for (threads, workers), no other."""
    args = ("--workload", "stream", "--batch-size", "4", "--batches", "4", "--repeats", "1")
    done = run("threads.py", *args, "--ways", "workers:2,nostall:2")
    assert 0 == done.returncode, done.stderr
    assert "nostall 2 threads" in done.stdout
    assert "DataLoader num_workers=2" in done.stdout
    assert "DataLoader serial" not in done.stdout  # only the ways asked for


def test_launch_pacing_measures_the_launch_slowdown_of_a_way() -> None:
    """GIL-free samples through threads=: a line per epoch, then the medians."""
    done = run_here(
        "launch_pacing.py",
        *("--sleep-ms", "1", "--batches", "3", "--batch-size", "2", "--epochs", "1"),
        *("--device-ms", "5", "--launch-ops", "10"),
    )
    assert 0 == done.returncode, done.stderr
    assert "epoch 0: launch alone" in done.stdout
    assert "threads 2, device 5 ms" in done.stdout


def test_convoy_times_each_way_and_compares_two_checkouts() -> None:
    """The GIL convoy on a tiny case; then this checkout against itself, rounds alternating."""
    tiny = ("--batches", "30", "--epochs", "1", "--case", "5,5,2")
    done = run_here("convoy.py", *tiny, "--contenders", "serial loop,nostall")
    assert 0 == done.returncode, done.stderr
    assert "GIL convoy" in done.stdout
    assert "nostall" in done.stdout
    src = str(SCRIPTS.parent / "src")
    done = run("convoy.py", *tiny, "--contenders", "nostall", "--against", src, "--rounds", "1")
    assert 0 == done.returncode, done.stderr
    assert "| 5 | 5 | 2 | nostall |" in done.stdout


def test_gpu_triage_runs_the_cpu_parts_without_a_gpu(tmp_path: Path) -> None:
    """No GPU: the hand-off on the CPU and the convoy, figures in the folder, exit 0."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-triage measures it")
    done = run("gpu_triage.py", "--out", str(tmp_path), "--quick")
    assert 0 == done.returncode, done.stdout + done.stderr
    report = (tmp_path / "triage.md").read_text()
    for part in ("## 2. The hand-off", "## 4. The GIL convoy", "## 5. py-spy"):
        assert part in report
    assert "nostall inline" in report


#: nostall's own Python calls per batch of two tensors on the simulated CUDA (torch's own
#: Python for its stream and device contexts), by who pulls: the most this path may make.
#: Every one holds the GIL between the two threads' GIL-free CUDA calls. They only shrink
#: (58 and 57 before the inline path and the one-pass staging, 31 and 34 before the steady
#: path was written out; the aim was 25 for both threads together). Measured 18.2 and
#: 19.2-20.0: the rest is what depends on the threads' timing (a wait in ``get``, the
#: overlap's probes), each at most one call a batch.
CALLS_PER_BATCH = {"producer": 20.0, "consumer": 22.0}
#: The modules one batch passes through (a call per batch or more), at most.
MODULES_PER_BATCH = 6


@pytest.mark.parametrize("path", sorted(CALLS_PER_BATCH))
def test_the_calls_per_batch_do_not_grow(path: str) -> None:
    """The hand-off's steady path, counted by benchmarks/handoff_calls.py: at most the ratchet.

    Calls and modules, producer and consumer threads together.
    """
    args = ("--torch-python", "--path", path, "--n1", "50", "--n2", "250", "--simulated")
    done = run("handoff_calls.py", *args)
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "calls per batch (simulated CUDA" in done.stdout
    assert f"pulls: {path})" in done.stdout
    for table in ("nostall's functions", "called by nostall, outside it", "torch.cuda's Python"):
        assert f"===== {table}: " in done.stdout  # torch's own contexts: --torch-python
    assert "_staging/cuda.py" in done.stdout
    found = re.search(r"nostall's functions: ([0-9.]+) per batch", done.stdout)
    assert found is not None, done.stdout
    assert float(found.group(1)) <= CALLS_PER_BATCH[path], done.stdout
    crossed = re.search(r"nostall's modules: (.*)", done.stdout)
    assert crossed is not None, done.stdout
    modules = crossed.group(1).split(", ")
    assert all(m.startswith("nostall/") for m in modules), modules
    assert len(modules) <= MODULES_PER_BATCH, done.stdout


def test_augmented_prefetch_loads_ahead_with_the_plain_loops_batches(tmp_path: Path) -> None:
    """Random crops and flips from torch's generator, a step that draws none: loaded ahead."""
    args = ("--batches", "4", "--batch-size", "2", "--size", "32", "--repeats", "1")
    done = run_here("augmented_prefetch.py", *args, "--step-ms", "5", "--jpeg-cache", str(tmp_path))
    assert 0 == done.returncode, done.stderr
    assert "nostall's watch ended 'apart'; the batches equal" in done.stdout
    assert "x the plain loop (per repeat" in done.stdout


def test_worker_draws_times_recording_against_none(tmp_path: Path) -> None:
    """What recording the workers' draws costs: each way timed, as a ratio to none."""
    args = ("--repeats", "1", "--jpeg-batches", "2", "--tiny-batches", "4", "--size", "32")
    done = run("worker_draws.py", *args, "--jpeg-cache", str(tmp_path))
    assert 0 == done.returncode, done.stderr
    assert 2 == done.stdout.count("nostall, unrecorded"), done.stdout
    assert "x the unrecorded time (per epoch" in done.stdout
