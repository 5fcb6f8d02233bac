"""The GPU-regime trial: a launching, device-waiting step, every contender's E and costs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_BENCH, bench_result, wait_for_no_nostall_threads
from torch.utils.data import TensorDataset

from nostall.bench import BenchConfig, format_report, run_bench
from nostall.bench import _contenders as c
from nostall.bench._regime import HEADROOM, device_seconds, launch_seconds
from nostall.bench._report import conclusion
from nostall.bench._workloads import DeviceStep

pytest.importorskip("PIL")
METRICS = ("efficiency", "samples_per_s", "stall", "memory_mib", "launch_slowdown")


def test_tiny_run_measures_every_gpu_regime_contender(tmp_path: Path) -> None:
    """Each listed contender: E, samples/s, waiting, memory and launch slowdown per repeat."""
    config = BenchConfig(
        **{**TINY_BENCH, "ratios": (1.0,), "jpeg_images": 4, "batches": 2},
        jpeg_cache=str(tmp_path),
        device_ms=2.0,
    )
    result = run_bench(config)
    names = [k.name for k in c.chosen((), torch.device("cpu"), c.GPU_REGIME)]
    assert names == result.contenders("gpu regime")
    assert ["2.0 ms"] == result.settings("gpu regime")
    for name in names:
        for metric in METRICS:
            stat = result.stat("gpu regime", "2.0 ms", name, metric)
            assert stat is not None, (name, metric)
            assert 2 == stat.n, (name, metric)
        e = result.stat("gpu regime", "2.0 ms", name, "efficiency")
        assert e is not None
        assert e.low >= 1.0  # no epoch beats the device: each step waits out its device time
        first = result.stat("gpu regime", "2.0 ms", name, "first_batch_ms")
        assert first is not None
        assert 1 == first.n
    assert [] == wait_for_no_nostall_threads()


def test_the_gpu_regime_can_be_left_out() -> None:
    """--regime-batches 0 runs no GPU-regime trial."""
    config = BenchConfig(**{**TINY_BENCH, "jpeg_images": 0, "ratios": (1.0,), "regime_batches": 0})
    assert [] == run_bench(config).settings("gpu regime")


def regime(e: dict[str, list[float]]) -> dict[tuple[str, str, str, str], list[float]]:
    """GPU-regime records: E per contender, launch slowdowns, the launch alone."""
    values: dict[tuple[str, str, str, str], list[float]] = {
        ("step", "gpu regime", "launch alone", "ms"): [2.0, 2.1]
    }
    for name, runs in e.items():
        values[("gpu regime", "8.0 ms", name, "efficiency")] = runs
        values[("gpu regime", "8.0 ms", name, "launch_slowdown")] = [1.1, 1.2]
        values[("gpu regime", "8.0 ms", name, "first_batch_ms")] = [40.0]
    return values


def test_the_report_leads_with_the_gpu_regime_table() -> None:
    """The GPU-regime table comes first, with E, memory and launch slowdown columns."""
    result = bench_result(regime({"serial DataLoader": [2.5, 2.6], "nostall": [1.02, 1.04]}))
    text = format_report(result)
    assert text.index("GPU regime") < text.index("hand-off cost")
    for head in ("E", "samples/s", "waiting", "first batch ms", "memory added MiB"):
        assert head in text
    assert "40 (n=1)" in text  # the first batch is one cold start


def test_the_closest_to_the_limit_is_named_only_when_clear() -> None:
    """A clear lead is named with its E; overlapping spreads are tied."""
    clear = conclusion(bench_result(regime({"serial DataLoader": [2.5, 2.6], "nostall": [1.0]})))
    assert "nostall came closest to the limit: its epochs took 1.00 (n=1) times" in clear[0]
    tied = regime({"best-practice DataLoader": [1.05, 1.2], "nostall threads=2": [1.1, 1.3]})
    assert "tied within the spread" in conclusion(bench_result(tied))[0]


def test_launch_slowdown_beside_threads_and_workers_is_stated() -> None:
    """The launch phase's slowdown with loading threads is set beside worker processes'."""
    e = {"best-practice DataLoader": [1.1, 1.2], "nostall threads=2": [1.0, 1.1]}
    said = " ".join(conclusion(bench_result(regime(e))))
    assert "1.15 (1.10-1.20)x its time alone with nostall threads=2" in said
    assert "with worker processes 1.15 (1.10-1.20)x (best-practice DataLoader)" in said


def test_the_launch_alone_is_timed_in_whole_steps_as_in_an_epoch() -> None:
    """Alone, the launch is timed between device waits, the rhythm it has in an epoch."""
    import time

    step = DeviceStep(launch_ops=5, device_s=0.02)
    batch = (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))
    start = time.perf_counter()
    launched = launch_seconds(step, batch, runs=3)
    assert time.perf_counter() - start >= 4 * 0.02  # one untimed step, three timed, each waited
    assert 0 < launched


def test_the_device_time_is_never_under_the_launch_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many cores divide the loading, never the launch: else no contender could reach E = 1."""
    import nostall.bench._regime as regime

    monkeypatch.setattr(regime, "launch_seconds", lambda step, batch: 0.012)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    dataset = TensorDataset(torch.zeros(12, 3, 8, 8, dtype=torch.uint8), torch.zeros(12))
    device_s = device_seconds(dataset, 4, DeviceStep(launch_ops=1))
    assert device_s == pytest.approx(HEADROOM * 0.012)
