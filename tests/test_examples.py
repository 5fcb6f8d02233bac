"""The examples stay runnable."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import doc_blocks
import pytest
import torch
from doc_blocks import pages, python_blocks
from helpers import assert_torchrun_finished, run_torchrun

from nostall._tools.specs import load_callable

ROOT = Path(__file__).resolve().parent.parent


def test_slow_loader_example_builds_and_steps() -> None:
    """The doctor's example: its factory takes the overrides, its step trains on a batch."""
    make_loader = load_callable("examples.slow_loader:make_loader", "factory")
    train_step = load_callable("examples.slow_loader:train_step", "--step")
    loader = make_loader(num_workers=0, pin_memory=False)
    images, labels = next(iter(loader))
    assert (32, 3, 32, 32) == tuple(images.shape)
    assert math.isfinite(train_step((images, labels)))


def run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def test_gil_threads_prints_its_timings() -> None:
    """The seed-000 experiment runs and reports each pairing (timings vary with the machine)."""
    done = run(["examples/gil_threads.py", "--loop", "200000", "--size", "200", "--products", "2"])
    assert 0 == done.returncode, done.stderr
    for start in (
        "python loop + numpy products in two threads",
        "python loop + torch products in two threads",
        "two python loops in two threads",
    ):
        assert any(line.startswith(start) for line in done.stdout.splitlines()), done.stdout


@pytest.mark.perf
def test_native_code_releases_the_gil() -> None:
    """What the example shows, checked robustly: Python runs while a thread is in a matmul.

    One large product runs in a thread while this thread counts. Had torch held the GIL through
    it, the count would stop for the whole product (a few percent of the rate alone at most);
    since it releases it, the count keeps a good share of its rate even on a loaded machine.
    """
    import threading
    import time

    import torch

    def count_for(seconds: float) -> int:
        end, counted = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            counted += 1
        return counted

    rate = count_for(0.05) / 0.05  # iterations per second alone
    a = torch.randn(2000, 2000)
    finished = threading.Event()

    def product() -> None:
        torch.set_num_threads(1)  # thread-local: one core for the product, one for this loop
        a @ a @ a
        finished.set()

    start = time.perf_counter()
    worker = threading.Thread(target=product)
    worker.start()
    counted = 0
    while not finished.is_set():
        counted += 1
        time.perf_counter()  # the same work per iteration as when calibrating
    elapsed = time.perf_counter() - start
    worker.join()
    assert counted > 0.2 * rate * elapsed, (counted, rate * elapsed)


def test_hogwild_trains_the_shared_model() -> None:
    """Two processes updating one shared model make it accurate."""
    done = run(["examples/hogwild.py", "--processes", "2", "--steps", "150"])
    assert 0 == done.returncode, done.stderr
    after = float(done.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert after > 0.85, done.stdout


def test_ddp_train_under_torchrun() -> None:
    """DDP + DistributedSampler + nostall.prefetch under torchrun, gloo on the CPU."""
    done = run_torchrun("examples/ddp_train.py", "--epochs", "2", "--samples", "512", timeout=180)
    assert_torchrun_finished(done, ["rank 0: done", "rank 1: done"])
    for rank in (0, 1):
        assert f"rank {rank} epoch 1: mean loss" in done.stdout
    assert "slowest rank:" in done.stdout


def test_gpu_normalize_gives_the_same_batches() -> None:
    """The loop moved to device-side normalising matches the CPU-side one batch for batch."""
    done = run(
        [
            "examples/gpu_normalize.py",
            "--device",
            "cpu",
            "--batches",
            "4",
            "--batch-size",
            "8",
            "--size",
            "32",
            "--workers",
            "1",
        ]
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "largest difference between the two" in done.stdout
    assert "24,576 bytes/batch" in done.stdout  # 8 x 3 x 32 x 32 uint8, a quarter of float32


@pytest.mark.parametrize(
    ("page", "example"),
    [
        ("fabric.md", "fabric_train.py"),  # run by tests/test_fabric.py
        ("lightning.md", "lightning_train.py"),  # run by tests/test_lightning.py
        ("torchrun.md", "torchrun_resume.py"),  # run by tests/test_torchrun.py
    ],
)
def test_client_page_code_is_the_tested_example(page: str, example: str) -> None:
    """A docs/clients page's one python block is the example file, which the tests run."""
    text = (ROOT / "docs" / "clients" / page).read_text()
    blocks = [part.split("\n```", 1)[0] for part in text.split("```python\n")[1:]]
    assert [(ROOT / "examples" / example).read_text().rstrip("\n")] == blocks


def test_accelerate_page_ends_with_the_tested_example() -> None:
    """docs/clients/accelerate.md ends with the example file that tests/test_accelerate.py runs."""
    blocks = python_blocks(ROOT / "docs" / "clients" / "accelerate.md")
    assert (ROOT / "examples" / "accelerate_train.py").read_text().rstrip("\n") == blocks[-1]


BLOCKS = [
    (page.relative_to(ROOT).as_posix(), index)
    for page in pages()
    for index in range(len(python_blocks(page)))
]


def run_block(page: str, index: int, folder: Path, *flags: str) -> None:
    """Run the block with tests/doc_blocks.py in ``folder`` (empty), as a reader runs it."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "doc_blocks.py"), page, str(index), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "ran" == done.stdout.splitlines()[-1], done.stdout


# The blocks' num_workers=8 on a machine with fewer cores: torch's advice, printed to a reader.
@pytest.mark.filterwarnings("ignore:This DataLoader will create .* worker processes:UserWarning")
@pytest.mark.parametrize(("page", "index"), BLOCKS)
def test_doc_block_runs(
    page: str,
    index: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A python block of the README or a docs/ page runs, its "cuda" made "cpu".

    Run here, by tests/doc_blocks.py's ``main``, in ``tmp_path`` (empty): the block still sees
    only the names a reader's program gives it, each of them made afresh, and this process's
    torch generator is put back afterwards. (A process of its own per block cost an
    interpreter and torch's import each; the GPU runs below keep one.)
    """
    monkeypatch.chdir(tmp_path)
    with torch.random.fork_rng(devices=[]):  # the blocks' names come seeded
        doc_blocks.main([page, str(index)])
    assert "ran" == capsys.readouterr().out.splitlines()[-1]


@pytest.mark.cuda
@pytest.mark.parametrize(("page", "index"), BLOCKS)
def test_doc_block_runs_as_written_on_cuda(page: str, index: int, tmp_path: Path) -> None:
    """A python block of the README or a docs/ page runs as written, on the GPU."""
    run_block(page, index, tmp_path, "--as-written")


def test_readme_reads_in_five_minutes() -> None:
    """The README stays short: the details live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize(
    "page",
    [*pages(), *sorted((ROOT / "docs" / "clients").glob("*.md"))],
    ids=lambda page: page.relative_to(ROOT).as_posix(),
)
def test_doc_links_resolve(page: Path) -> None:
    """Every relative link of the README and the docs pages names a file, and a heading in it."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            broken.append(target)
    assert [] == broken


def test_the_readme_install_line_is_light() -> None:
    """nostall itself needs torch and rich alone; the README says how to install just that."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert {"torch", "rich"} == names
    readme = (ROOT / "README.md").read_text()
    assert "pip install ./nostall" in readme
    for extra in project["optional-dependencies"]:
        if extra != "dev":
            assert f"`[{extra}]`" in readme, extra
