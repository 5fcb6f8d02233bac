"""The terminal report: a table per ratio with the winner named, then each trial's table."""

from __future__ import annotations

from ._figures import Row, boundaries, handoff_table, loader_cores_needed, rows, workers_needed
from ._records import BenchResult
from ._targets import targets


def format_report(result: BenchResult) -> str:
    """The terminal report: a table per ratio with the winner named, hand-off, H2D, targets."""
    cfg, m = result.config, result.machine
    lines = [
        f"nostall bench on {m['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}: "
        f"torch {m['torch']}, {m['cores']} cores, {m['workers']} loader workers, "
        f"{m['compute_threads']} compute threads",
        f"workload: {cfg.batches} batches x {cfg.batch_size} images 3x{cfg.image_size}x"
        f"{cfg.image_size} uint8, convnet width {cfg.width}: "
        f"{result.compute_ms_per_batch:.1f} ms/batch compute; medians of {cfg.repeats} "
        f"alternating repeats",
        "E = epoch / max(load only, compute only); stall = time waiting for the next batch / epoch",
    ]
    for ratio in result.ratios:
        table = rows(result, ratio)
        lines += [
            "",
            f"load/compute ratio {ratio.ratio:g} (loading "
            f"{ratio.load_ms_per_sample:.2f} ms per sample)",
            f"  {'contender':<34}{'samples/s':>10}{'epoch s':>9}{'E':>7}{'stall':>8}"
            f"{'vs serial':>11}",
        ]
        for row in table:
            mark = " (unsafe)" if row.unsafe else ""
            lines.append(
                f"  {row.contender + mark:<34}{row.samples_per_s:>10.0f}"
                f"{row.epoch_s:>9.3f}{row.efficiency:>7.2f}{row.stall:>8.1%}"
                f"{row.speedup:>10.2f}x"
            )
        lines.append("  " + _verdict(table))
    handoff = handoff_table(result)
    if handoff:
        lines += [
            "",
            f"hand-off overhead per batch on an instant in-memory source "
            f"({cfg.handoff_batches} batches, over a plain loop)",
        ]
        for name, us in sorted(handoff.items(), key=lambda kv: kv[1]):
            lines.append(f"  {name:<34}{us:>8.1f} us")
    if result.transforms:
        info = result.transforms
        needed = workers_needed(result)
        counts = sorted({int(c) for by in info["rates"].values() for c in by})
        lines += [
            "",
            f"normalising on the CPU (in the loader) vs on the device (nostall.transforms)"
            f": {info['image_size']}x{info['image_size']} images, samples/s by loader "
            f"workers; the step alone runs {info['compute_samples_per_s']:,.0f} samples/s",
            f"  {'way':<38}"
            + "".join(f"{f'{c} workers':>12}" for c in counts)
            + f"{'needed':>8}{'bytes/sample':>14}",
        ]
        for way, by_count in info["rates"].items():
            cells = "".join(f"{by_count.get(c, by_count.get(str(c), 0.0)):>12,.0f}" for c in counts)
            need = needed.get(way)
            lines.append(
                f"  {way:<38}{cells}{'-' if need is None else need:>8}"
                f"{info['bytes_per_sample'][way]:>14,}"
            )
        cores = loader_cores_needed(result)
        if cores:
            lines.append(
                f"  {'per sample':<38}{'loader CPU ms':>14}{'loader cores at step rate':>27}"
                f"{'device ms':>11}"
            )
            for way, ms in info["loader_ms_per_sample"].items():
                lines.append(
                    f"  {way:<38}{ms:>14.3f}{cores[way]:>27.2f}"
                    f"{info['device_ms_per_sample'][way]:>11.4f}"
                )
        if "max_abs_diff" in info:
            lines.append(
                f"  same numbers: largest difference between the two ways' first batches "
                f"{info['max_abs_diff']:.2g}"
            )
    crossings = boundaries(result)
    if crossings:
        lines += [
            "",
            f"epoch boundaries over {cfg.epochs} epochs at ratio {cfg.epochs_ratio:g}: the "
            f"interval from an epoch's last batch to the next one's first, against the steady one",
            f"  {'way':<42}{'steady ms':>10}{'boundary ms':>13}{'ratio':>8}",
        ]
        for b in crossings:
            lines.append(
                f"  {b.contender:<42}{b.steady_s * 1e3:>10.1f}{b.boundary_s * 1e3:>13.1f}"
                f"{b.ratio:>7.2f}x"
            )
    if result.h2d:
        lines += [
            "",
            "host-to-device GB/s",
            f"  {'MB':>6}{'raw pinned':>12}{'pageable':>10}{'nostall (pinned src)':>22}"
            f"{'nostall (pins itself)':>23}",
        ]
        for h in result.h2d:
            lines.append(
                f"  {h['megabytes']:>6.0f}{h['raw_pinned_gb_s']:>12.1f}"
                f"{h['raw_pageable_gb_s']:>10.1f}{h['nostall_pinned_source_gb_s']:>22.1f}"
                f"{h['nostall_pageable_source_gb_s']:>23.1f}"
            )
    checks = targets(result)
    if checks:
        lines += ["", "targets"]
        for t in checks:
            state = {True: "met", False: "NOT met", None: "n/a"}[t.met]
            lines.append(f"  [{state}] {t.name}: {t.detail}")
    return "\n".join(lines)


def _verdict(table: list[Row]) -> str:
    safe = [r for r in table if not r.unsafe]
    if not safe:
        return "no safe contender ran"
    best = max(safe, key=lambda r: r.samples_per_s)
    others = [r for r in safe if r is not best]
    if not others:
        return f"only {best.contender} ran"
    runner_up = max(others, key=lambda r: r.samples_per_s)
    return (
        f"winner: {best.contender}, {best.samples_per_s / runner_up.samples_per_s:.2f}x the "
        f"next ({runner_up.contender}), {best.speedup:.2f}x serial"
    )
