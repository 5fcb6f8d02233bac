"""Resolving the device argument."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import nostall
from nostall import DeviceUnavailableError, _device
from nostall._device import resolve_device


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has exactly one CUDA device, current index 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_none_without_cuda_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA: the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch.device("cpu") == resolve_device(None)


@pytest.mark.usefixtures("one_gpu")
def test_none_with_cuda_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA present and no LOCAL_RANK: the current device, with its index."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert torch.device("cuda", 0) == resolve_device(None)


@pytest.fixture
def four_gpus_rank_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four visible GPUs, current device still 0, LOCAL_RANK=3; the guess not yet announced."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(_device, "_local_rank_guess_announced", False)


@pytest.mark.usefixtures("four_gpus_rank_3")
def test_none_under_torchrun_is_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun with set_device forgotten: cuda:LOCAL_RANK when visible, and a warning."""
    with pytest.warns(UserWarning, match=r"call torch.cuda.set_device\(3\)"):
        assert torch.device("cuda", 3) == resolve_device(None)
    monkeypatch.setenv("LOCAL_RANK", "9")  # not visible (one GPU per rank, say): current device
    assert torch.device("cuda", 0) == resolve_device(None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert torch.device("cuda", 0) == resolve_device(None)


@pytest.mark.usefixtures("four_gpus_rank_3")
def test_the_local_rank_guess_is_announced_once_per_process() -> None:
    """Every prefetcher resolves its device; the advice comes once, at the user's line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-location filter is not the guard
        for _ in range(3):
            assert torch.device("cuda", 3) == resolve_device(None)
    assert 1 == len(caught)
    assert __file__ == caught[0].filename  # the caller's line, not nostall's


def test_a_device_the_user_set_wins_over_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_device(k) (by the user, Lightning or accelerate) beats LOCAL_RANK, silently.

    Silently: warnings are errors in this test suite.
    """
    from simcuda import simulated_cuda

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(_device, "_local_rank_guess_announced", False)
    with simulated_cuda(device_count=4):
        torch.cuda.set_device(2)
        assert torch.device("cuda", 2) == resolve_device(None)
        assert torch.device("cuda", 2) == nostall.prefetch([torch.ones(2)]).device


@pytest.mark.parametrize(
    ("given", "expected"),
    [("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("meta", "meta")],
)
def test_plain_devices(given: Any, expected: str) -> None:
    """Strings and torch.device objects are accepted."""
    assert torch.device(expected) == resolve_device(given)


@pytest.mark.usefixtures("one_gpu")
def test_cuda_gets_an_explicit_index() -> None:
    """'cuda' and 0 become cuda:0."""
    assert torch.device("cuda", 0) == resolve_device("cuda")
    assert torch.device("cuda", 0) == resolve_device(0)


@pytest.mark.usefixtures("one_gpu")
def test_index_out_of_range_says_what_is_visible() -> None:
    """cuda:7 on a one-GPU machine names the count and the choices."""
    with pytest.raises(DeviceUnavailableError, match="only 1 CUDA device is visible") as info:
        resolve_device("cuda:7")
    assert "device='cuda:0'" in str(info.value)
    assert "device='cpu'" in str(info.value)


def test_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear error that says CUDA is missing and what to pass instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available") as info:
        resolve_device("cuda:0")
    assert isinstance(info.value, RuntimeError)
    assert "pass device='cpu'" in str(info.value)


def test_mps_without_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPS requested where it is missing."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="MPS is not available"):
        resolve_device("mps")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x"])
def test_a_string_that_names_no_device(bad: str) -> None:
    """A string that names no device is a ValueError that shows it."""
    with pytest.raises(ValueError, match=f"device={bad!r} does not name a device"):
        resolve_device(bad)


@pytest.mark.parametrize(
    ("bad", "meant"),
    [("gpu", "cuda"), ("GPU:1", "cuda:1"), ("CUDA", "cuda"), ("cdua:0", "cuda:0"), ("Mps", "mps")],
)
def test_a_device_written_as_users_write_it_names_the_fix(bad: str, meant: str) -> None:
    """A GPU called "gpu", a type in capitals, a misspelling: the error says what to pass."""
    with pytest.raises(ValueError, match=re.escape(f"did you mean {meant!r}?")):
        resolve_device(bad)


def test_a_device_unlike_any_gets_no_guess() -> None:
    with pytest.raises(ValueError, match="does not name a device") as raised:
        resolve_device("nonsense")
    assert "did you mean" not in str(raised.value)


def test_a_cpu_index_other_than_zero_is_refused() -> None:
    """torch moves tensors to 'cpu:5' all the same: refused, naming what to pass."""
    with pytest.raises(ValueError, match="torch has one cpu device") as info:
        resolve_device("cpu:5")
    assert "device='cpu:5'" in str(info.value)
    assert "pass device='cpu'" in str(info.value)
    with pytest.raises(ValueError, match="torch has one cpu device"):
        nostall.prefetch([torch.ones(1)], "cpu:5")
    assert torch.device("cpu", 0) == resolve_device("cpu:0")


@pytest.mark.parametrize("bad", [1.0, True, [0]])
def test_a_device_of_the_wrong_type(bad: Any) -> None:
    """A value of another type is a TypeError naming what was received and what to pass."""
    with pytest.raises(TypeError, match=r"device must be a torch.device, .* \(got .*, a "):
        resolve_device(bad)
