"""Device and memory inventory, on the machine at hand."""

from __future__ import annotations

import json

import pytest
import torch

import nostall
from nostall._cli import main
from nostall._devices import human


def test_devices_match_torch() -> None:
    """One record per visible CUDA device; none without CUDA."""
    found = nostall.devices()
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert expected == len(found)
    for d in found:
        assert d.total_bytes >= d.free_bytes > 0
        assert "." in d.compute_capability


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_devices_cli_without_cuda_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain words, the CPU side, exit 0."""
    assert 0 == main(["devices"])
    out = capsys.readouterr().out
    assert "no CUDA device" in out
    assert "cores" in out
    assert "MPS" in out


def test_devices_json(capsys: pytest.CaptureFixture[str]) -> None:
    """--json: the host and a list of devices."""
    assert 0 == main(["devices", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["cores"] >= 1
    assert isinstance(data["devices"], list)


def test_memory_report_on_the_cpu() -> None:
    """On the CPU: this process's resident memory and the host's free and total."""
    report = nostall.memory_report("cpu")
    assert report.allocated > 0
    assert report.peak >= report.allocated
    assert report.total is not None
    assert report.free is not None
    assert report.total >= report.free
    assert "allocated" in report.summary()
    assert report.to_dict()["summary"] == str(report)


def test_release_cached_memory_off_cuda_is_a_no_op() -> None:
    """Nothing to release without CUDA."""
    assert 0 == nostall.release_cached_memory("cpu")


def test_human_units() -> None:
    """Binary units."""
    assert "512 B" == human(512)
    assert "1.5 KiB" == human(1536)
    assert "2.0 GiB" == human(2 * 1024**3)
    assert "?" == human(None)


@pytest.mark.cuda
def test_cuda_memory_report_and_release() -> None:
    """Allocated follows a tensor; released memory comes back from the cache."""
    before = nostall.memory_report("cuda")
    x = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    during = nostall.memory_report("cuda")
    assert during.allocated >= before.allocated + x.numel()
    del x
    released = nostall.release_cached_memory("cuda")
    assert released >= 64 * 1024 * 1024
