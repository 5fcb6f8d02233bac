"""Resolving the ``device`` argument into a concrete, available :class:`torch.device`."""

from __future__ import annotations

import difflib
import os

import torch

from ._arguments import kind
from ._exceptions import DeviceUnavailableError
from ._warn import warn

DeviceLike = torch.device | str | int | None

#: Device types torch has exactly one of: any index but 0 names nothing.
_SINGLE = ("cpu", "mps")


# The LOCAL_RANK guess is announced once per process: default_device runs for every
# prefetcher, timer and transfer, and the advice is the same each time.
_local_rank_guess_announced = False


def default_device() -> torch.device:
    """Return the device nostall uses when none is given.

    The CPU without CUDA. With CUDA, the current CUDA device, with one exception for
    ``torchrun``, decided as follows:

    * a current device other than ``cuda:0`` was chosen by the user (``torch.cuda.set_device``,
      Lightning, accelerate) and always wins, also over a different ``LOCAL_RANK`` (a launcher
      may map ranks to GPUs its own way);
    * while the current device is still ``cuda:0`` and ``LOCAL_RANK`` names another visible
      device, nostall takes ``cuda:LOCAL_RANK``: ranks commonly forget ``set_device``, and
      every rank would otherwise load onto GPU 0. An explicit ``set_device(0)`` on such a rank
      looks the same to torch, so the guess is announced with a warning (once per process)
      that names the fix: ``set_device`` at the start of each rank, or ``device=...``;
    * a ``LOCAL_RANK`` that is not a visible index (one GPU per rank) is ignored.
    """
    global _local_rank_guess_announced
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if current != 0 or not local_rank.isdigit():
        return torch.device("cuda", current)
    rank = int(local_rank)
    if rank == 0 or rank >= torch.cuda.device_count():
        return torch.device("cuda", current)
    if not _local_rank_guess_announced:
        _local_rank_guess_announced = True
        warn(
            f"nostall chose cuda:{rank} from LOCAL_RANK={rank} because this process's current "
            f"CUDA device is still cuda:0; call torch.cuda.set_device({rank}) at the start of "
            f"each rank (or pass device=...) so that the model and the batches are on the same "
            f"GPU"
        )
    return torch.device("cuda", rank)


def resolve_device(device: DeviceLike) -> torch.device:
    """Turn ``device`` into an available :class:`torch.device` with an explicit CUDA index.

    Args:
        device: ``None`` (see :func:`default_device`), a ``torch.device``, a string such as
            ``"cuda:1"`` or ``"cpu"``, or an int (a CUDA index).

    Raises:
        TypeError: ``device`` is not of a type that names a device.
        ValueError: ``device`` is a string that names no device, or an index of a device type
            torch has one of (``"cpu:5"``: the CPU is ``cpu``, whatever its cores).
        DeviceUnavailableError: the device is well formed but does not exist on this machine.
    """
    if device is None:
        return default_device()
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device must be a torch.device, a string such as 'cuda:0' or 'cpu', an int or None "
            f"(got {device!r}, {kind(device)})"
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"device={device!r} does not name a device{_did_you_mean(str(device))} (torch: {e})"
        ) from e
    if dev.type == "cuda":
        return _check_cuda(dev, device)
    if dev.type in _SINGLE and dev.index not in (None, 0):
        # torch accepts cpu:5 and moves tensors to the one CPU device all the same, so a
        # mistyped device (a GPU index meant for cuda) would silently run on the CPU.
        raise ValueError(
            f"device={device!r} names {dev.type} device {dev.index}, but torch has one "
            f"{dev.type} device (index 0); pass device={dev.type!r}, or device='cuda:"
            f"{dev.index}' if you meant a GPU"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailableError(
            f"device={device!r} was requested but MPS is not available on this machine; "
            f"{_available()}"
        )
    return dev


def resolve_data_device(device: DeviceLike) -> torch.device:
    """:func:`resolve_device`, for batches that must hold data: the meta device is refused.

    ``nostall.prefetch``, ``tune`` and the doctor move batches there to compute on them;
    ``to_device`` alone still takes ``"meta"`` (shapes without data have their uses).

    Raises:
        ValueError: ``device`` is the meta device (and as :func:`resolve_device`).
    """
    dev = resolve_device(device)
    if dev.type == "meta":
        raise ValueError(
            "device='meta' holds no data, so batches cannot be moved there; pass "
            "device='cuda', 'cpu' or None"
        )
    return dev


def _check_cuda(dev: torch.device, requested: object) -> torch.device:
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "no CUDA device found"
        raise DeviceUnavailableError(
            f"device={requested!r} was requested but CUDA is not available "
            f"(torch {torch.__version__}, {build}); {_available()}"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise DeviceUnavailableError(
            f"device={requested!r} was requested but only {count} CUDA device"
            f"{'s are' if count != 1 else ' is'} visible{hint}; {_available()}"
        )
    return torch.device("cuda", index)


def _available() -> str:
    """Say what the caller can pass instead."""
    options = ["device='cpu'"]
    if torch.cuda.is_available():
        options[:0] = [f"device='cuda:{i}'" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        options.insert(0, "device='mps'")
    return "pass " + " or ".join(options) + " instead, or device=None to pick the best one"


#: Names users write for a device that torch spells otherwise.
_SPELLED = {"gpu": "cuda", "nvidia": "cuda", "apple": "mps", "metal": "mps"}


def _did_you_mean(text: str) -> str:
    """``'; did you mean 'cuda:1'?'`` for a device written as users often write it, else ``''``.

    The common names for a GPU (``gpu``, ``GPU:1``), a device type in capitals (``CUDA``),
    and a close misspelling of torch's device types (``cdua``).
    """
    name, sep, index = text.strip().partition(":")
    lowered = name.lower()
    types = ("cpu", "cuda", "mps", "xpu", "meta")
    guess = _SPELLED.get(lowered) or (lowered if lowered in types else None)
    if guess is None:
        close = difflib.get_close_matches(lowered, types, n=1, cutoff=0.6)
        guess = close[0] if close else None
    if guess is None:
        return ""
    return f"; did you mean {guess + sep + index!r}?"
