"""Device and memory inventory: what accelerators are here, and what their memory holds."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .._device import DeviceLike, resolve_device
from .._torch_compat import has_cuda_context


@dataclass(frozen=True)
class DeviceInfo:
    """One visible CUDA device (indices as the process sees them, after CUDA_VISIBLE_DEVICES).

    ``total_bytes`` comes from the device properties. ``free_bytes`` comes from NVML, or from
    CUDA for a device on which this process already has a context; it is None otherwise,
    because asking CUDA would create a context (hundreds of MiB) on that device. The other
    NVML fields are None unless ``nvidia-ml-py`` is installed (``pip install 'nostall[nvml]'``)
    and the driver reports them for this device (a MIG instance reports fewer). NVML data
    always belong to the device of the same UUID, never to another one: a device that NVML can
    only name by a GPU in MIG mode (of which it is one instance) gets none.
    """

    index: int
    name: str
    compute_capability: str
    multiprocessors: int
    total_bytes: int
    free_bytes: int | None = None
    utilization_percent: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return asdict(self)


def devices() -> list[DeviceInfo]:
    """Every visible CUDA device, with its capability, multiprocessors and memory.

    Creates no CUDA context: device properties need none, and free memory comes from NVML
    (or from CUDA only for a device that already has one). An empty list where CUDA is not
    available (see :func:`host_info` for the CPU).
    """
    if not torch.cuda.is_available():
        return []
    nvml = _Nvml.open()
    try:
        return [_device(index, nvml) for index in range(torch.cuda.device_count())]
    finally:
        if nvml is not None:
            nvml.close()


def _device(index: int, nvml: _Nvml | None) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    fields: dict[str, Any] = {}
    handle = None if nvml is None else nvml.handle(str(getattr(props, "uuid", "")))
    if nvml is not None and handle is not None:
        fields = nvml.fields(handle)
    if fields.get("free_bytes") is None and has_cuda_context(index):
        fields["free_bytes"] = int(torch.cuda.mem_get_info(index)[0])
    return DeviceInfo(
        index,
        props.name,
        f"{props.major}.{props.minor}",
        props.multi_processor_count,
        int(props.total_memory),
        **fields,
    )


class _Nvml:
    """One NVML session (``nvmlInit`` ... ``nvmlShutdown``) for one :func:`devices` call.

    Devices are found by the UUID CUDA reports for them, never by index, so
    ``CUDA_VISIBLE_DEVICES`` given as indices, UUIDs, UUID prefixes or MIG instances all map to
    the right device, and one that cannot be matched gets no NVML data; each field is asked
    separately, so one the driver does not support (``NotSupported`` on MIG, on some boards)
    leaves the others.
    """

    def __init__(self, module: Any) -> None:
        self.nvml = module

    @classmethod
    def open(cls) -> _Nvml | None:
        """A session, or None when nvidia-ml-py is missing or the driver does not answer."""
        try:
            import pynvml  # the nvml extra: nvidia-ml-py
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # no driver, or an NVML too old: no NVML fields
            return None
        return cls(pynvml)

    def close(self) -> None:
        """End the session."""
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()

    def handle(self, uuid: str) -> Any:
        """The NVML handle of the device whose CUDA UUID is ``uuid`` (None if not found).

        CUDA gives the bare UUID (``str(props.uuid)``: ``xxxxxxxx-xxxx-...``); NVML names the
        same device ``GPU-<uuid>``, or ``MIG-<uuid>`` for a MIG instance (drivers since R470).
        """
        if not uuid:
            return None
        bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
        gpu = self._by_uuid(f"GPU-{bare}")
        if gpu is not None:
            # CUDA never runs on a whole GPU in MIG mode, only on its instances: a CUDA device
            # under such a GPU's UUID is an instance, and the GPU's figures are not its own.
            return None if self._mig_enabled(gpu) else gpu
        return self._by_uuid(f"MIG-{bare}")

    def _by_uuid(self, name: str) -> Any:
        try:
            return self.nvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:  # NVMLError_NotFound, or a driver without MIG-aware lookups
            return None

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self.nvml.nvmlDeviceGetMigMode(handle)
            return bool(current == self.nvml.NVML_DEVICE_MIG_ENABLE)
        except Exception:  # NVMLError_NotSupported: a GPU without MIG
            return False

    def fields(self, handle: Any) -> dict[str, Any]:
        """Every field the driver reports for ``handle``; missing ones are left out."""
        nvml = self.nvml
        queries: dict[str, Callable[[], Any]] = {
            "free_bytes": lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).free),
            "utilization_percent": lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "pcie_generation": lambda: int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
            "pcie_width": lambda: int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
            "temperature_c": lambda: int(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            ),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }
        out: dict[str, Any] = {}
        for name, query in queries.items():
            try:
                out[name] = query()
            except Exception:  # NVMLError_NotSupported and friends: this field only
                continue
        return out


def host_info() -> dict[str, Any]:
    """The machine: CPU, cores, memory, Python, torch and its threads, CUDA and MPS.

    The one description of the machine nostall gives (``nostall devices``, the bench's records).
    """
    total, available = _meminfo()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_total_bytes": total,
        "memory_available_bytes": available,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_build": torch.version.cuda,
        "mps_available": bool(torch.backends.mps.is_available()),
    }


def available_memory(device: torch.device) -> int:
    """Bytes that ``device`` can still give: free GPU memory, or the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    _, available = _meminfo()
    if available is not None:
        return available
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _meminfo() -> tuple[int | None, int | None]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


def human(nbytes: float | None) -> str:
    """Bytes in binary units, e.g. '1.5 GiB'."""
    if nbytes is None:
        return "?"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_devices(found: list[DeviceInfo], host: dict[str, Any]) -> str:
    """The ``nostall devices`` table."""
    lines = [
        f"host: {host['cores']} cores, {human(host['memory_available_bytes'])} of "
        f"{human(host['memory_total_bytes'])} memory available, torch {host['torch']} with "
        f"{host['torch_threads']} threads; MPS {'present' if host['mps_available'] else 'absent'}"
    ]
    if not found:
        build = (
            "this torch is built without CUDA"
            if host["cuda_build"] is None
            else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        )
        lines.append(f"no CUDA device: {build}; nostall runs on the CPU here")
        return "\n".join(lines)
    lines.append(
        f"  {'#':>2}  {'name':<28}{'cc':>5}{'SMs':>6}{'free':>12}{'total':>12}"
        f"{'util':>6}{'PCIe':>9}{'temp':>6}{'power':>8}"
    )
    for d in found:
        pcie = f"gen{d.pcie_generation} x{d.pcie_width}" if d.pcie_generation else "-"
        lines.append(
            f"  {d.index:>2}  {d.name[:28]:<28}{d.compute_capability:>5}{d.multiprocessors:>6}"
            f"{human(d.free_bytes):>12}{human(d.total_bytes):>12}"
            f"{'-' if d.utilization_percent is None else f'{d.utilization_percent}%':>6}"
            f"{pcie:>9}{'-' if d.temperature_c is None else f'{d.temperature_c}C':>6}"
            f"{'-' if d.power_w is None else f'{d.power_w:.0f}W':>8}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one device, in bytes. On CUDA, from the caching allocator and the driver."""

    device: str
    allocated: int  # held by live tensors
    reserved: int  # held by the caching allocator (allocated + cached for reuse)
    peak: int  # the most allocated since start or the last reset_peak_memory_stats
    free: int | None  # free on the device, as the driver sees it
    total: int | None

    def summary(self) -> str:
        """One line."""
        return (
            f"{self.device}: {human(self.allocated)} allocated, {human(self.reserved)} reserved, "
            f"{human(self.peak)} peak; {human(self.free)} free of {human(self.total)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """For logging."""
        return {**asdict(self), "summary": self.summary()}

    def __str__(self) -> str:
        return self.summary()


def memory_report(device: DeviceLike = None) -> MemoryReport:
    """Allocated, reserved, peak, free and total memory of ``device``.

    On the CPU, allocated and peak are this process's resident and peak resident memory, and
    reserved equals allocated (there is no caching allocator to report on). On MPS: the
    tensors' memory, the memory Metal's driver holds for this process (reserved), and the
    recommended working set as the total; MPS keeps no peak, so peak is the current figure.
    """
    dev = resolve_device(device)
    if dev.type == "mps":
        allocated = int(torch.mps.current_allocated_memory())
        reserved = int(torch.mps.driver_allocated_memory())
        total = int(torch.mps.recommended_max_memory())
        return MemoryReport(str(dev), allocated, reserved, allocated, total - reserved, total)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return MemoryReport(
            str(dev),
            torch.cuda.memory_allocated(dev),
            torch.cuda.memory_reserved(dev),
            torch.cuda.max_memory_allocated(dev),
            int(free),
            int(total),
        )
    host_total, host_available = _meminfo()
    rss, peak = _process_memory()
    return MemoryReport(str(dev), rss, rss, peak, host_available, host_total)


def _process_memory() -> tuple[int, int]:
    rss = peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        import resource

        peak = rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return rss, peak


def release_cached_memory(device: DeviceLike = None) -> int:
    """Return cached, unused CUDA memory to the driver; the bytes released.

    This wraps ``torch.cuda.empty_cache()``. It frees only blocks the caching allocator holds
    for reuse: memory held by live tensors stays allocated until those tensors are gone, so
    drop your references (and let the garbage collector run) first. It makes the memory
    visible to other processes and to ``nvidia-smi``; it does not make this process faster,
    and the next allocations pay for fresh ``cudaMalloc`` calls. On MPS, ``torch.mps.empty_cache()``
    the same way. A no-op elsewhere (returns 0).
    """
    dev = resolve_device(device)
    if dev.type == "mps":
        before = int(torch.mps.driver_allocated_memory())
        torch.mps.empty_cache()
        return before - int(torch.mps.driver_allocated_memory())
    if dev.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(dev)
    with torch.cuda.device(dev):
        torch.cuda.empty_cache()
    return int(before - torch.cuda.memory_reserved(dev))
