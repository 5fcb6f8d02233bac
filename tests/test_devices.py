"""Device and memory inventory: on the machine at hand, and on a fake machine (CUDA + NVML)."""

from __future__ import annotations

import json
import os
import sys
import types
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import nostall
from nostall._tools.cli import main
from nostall.cuda._devices import DeviceInfo, format_devices, host_info, human


def test_devices_match_torch() -> None:
    """One record per visible CUDA device; none without CUDA."""
    found = nostall.cuda.devices()
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert expected == len(found)
    for d in found:
        assert d.free_bytes is None or d.total_bytes >= d.free_bytes > 0
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


def test_memory_cli_reports_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    """``nostall memory``: a line per device, the host last; ``--json``: the same figures."""
    assert 0 == main(["memory"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("cpu: ")
    assert "free of" in lines[-1]
    assert 0 == main(["memory", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert "cpu" == data[-1]["device"]
    assert data[-1]["total"] >= data[-1]["free"] > 0


def test_memory_cli_on_the_simulated_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """With two GPUs: one line each, with the allocator's figures, before the host's."""
    from simcuda import simulated_cuda

    with simulated_cuda(2):
        x = torch.zeros(256, device="cuda:1")
        assert 0 == main(["memory", "--json"])
        del x
    data = json.loads(capsys.readouterr().out)
    assert ["cuda:0", "cuda:1", "cpu"] == [r["device"] for r in data]
    assert data[1]["allocated"] >= 256 * 4
    assert data[0]["allocated"] == 0


def test_memory_report_on_the_cpu() -> None:
    """On the CPU: this process's resident memory and the host's free and total."""
    report = nostall.cuda.memory_report("cpu")
    assert report.allocated > 0
    assert report.peak >= report.allocated
    assert report.total is not None
    assert report.free is not None
    assert report.total >= report.free
    assert "allocated" in report.summary()
    assert report.to_dict()["summary"] == str(report)


def test_release_cached_memory_off_cuda_is_a_no_op() -> None:
    """Nothing to release without CUDA."""
    assert 0 == nostall.cuda.release_cached_memory("cpu")


def test_human_units() -> None:
    """Binary units."""
    assert "512 B" == human(512)
    assert "1.5 KiB" == human(1536)
    assert "2.0 GiB" == human(2 * 1024**3)
    assert "?" == human(None)


@pytest.mark.cuda
def test_cuda_memory_report_and_release() -> None:
    """Allocated follows a tensor; released memory comes back from the cache."""
    before = nostall.cuda.memory_report("cuda")
    x = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    during = nostall.cuda.memory_report("cuda")
    assert during.allocated >= before.allocated + x.numel()
    del x
    released = nostall.cuda.release_cached_memory("cuda")
    assert released >= 64 * 1024 * 1024


# A fake machine for devices(): physical GPUs as the driver knows them, the CUDA devices a
# process sees through CUDA_VISIBLE_DEVICES, and pynvml over the same GPUs. It follows the real
# APIs where nostall depends on them: torch's props.uuid is an object whose str() is the bare
# UUID while NVML names devices "GPU-<uuid>" / "MIG-<uuid>"; NVML works only between nvmlInit and
# nvmlShutdown (reference-counted) and fails field by field; CUDA creates a context on a device
# that mem_get_info asks about; torch._C._cuda_hasPrimaryContext tells without creating one.


@dataclass
class FakeGpu:
    """A physical GPU or a MIG instance; a field set to None is one NVML does not support."""

    uuid: str  # as NVML names it: "GPU-<uuid>" or "MIG-<uuid>"
    free: int
    util: int | None = 50
    gen: int | None = 4
    width: int | None = 16
    temp: int | None = 40
    milliwatts: int | None = 100_000
    mig_capable: bool = False
    instances: list[FakeGpu] = field(default_factory=list)  # non-empty: MIG mode is on

    @property
    def bare(self) -> str:
        """The UUID without its prefix, as CUDA reports it."""
        return self.uuid.split("-", 1)[1]


def _gpu(n: int, **fields: Any) -> FakeGpu:
    """Physical GPU ``n``: UUID, free memory and utilisation all derived from ``n``."""
    return FakeGpu(
        f"GPU-{n:08x}-1111-2222-3333-{n:012x}", free=(n + 1) << 30, util=10 + n, **fields
    )


def _mig(n: int, **fields: Any) -> FakeGpu:
    """MIG instance ``n``, reporting its memory only (NVML has no utilisation for MIG)."""
    fields = {"util": None, "gen": None, "width": None, "temp": None, "milliwatts": None, **fields}
    return FakeGpu(f"MIG-{n:08x}-4444-5555-6666-{n:012x}", free=n << 20, **fields)


class FakeCUuuid:
    """torch._C._CUuuid: ``str()`` gives the bare lowercase 8-4-4-4-12 form, ``bytes`` the raw."""

    def __init__(self, bare: str) -> None:
        self._bare = bare

    @property
    def bytes(self) -> list[int]:
        return list(uuid.UUID(self._bare).bytes)

    def __str__(self) -> str:
        return self._bare


class FakeCuda:
    """The CUDA side of the machine, installed over torch.cuda with ``monkeypatch``.

    ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it: indices, unique ``GPU-`` UUID prefixes,
    full ``MIG-`` UUIDs; the first entry that names nothing ends the list. A GPU in MIG mode is
    reached through its instances only (index entries for one are not modelled).
    """

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        contexts: Iterable[int] = (),  # devices on which the process already has a context
        current: int = 0,
        mig_named_by_parent: bool = False,  # a CUDA that reports an instance by its GPU's UUID
    ) -> None:
        self.gpus = gpus
        self.visible = self._visible(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.contexts = set(contexts)
        self.current = current
        self.mig_named_by_parent = mig_named_by_parent
        self.asked: list[int] = []  # mem_get_info calls, by visible index

    def _visible(self, variable: str | None) -> list[FakeGpu]:
        if variable is None:
            return [g for g in self.gpus if not g.instances]
        out: list[FakeGpu] = []
        for entry in (e.strip() for e in variable.split(",")):
            if entry.isdigit() and int(entry) < len(self.gpus):
                matches = [self.gpus[int(entry)]]
            elif entry.startswith("GPU-"):
                matches = [g for g in self.gpus if g.uuid.startswith(entry)]
            elif entry.startswith("MIG-"):
                matches = [m for g in self.gpus for m in g.instances if m.uuid == entry]
            else:
                matches = []
            if len(matches) != 1:
                break
            out.append(matches[0])
        return out

    def _parent(self, device: FakeGpu) -> FakeGpu:
        return next((g for g in self.gpus if device in g.instances), device)

    def properties(self, device: Any = None) -> SimpleNamespace:
        found = self.visible[self.current if device is None else int(device)]
        named = self._parent(found) if self.mig_named_by_parent else found
        return SimpleNamespace(
            name="Fake GPU",
            major=9,
            minor=0,
            multi_processor_count=132,
            total_memory=80 << 30,
            uuid=FakeCUuuid(named.bare),
        )

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        index = self.current if device is None else int(device)
        self.asked.append(index)
        self.contexts.add(index)  # cudaMemGetInfo needs, and so creates, a context there
        return self.visible[index].free, 80 << 30

    def install(self, monkeypatch: pytest.MonkeyPatch, *, probe: bool = True) -> None:
        """Replace torch.cuda's functions; ``probe=False``: a torch without the context probe."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.visible))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        if probe:
            monkeypatch.setattr(
                torch._C, "_cuda_hasPrimaryContext", self.contexts.__contains__, raising=False
            )
        else:
            monkeypatch.delattr(torch._C, "_cuda_hasPrimaryContext", raising=False)


class FakeNvml(types.ModuleType):
    """The part of nvidia-ml-py (``pynvml``) nostall uses, over the same GPUs.

    As the real module: every device call outside an ``nvmlInit``/``nvmlShutdown`` pair raises
    ``NVMLError_Uninitialized``; handles are opaque; ``nvmlDeviceGetHandleByIndex`` counts
    physical GPUs (MIG instances have no index); ``nvmlDeviceGetHandleByUUID`` takes the full
    "GPU-..." or "MIG-..." name (str or bytes); an unsupported field raises
    ``NVMLError_NotSupported``.
    """

    NVML_TEMPERATURE_GPU = 0
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        """Every NVML failure; the real module raises one subclass per error code."""

    class NVMLError_Uninitialized(NVMLError):  # the real module's names
        """NVML_ERROR_UNINITIALIZED."""

    class NVMLError_InvalidArgument(NVMLError):
        """NVML_ERROR_INVALID_ARGUMENT."""

    class NVMLError_NotSupported(NVMLError):
        """NVML_ERROR_NOT_SUPPORTED."""

    class NVMLError_NotFound(NVMLError):
        """NVML_ERROR_NOT_FOUND."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.refcount = 0
        self.inits = 0

    def nvmlInit(self) -> None:
        self.refcount += 1
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.refcount -= 1

    def _check(self) -> None:
        if self.refcount == 0:
            raise self.NVMLError_Uninitialized()

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError_InvalidArgument()
        return FakeHandle(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, name: str | bytes) -> FakeHandle:
        self._check()
        text = name.decode() if isinstance(name, bytes) else name
        for gpu in self.gpus:
            for device in (gpu, *gpu.instances):
                if device.uuid == text:
                    return FakeHandle(device)
        raise self.NVMLError_NotFound()

    def _field(self, handle: FakeHandle, name: str) -> int:
        self._check()
        value = getattr(handle.device, name)
        if value is None:
            raise self.NVMLError_NotSupported()
        return int(value)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        self._check()
        return handle.device.uuid

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        self._check()
        if handle.device.uuid.startswith("MIG-"):
            raise self.NVMLError_InvalidArgument()
        if not handle.device.mig_capable:
            raise self.NVMLError_NotSupported()
        mode = int(bool(handle.device.instances))
        return [mode, mode]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        free = self._field(handle, "free")
        return SimpleNamespace(total=80 << 30, free=free, used=(80 << 30) - free)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        return SimpleNamespace(gpu=self._field(handle, "util"), memory=0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._field(handle, "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._field(handle, "width")

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert self.NVML_TEMPERATURE_GPU == sensor
        return self._field(handle, "temp")

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._field(handle, "milliwatts")  # milliwatts, as NVML reports it


@dataclass(frozen=True)
class FakeHandle:
    """An opaque nvmlDevice_t."""

    device: FakeGpu


def _machine(
    monkeypatch: pytest.MonkeyPatch,
    gpus: list[FakeGpu],
    *,
    visible: str | None = None,
    nvml: bool = True,
    **cuda: Any,
) -> tuple[FakeCuda, FakeNvml | None]:
    """Install the fake machine.

    ``visible`` is CUDA_VISIBLE_DEVICES (None: unset), ``nvml`` whether nvidia-ml-py is
    installed, ``cuda`` goes to :class:`FakeCuda`.
    """
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    fake_cuda = FakeCuda(gpus, **cuda)
    fake_cuda.install(monkeypatch)
    fake_nvml = FakeNvml(gpus) if nvml else None
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)  # None: the import fails
    return fake_cuda, fake_nvml


def _nvml_fields(d: DeviceInfo) -> tuple[Any, ...]:
    return (d.utilization_percent, d.pcie_generation, d.pcie_width, d.temperature_c, d.power_w)


def test_without_nvml_free_memory_comes_only_from_devices_with_a_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA is asked only about the device this process already uses: no context is created."""
    cuda, _ = _machine(monkeypatch, [_gpu(0), _gpu(1), _gpu(2)], nvml=False, contexts={1})
    found = nostall.cuda.devices()
    assert [0, 1, 2] == [d.index for d in found]
    assert [1] == cuda.asked
    assert {1} == cuda.contexts
    assert [None, 2 << 30, None] == [d.free_bytes for d in found]
    assert [80 << 30] * 3 == [d.total_bytes for d in found]
    assert "?" in format_devices(found, host_info())  # unknown free memory is shown as such


def test_without_the_context_probe_only_the_current_device_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without _cuda_hasPrimaryContext: only the current device is known to be in use."""
    cuda, _ = _machine(
        monkeypatch, [_gpu(0), _gpu(1), _gpu(2)], nvml=False, contexts={2}, current=2
    )
    cuda.install(monkeypatch, probe=False)
    found = nostall.cuda.devices()
    assert [2] == cuda.asked
    assert [None, None, 3 << 30] == [d.free_bytes for d in found]


def test_with_nvml_cuda_is_asked_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML gives free memory for every device; CUDA creates no context, not even a used one."""
    cuda, _ = _machine(monkeypatch, [_gpu(0), _gpu(1)], contexts={0})
    found = nostall.cuda.devices()
    assert [] == cuda.asked
    assert {0} == cuda.contexts
    assert [1 << 30, 2 << 30] == [d.free_bytes for d in found]


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        (f"{_gpu(2).uuid},{_gpu(0).uuid}", [2, 0]),
        (f"{_gpu(2).uuid[:12]},1", [2, 1]),  # a unique UUID prefix, as CUDA accepts
        ("1,GPU-ffff", [1]),  # CUDA stops at the first entry that names nothing
    ],
    ids=["unset", "indices", "uuids", "uuid-prefix", "stops-at-unknown"],
)
def test_nvml_data_belong_to_the_physical_device_cuda_uses(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, physical: list[int]
) -> None:
    """Whatever CUDA_VISIBLE_DEVICES says, each visible device gets its own GPU's NVML record."""
    gpus = [_gpu(0), _gpu(1), _gpu(2)]
    _machine(monkeypatch, gpus, visible=visible)
    found = nostall.cuda.devices()
    assert [gpus[n].util for n in physical] == [d.utilization_percent for d in found]
    assert [gpus[n].free for n in physical] == [d.free_bytes for d in found]


def test_one_unsupported_field_leaves_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """NotSupported for the temperature: only the temperature is missing."""
    _machine(monkeypatch, [_gpu(0, temp=None)])
    (found,) = nostall.cuda.devices()
    assert (10, 4, 16, None, 100.0) == _nvml_fields(found)
    assert 1 << 30 == found.free_bytes


def test_one_nvml_session_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit once for all devices, and nvmlShutdown after."""
    _, nvml = _machine(monkeypatch, [_gpu(0), _gpu(1), _gpu(2)])
    assert nvml is not None
    assert 3 == len(nostall.cuda.devices())
    assert 1 == nvml.inits
    assert 0 == nvml.refcount


def test_a_mig_instance_gets_its_own_data_not_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=MIG-...: the instance's memory; what it does not report stays None."""
    parent = _gpu(0, mig_capable=True, instances=[_mig(1), _mig(2)])
    _machine(monkeypatch, [parent, _gpu(1)], visible=f"{_mig(2).uuid}")
    (found,) = nostall.cuda.devices()
    assert 2 << 20 == found.free_bytes
    assert (None, None, None, None, None) == _nvml_fields(found)


def test_a_device_named_by_its_mig_mode_gpu_gets_no_nvml_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should CUDA name an instance by its GPU's UUID, the GPU's figures are not given as its."""
    parent = _gpu(0, mig_capable=True, instances=[_mig(1)])
    _machine(monkeypatch, [parent], visible=_mig(1).uuid, mig_named_by_parent=True)
    (found,) = nostall.cuda.devices()
    assert found.free_bytes is None
    assert (None, None, None, None, None) == _nvml_fields(found)


def test_a_mig_capable_gpu_outside_mig_mode_gets_its_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG capable, MIG mode off: a whole GPU like any other."""
    _machine(monkeypatch, [_gpu(0, mig_capable=True)])
    (found,) = nostall.cuda.devices()
    assert (10, 4, 16, 40, 100.0) == _nvml_fields(found)


def test_a_device_nvml_does_not_know_gets_no_nvml_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A visible device missing from NVML's view gets nothing, not another device's record."""
    cuda, nvml = _machine(monkeypatch, [_gpu(0), _gpu(1)], visible="1")
    assert nvml is not None
    nvml.gpus = [_gpu(0)]  # NVML sees only GPU 0
    (found,) = nostall.cuda.devices()
    assert found.free_bytes is None
    assert (None, None, None, None, None) == _nvml_fields(found)
    assert [] == cuda.asked


def test_nvml_that_fails_to_start_gives_no_nvml_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlInit fails (no driver library): CUDA's own data, the NVML fields None."""
    _, nvml = _machine(monkeypatch, [_gpu(0)], contexts={0})
    assert nvml is not None

    def no_library() -> None:
        raise nvml.NVMLError("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "nvmlInit", no_library)
    (found,) = nostall.cuda.devices()
    assert 1 << 30 == found.free_bytes  # from CUDA: device 0 already has a context
    assert (None, None, None, None, None) == _nvml_fields(found)


def test_memory_report_and_release_on_mps_read_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On MPS the figures are Metal's, not the host's (the CPU branch reads /proc)."""
    from nostall.cuda import _devices

    mps = SimpleNamespace(
        current_allocated_memory=lambda: 3 * 2**20,
        driver_allocated_memory=lambda: 8 * 2**20,
        recommended_max_memory=lambda: 64 * 2**20,
    )

    def empty_cache() -> None:
        mps.driver_allocated_memory = lambda: 5 * 2**20

    mps.empty_cache = empty_cache
    monkeypatch.setattr(_devices, "resolve_device", lambda device: torch.device("mps"))
    monkeypatch.setattr(torch, "mps", mps)
    report = nostall.cuda.memory_report("mps")
    values = (report.allocated, report.reserved, report.peak, report.free, report.total)
    assert (3, 8, 3, 56, 64) == tuple(None if v is None else v // 2**20 for v in values)
    assert 3 * 2**20 == nostall.cuda.release_cached_memory("mps")
