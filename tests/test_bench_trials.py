"""A tiny bench run on the CPU, in seconds: every trial records what it measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_BENCH, wait_for_no_nostall_threads

from nostall.bench import BenchConfig, _trials, run_bench
from nostall.bench import _contenders as c
from nostall.bench._workloads import train_step


def test_tiny_run_measures_every_contender_in_every_trial(tmp_path: Path) -> None:
    """Every contender at every ratio and on the JPEG files; the hand-off of every prefetcher."""
    threads = torch.get_num_threads()
    seen: list[float] = []
    config = BenchConfig(**TINY_BENCH, jpeg_cache=str(tmp_path))
    result = run_bench(config, lambda what, done: seen.append(done))
    names = [k.name for k in c.chosen((), torch.device("cpu"))]
    assert ["0.5", "1"] == result.settings("synthetic")
    assert ["32px", "32px crop+flip"] == result.settings("jpeg")
    for trial in ("synthetic", "jpeg"):
        # The decode on the device runs in the augmented JPEG trial only (it reads the files).
        decode = [c.DECODE.name] if trial == "jpeg" else []
        assert names + decode == result.contenders(trial)
        for setting in result.settings(trial):
            serial = result.stat(trial, setting, "serial DataLoader", "speedup")
            assert serial is not None
            assert 1.0 == serial.median
            if setting.endswith("crop+flip") is False:
                assert result.stat(trial, setting, c.DECODE.name, "samples_per_s") is None
            for name in names + (decode if setting.endswith("crop+flip") else []):
                for metric in ("samples_per_s", "stall", "speedup", "wait_removed"):
                    stat = result.stat(trial, setting, name, metric)
                    assert stat is not None, (trial, setting, name, metric)
                    assert 2 == stat.n, (trial, setting, name, metric)
                stall = result.stat(trial, setting, name, "stall")
                assert stall is not None
                assert 0 <= stall.low <= stall.high <= 1
    prefetchers = [k.name for k in c.chosen((), torch.device("cpu")) if k.prefetcher]
    assert ["serial DataLoader", *prefetchers] == result.contenders("handoff")
    assert ["gpu regime", "synthetic", "jpeg"] == result.settings("step")
    # The convoy: each case for the loop, the seed and nostall, one figure per epoch.
    assert ["20,20,1", "20,20,4", "20,20,8", "30,10,4", "5,50,4"] == result.settings("convoy")
    assert ["serial loop", "seed thread+Queue(2)", "nostall"] == result.contenders("convoy")
    convoy = result.stat("convoy", "20,20,4", "nostall", "us_per_batch")
    assert convoy is not None
    assert 3 == convoy.n
    assert convoy.low >= 20  # the step's 20 us alone: no batch can take less
    assert set(result.load_average) == {"start", "end"}
    assert result.seconds > 0
    assert seen == sorted(seen)
    assert 1.0 == seen[-1]
    assert threads == torch.get_num_threads()  # the compute-thread setting is restored
    assert [] == wait_for_no_nostall_threads()


def test_contenders_and_the_jpeg_trial_can_be_left_out() -> None:
    """--contenders picks; --jpeg-images 0 skips the JPEG files, --convoy-batches 0 the convoy."""
    only = {"jpeg_images": 0, "ratios": (1.0,), "contenders": ("nostall",), "convoy_batches": 0}
    config = BenchConfig(**{**TINY_BENCH, **only})
    result = run_bench(config)
    assert ["nostall"] == result.contenders("synthetic")
    assert [] == result.settings("jpeg")
    assert [] == result.settings("convoy")
    assert result.stat("synthetic", "1", "nostall", "speedup") is None  # no serial to compare


@pytest.mark.perf
def test_equal_load_and_compute_take_close_to_half_the_serial_time() -> None:
    """GIL-releasing loading as long as the step: nostall needs far less than the serial sum."""
    config = BenchConfig(
        **{**TINY_BENCH, "batches": 16, "width": 16, "image_size": 32, "batch_size": 16},
        ratios=(1.0,),
        io_share=1.0,
        repeats=3,
        jpeg_images=0,
        contenders=("serial DataLoader", "nostall"),
    )
    speedup = run_bench(config).stat("synthetic", "1", "nostall", "speedup")
    assert speedup is not None
    assert speedup.high > 1.5, speedup


def test_the_jpeg_trial_takes_its_own_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--jpeg-batch-size sizes the JPEG trial's batches: more of them an epoch than of 32."""
    seen: dict[int, set[int]] = {}

    def recording(width: int, device: torch.device) -> Any:
        step = train_step(width, device)

        def recorded(batch: Any) -> float:
            seen.setdefault(width, set()).add(len(batch[1]))
            return step(batch)

        return recorded

    monkeypatch.setattr(_trials, "train_step", recording)
    only = {"jpeg_images": 6, "jpeg_batch_size": 3, "jpeg_width": 3, "regime_batches": 0}
    run_bench(
        BenchConfig(**{**TINY_BENCH, **only, "contenders": ("nostall",)}, jpeg_cache=str(tmp_path))
    )
    assert {3} == seen[3]  # the JPEG step: batches of 3, the synthetic ones of 8
    assert {8} == seen[TINY_BENCH["width"]]
