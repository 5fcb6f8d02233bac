"""The files ``nostall doctor`` writes: ``--json`` and ``--html``, their paths checked first.

The figures and the verdict are the :class:`~nostall._tools.diagnosis.Diagnosis`'s own; this module
only lays them out. :func:`check_output` also serves ``nostall bench`` (``--json``, ``--plot``).
"""

from __future__ import annotations

import html
import json
import os
import stat
import tempfile
from pathlib import Path

from .._exceptions import ConfigurationError
from ..cuda._timing import Measured
from .diagnosis import Diagnosis, per_s
from .tune import YOURS, Setting


def check_output(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before minutes of measuring.

    Writing is tried, not guessed from permission bits (root passes those everywhere, and
    ``/dev/full`` opens fine and fails only when written to):

    * an existing file is opened for appending, without truncating it, and sent a write of
      zero bytes: that changes nothing in a file (nor its time stamps) but fails where a real
      write fails on a device (``/dev/full``: no space) or a read-only filesystem;
    * a new file is tried as a temporary file beside it, one byte written and synced (a full
      or read-only filesystem fails there), then removed: nothing is left behind;
    * a named pipe or socket is not opened: opening a pipe waits for its reader.

    A disk with only a little room left can still fill up before the report is written.

    Raises:
        ConfigurationError: the path is empty (``--json ""``: a script's unset variable), its
            folder does not exist, it is a folder, or writing it fails.
    """
    if path is None:
        return
    if not path.strip():
        raise ConfigurationError(
            f"{flag} was given an empty path, so nothing would be written; pass a file name "
            f"(e.g. {flag} out/figures.{'png' if 'plot' in flag else 'json'}) or leave {flag} out"
        )
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigurationError(f"{flag} {path} is a folder; pass a file path")
    if not folder.is_dir():
        raise ConfigurationError(f"{flag} {path}: the folder {folder} does not exist")
    try:
        if not target.exists():
            fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".nostall", dir=folder)
            try:
                os.write(fd, b"\0")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        elif not stat.S_ISFIFO(mode := target.stat().st_mode) and not stat.S_ISSOCK(mode):
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                os.write(fd, b"")
            finally:
                os.close(fd)
    except OSError as e:
        raise ConfigurationError(
            f"{flag} {path} cannot be written ({e.strerror or e}); pass a path on a writable "
            f"filesystem with room to spare"
        ) from e


def write_reports(diagnosis: Diagnosis, json_path: str | None, html_path: str | None) -> None:
    """Write ``--json`` and ``--html`` where asked."""
    if json_path:
        Path(json_path).write_text(json.dumps(diagnosis.to_dict(), indent=2) + "\n")
    if html_path:
        Path(html_path).write_text(html_page(diagnosis))


#: The width one character of the chart's 12px labels takes, at most, in a sans-serif font.
CHAR_PX = 7.5


def chart_label(setting: Setting) -> str:
    """A setting in the fewest words that still tell every setting apart."""
    workers = (
        "factory's workers" if setting.num_workers is None else f"workers={setting.num_workers}"
    )
    if setting.depth is None:
        return f"{workers}, no prefetcher"
    threads = "" if setting.threads is None else f" threads={setting.threads}"
    return f"{workers}, prefetch depth={setting.depth}{threads}"


def chart_rows(diagnosis: Diagnosis) -> list[tuple[str, Measured]]:
    """The chart's bars, labelled: the figures compared, then the search's single trials.

    A search trial of a setting that was then measured again says so in its label, so that its
    one run beside the same setting's runs is not read as a second setting.
    """
    ours, theirs = diagnosis.with_nostall, diagnosis.without_nostall
    n = diagnosis.as_built.n
    rows = [
        (f"yours, as built ({chart_label(YOURS)}), {n} runs", diagnosis.as_built),
        (f"best found: {chart_label(ours[0])}, {ours[1].n} runs", ours[1]),
        (f"best without nostall: {chart_label(theirs[0])}, {theirs[1].n} runs", theirs[1]),
    ]
    again = {ours[0], theirs[0]}
    for setting, rate in diagnosis.search.curve:
        note = ", measured again above" if setting in again else ""
        rows.append((f"search trial, one run: {chart_label(setting)}{note}", Measured((rate,))))
    return rows


def html_page(diagnosis: Diagnosis) -> str:
    """A self-contained page (no scripts, no downloads): the settings, median and spread.

    The chart's label column is as wide as its longest label (nothing is cut), and its axis
    is in samples/s.
    """
    measured = chart_rows(diagnosis)
    top = max(rate.high for _, rate in measured) or 1.0
    bar_h, width = 22, 460
    left = int(CHAR_PX * max(len(label) for label, _ in measured)) + 12
    bars = []
    for i, (label, rate) in enumerate(measured):
        y = i * (bar_h + 6)
        w, lo, hi = (max(1.0, width * v / top) for v in (rate.median, rate.low, rate.high))
        bars.append(
            f'<text x="0" y="{y + 15}" font-size="12">{html.escape(label)}</text>'
            f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#3b7dd8"/>'
            f'<line x1="{left + lo:.1f}" x2="{left + hi:.1f}" y1="{y + 11}" y2="{y + 11}" '
            f'stroke="black"/>'
            f'<text x="{left + 5 + hi:.1f}" y="{y + 15}" font-size="12">'
            f"{rate.median:,.0f}</text>"
        )
    axis_y = len(measured) * (bar_h + 6) + 4
    bars.append(
        f'<line x1="{left}" x2="{left + width}" y1="{axis_y}" y2="{axis_y}" stroke="black"/>'
    )
    for k in range(5):
        x = left + width * k / 4
        bars.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{axis_y}" y2="{axis_y + 4}" stroke="black"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" font-size="11" text-anchor="middle">'
            f"{top * k / 4:,.0f}</text>"
        )
    bars.append(
        f'<text x="{left + width / 2:.1f}" y="{axis_y + 32}" font-size="12" '
        f'text-anchor="middle">samples/s (bar: median; line: the range of the runs)</text>'
    )
    height = axis_y + 40
    step, speedup = diagnosis.step_rate, diagnosis.speedup
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in (
            ("device", diagnosis.device),
            ("verdict", diagnosis.bound),
            ("load only", per_s(diagnosis.load)),
            ("step only", "n/a" if step is None else per_s(step)),
            (
                "load average",
                "n/a" if diagnosis.load_average is None else f"{diagnosis.load_average:.1f}",
            ),
            ("loop as built", per_s(diagnosis.as_built)),
            ("speed-up", "none measurable" if speedup is None else f"{speedup:.2f}x"),
        )
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>nostall doctor</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head>"
        f"<body><h1>nostall doctor</h1><pre>{html.escape(diagnosis.summary())}</pre>"
        f"<table>{rows}</table><h2>samples/s: median, and the range of the runs</h2>"
        "<p>Yours and the best found were measured again after the search, in turns; each "
        "search trial is one run, as the search saw it.</p>"
        f"<svg width='{left + width + 80}' height='{height}' "
        f"xmlns='http://www.w3.org/2000/svg'>{''.join(bars)}</svg></body></html>\n"
    )
