"""Device and memory inventory: what accelerators are here, and what their memory holds."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._device import DeviceLike, resolve_device


@dataclass(frozen=True)
class DeviceInfo:
    """One visible CUDA device (indices as the process sees them, after CUDA_VISIBLE_DEVICES).

    The NVML fields are None unless ``nvidia-ml-py`` is installed (``pip install
    'nostall[nvml]'``) and the driver answers.
    """

    index: int
    name: str
    compute_capability: str
    multiprocessors: int
    total_bytes: int
    free_bytes: int
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

    An empty list where CUDA is not available (see :func:`host_info` for the CPU).
    """
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        extra = _nvml(index)
        out.append(
            DeviceInfo(
                index,
                props.name,
                f"{props.major}.{props.minor}",
                props.multi_processor_count,
                int(total),
                int(free),
                **extra,
            )
        )
    return out


def _nvml(index: int) -> dict[str, Any]:
    """Utilisation, PCIe link, temperature and power from NVML, when it is installed."""
    try:
        import pynvml  # the nvml extra: nvidia-ml-py
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        # NVML counts physical devices; map the visible index through CUDA_VISIBLE_DEVICES.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = index
        if visible:
            entries = [v.strip() for v in visible.split(",") if v.strip()]
            if index < len(entries) and entries[index].isdigit():
                physical = int(entries[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
        return {
            "utilization_percent": int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "pcie_generation": int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
            "pcie_width": int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
            "temperature_c": int(
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            ),
            "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }
    except Exception:  # NVML missing from the driver, or a field it does not report
        return {}


def host_info() -> dict[str, Any]:
    """The CPU side: cores, memory, torch threads, and whether CUDA or MPS are present."""
    total, available = _meminfo()
    return {
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
    reserved equals allocated (there is no caching allocator to report on).
    """
    dev = resolve_device(device)
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
    and the next allocations pay for fresh ``cudaMalloc`` calls. A no-op off CUDA (returns 0).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(dev)
    with torch.cuda.device(dev):
        torch.cuda.empty_cache()
    return int(before - torch.cuda.memory_reserved(dev))
