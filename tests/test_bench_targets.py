"""The targets, met and not met, from hand-made measurements."""

from __future__ import annotations

from test_bench_figures import result_with

from nostall.bench._targets import targets


def test_targets_met() -> None:
    """Good figures meet the E, stall and hand-off targets."""
    checks = {t.name: t for t in targets(result_with(nostall_epoch=1.02, nostall_wait=0.01))}
    assert checks["nostall: E <= 1.05 (<= 1.10 at ratio 1)"].met
    assert checks["nostall: stall <= 5% where load <= 0.9 x compute"].met
    assert checks["hand-off <= 0.6 x the best peer's"].met  # 10 us vs 30 us


def test_targets_not_met() -> None:
    """A slow, stalling nostall fails the E and stall targets."""
    checks = {t.name: t for t in targets(result_with(nostall_epoch=1.2, nostall_wait=0.2))}
    assert not checks["nostall: E <= 1.05 (<= 1.10 at ratio 1)"].met
    assert not checks["nostall: stall <= 5% where load <= 0.9 x compute"].met


def test_epoch_boundary_target() -> None:
    """The across_epochs target reads the boundary interval over the steady one."""
    result = result_with(1.02, 0.01)
    result.epoch_intervals = {
        "DataLoader, workers restarted": [[0.9, 0.01, 0.01], [0.05, 0.01, 0.01]],
        "nostall across_epochs": [[0.9, 0.01, 0.01], [0.012, 0.01, 0.01]],
    }
    checks = {t.name: t for t in targets(result)}
    assert checks["epoch boundary <= 1.5 x the steady batch interval (across_epochs)"].met


def test_workers_target() -> None:
    """2x fewer workers on the device meets it; fewer than 2x does not."""
    result = result_with(1.02, 0.01)
    result.transforms = {
        "image_size": 8,
        "compute_samples_per_s": 1000.0,
        "bytes_per_sample": {"cpu": 768, "device": 192},
        "rates": {"cpu": {0: 300.0, 1: 600.0, 2: 960.0}, "device": {0: 500.0, 1: 990.0}},
    }
    checks = {t.name: t for t in targets(result)}
    assert checks["device-side normalising needs at least 2x fewer loader workers"].met
    result.transforms["rates"]["device"] = {0: 500.0, 1: 700.0, 2: 990.0}
    checks = {t.name: t for t in targets(result)}
    assert not checks["device-side normalising needs at least 2x fewer loader workers"].met


def test_workers_target_when_a_way_never_keeps_up() -> None:
    """Never fed with 2 workers means at least 3; the same-numbers target."""
    result = result_with(1.02, 0.01)
    name = "device-side normalising needs at least 2x fewer loader workers"
    result.transforms = {
        "image_size": 8,
        "compute_samples_per_s": 1000.0,
        "bytes_per_sample": {"cpu": 768, "device": 192},
        "loader_ms_per_sample": {"cpu": 2.5, "device": 0.9},
        "device_ms_per_sample": {"cpu": 0.0, "device": 0.01},
        "max_abs_diff": 2e-7,
        "rates": {"cpu": {0: 300.0, 1: 500.0, 2: 700.0}, "device": {0: 600.0, 1: 990.0}},
    }
    checks = {t.name: t for t in targets(result)}
    assert checks[name].met  # at least 3 vs 1
    assert "CPU-side > 2, device-side 1" in checks[name].detail
    same = "device-side normalising gives the CPU-side numbers (max |diff| <= 1e-05)"
    assert checks[same].met
    result.transforms["rates"]["device"] = {0: 600.0, 1: 700.0, 2: 990.0}
    assert not {t.name: t for t in targets(result)}[name].met  # at least 3 vs 2
    result.transforms["rates"]["device"] = {0: 600.0, 1: 700.0, 2: 800.0}
    result.transforms["rates"]["cpu"][2] = 990.0
    assert not {t.name: t for t in targets(result)}[name].met  # only the CPU side kept up
    result.transforms["max_abs_diff"] = 0.01
    assert not {t.name: t for t in targets(result)}[same].met
