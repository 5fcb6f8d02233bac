"""The benchmark's targets, and whether a run met them, read from the derived figures."""

from __future__ import annotations

from dataclasses import dataclass

from . import _contenders as c
from ._figures import boundaries, handoff_table, loader_cores_needed, rows, workers_needed
from ._records import BenchResult

# The peers the hand-off target compares against (the seed design counts as one).
HANDOFF_PEERS = (c.SEED.name, c.PREFETCH_GENERATOR.name, c.TORCHDATA.name)

SAME_NUMBERS_ATOL = 1e-5


@dataclass(frozen=True)
class Target:
    """A target from the benchmark's brief, and whether this run met it."""

    name: str
    met: bool | None  # None: not measurable in this run
    detail: str


def targets(result: BenchResult) -> list[Target]:
    """Check the measured figures against the targets."""
    out: list[Target] = []
    nostall_names = [
        n
        for n in (c.NOSTALL.name, c.NOSTALL_WORKERS.name)
        if any(n in r.runs for r in result.ratios)
    ]
    for name in nostall_names:
        worst = []
        ok = True
        for ratio in result.ratios:
            row = next(r for r in rows(result, ratio) if r.contender == name)
            limit = 1.10 if ratio.ratio == 1 else 1.05
            ok &= row.efficiency <= limit
            worst.append(f"{ratio.ratio:g}: {row.efficiency:.2f}")
        out.append(Target(f"{name}: E <= 1.05 (<= 1.10 at ratio 1)", ok, ", ".join(worst)))
        fractions = []
        ok = True
        checked = False
        for ratio in result.ratios:
            if ratio.ratio > 0.9:
                continue
            checked = True
            row = next(r for r in rows(result, ratio) if r.contender == name)
            ok &= row.stall <= 0.05
            fractions.append(f"{ratio.ratio:g}: {row.stall:.1%}")
        out.append(
            Target(
                f"{name}: stall <= 5% where load <= 0.9 x compute",
                ok if checked else None,
                ", ".join(fractions) or "no such ratio run",
            )
        )
    handoff = handoff_table(result)
    peers = {k: v for k, v in handoff.items() if k in HANDOFF_PEERS}
    if c.NOSTALL.name in handoff and peers:
        best_name = min(peers, key=lambda k: peers[k])
        ours = handoff[c.NOSTALL.name]
        out.append(
            Target(
                "hand-off <= 0.6 x the best peer's",
                ours <= 0.6 * peers[best_name],
                f"nostall {ours:.1f} us vs {best_name} {peers[best_name]:.1f} us "
                f"({ours / peers[best_name]:.2f}x)"
                if peers[best_name] > 0
                else "peer at 0 us",
            )
        )
    for b in boundaries(result):
        if b.contender == "nostall across_epochs":
            out.append(
                Target(
                    "epoch boundary <= 1.5 x the steady batch interval (across_epochs)",
                    b.ratio <= 1.5,
                    f"{b.ratio:.2f}x ({b.boundary_s * 1e3:.1f} ms vs {b.steady_s * 1e3:.1f} ms)",
                )
            )
    out.extend(_transform_targets(result))
    if result.h2d:
        big = [h for h in result.h2d if h["megabytes"] >= 8]
        shares = [h["nostall_pinned_source_gb_s"] / h["raw_pinned_gb_s"] for h in big]
        out.append(
            Target(
                "host-to-device >= 90% of a raw pinned copy (>= 8 MB)",
                bool(shares) and min(shares) >= 0.9,
                ", ".join(
                    f"{h['megabytes']:.0f} MB: {s:.0%}" for h, s in zip(big, shares, strict=True)
                ),
            )
        )
        at_one = [r for r in result.ratios if r.ratio == 1]
        if at_one:
            table = {row.contender: row for row in rows(result, at_one[0])}
            best = table.get(c.BEST_PRACTICE.name)
            ours_rows = [table[n] for n in nostall_names if n in table]
            if best and ours_rows:
                top = max(ours_rows, key=lambda r: r.samples_per_s)
                gain = top.samples_per_s / best.samples_per_s
                out.append(
                    Target(
                        "samples/s >= 1.2 x best-practice DataLoader at ratio 1",
                        gain >= 1.2,
                        f"{top.contender}: {gain:.2f}x",
                    )
                )
    return out


def _fewest(needed: int | None, tried: int) -> str:
    return f"> {tried}" if needed is None else str(needed)


def _transform_targets(result: BenchResult) -> list[Target]:
    """The ``--gpu-transforms`` targets: 2x fewer loader workers, and the same numbers."""
    info = result.transforms
    needed = workers_needed(result)
    if len(needed) != 2:
        return []
    out: list[Target] = []
    name = "device-side normalising needs at least 2x fewer loader workers"
    cpu_side, device_side = needed.values()
    cores = loader_cores_needed(result)
    costs = ""
    if len(cores) == 2:
        (cpu_ms, device_ms), (cpu_cores, device_cores) = (
            info["loader_ms_per_sample"].values(),
            cores.values(),
        )
        costs = (
            f"loader CPU {cpu_ms:.3f} vs {device_ms:.3f} ms/sample, "
            f"{cpu_cores:.2f} vs {device_cores:.2f} cores at the step's rate"
        )
    tried = max((int(c) for by in info["rates"].values() for c in by), default=0)
    where = (
        " (the device is this CPU: device-side normalising runs in the prefetch thread)"
        if result.machine.get("device", "cpu").startswith("cpu")
        else ""
    )
    measured = f"measured workers: CPU-side {_fewest(cpu_side, tried)}, device-side " + (
        f"{_fewest(device_side, tried)}{where}; {costs}"
    )
    if device_side is None:
        # The best rate belongs to some way, so the CPU-side way kept up and this one did not.
        out.append(Target(name, False, measured))
    else:
        # CPU-side never keeping up with ``tried`` workers means it needs at least tried + 1.
        cpu_least = cpu_side if cpu_side is not None else tried + 1
        met = cpu_least >= 2 * device_side if device_side else cpu_least >= 1
        out.append(Target(name, met, measured))
    if "max_abs_diff" in info:
        diff = info["max_abs_diff"]
        out.append(
            Target(
                f"device-side normalising gives the CPU-side numbers (max |diff| <= "
                f"{SAME_NUMBERS_ATOL:g})",
                diff <= SAME_NUMBERS_ATOL,
                f"max |diff| {diff:.2g} on the first batch",
            )
        )
    return out
