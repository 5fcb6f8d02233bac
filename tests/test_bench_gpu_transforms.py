"""The ``--gpu-transforms`` trial: normalising in the loader against on the device, on the CPU."""

from __future__ import annotations

from test_bench_runner import TINY

from nostall.bench import BenchConfig, format_report, run_bench
from nostall.bench._figures import workers_needed
from nostall.bench._gpu_transforms import TRANSFORM_WAYS


def test_gpu_transforms_test_measures_both_ways() -> None:
    """--gpu-transforms: samples/s per worker count for each way, bytes per sample."""
    config = BenchConfig(
        ratios=(1.0,), contenders=("nostall",), gpu_transforms=True, transform_image_size=16, **TINY
    )  # type: ignore[arg-type]
    result = run_bench(config)
    info = result.transforms
    assert set(TRANSFORM_WAYS) == set(info["rates"])
    for rates in info["rates"].values():
        assert 0 in rates
        assert all(r > 0 for r in rates.values())
    assert (
        info["bytes_per_sample"][TRANSFORM_WAYS[0]]
        == 4 * info["bytes_per_sample"][TRANSFORM_WAYS[1]]
    )
    assert set(TRANSFORM_WAYS) == set(workers_needed(result))
    for way in TRANSFORM_WAYS:
        assert info["loader_ms_per_sample"][way] > 0
    assert 0 == info["device_ms_per_sample"][TRANSFORM_WAYS[0]]
    assert info["device_ms_per_sample"][TRANSFORM_WAYS[1]] > 0
    assert 0 <= info["max_abs_diff"] <= 1e-5  # the same numbers either way
    report = format_report(result)
    assert "normalising on the CPU" in report
    assert "same numbers" in report
