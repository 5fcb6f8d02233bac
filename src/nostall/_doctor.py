"""``nostall doctor``: diagnose a user's own loader, and find a faster way to feed it.

The DS-Analyzer differential method: the loader's rate alone (load only), the step's rate on a
device-resident batch (compute only), and the two together; then a search over loader settings
(:func:`nostall.tune`) with and without ``nostall.prefetch``.
"""

from __future__ import annotations

import html
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _arguments
from ._device import DeviceLike, resolve_device
from ._exceptions import ConfigurationError
from ._timing import synchronize
from ._transfer import to_device
from ._tree import batch_size_of
from ._tune import Factory, Setting, Step, TuneResult, measure, tune

DEFAULT = Setting(None, None)


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Import ``MODULE:NAME`` (the current directory first on the path) and check it is callable.

    Only what the spec itself gets wrong is a :class:`ConfigurationError`: a malformed spec, a
    module that does not exist, a missing name, a name that is not callable. An exception raised
    while the user's module runs its top level (a ``ValueError``, or an ``ImportError`` of one of
    *its* imports) is the user's code failing: it propagates unchanged, with its traceback.

    Raises:
        ConfigurationError: (a ``ValueError``) the spec is malformed, the module or name is
            missing, or it is not callable; the message says which and how to fix it.
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name or module_name.startswith("."):
        raise ConfigurationError(
            f"{what} must be MODULE:FUNCTION with an absolute module name, e.g. "
            f"mytrain:make_loader (got {spec!r})"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not _is_the_spec(e.name, module_name):
            raise  # the module exists; one of its own imports failed, in the user's code
        raise ConfigurationError(f"cannot import module {module_name!r} for {what}: {e}") from e
    try:
        target = getattr(module, name)
    except AttributeError:
        raise ConfigurationError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{name!r} for {what}"
        ) from None
    if not callable(target):
        raise ConfigurationError(
            f"{spec} is a {type(target).__name__}, not a function; {what} must be callable"
        )
    return target  # type: ignore[no-any-return]


def _is_the_spec(missing: str | None, module_name: str) -> bool:
    """Whether the module found missing is ``module_name`` or one of its parent packages."""
    return missing is not None and (missing == module_name or module_name.startswith(missing + "."))


def _checked(factory: Factory) -> Factory:
    """The factory, failing clearly when it does not build an iterable.

    What the factory raises itself is the user's code failing and propagates untouched; only a
    return value that cannot be iterated is a :class:`ConfigurationError` (the spec names the
    wrong function).
    """

    def build(**kwargs: Any) -> Iterable[Any]:
        loader = factory(**kwargs)
        if not callable(getattr(type(loader), "__iter__", None)):
            raise ConfigurationError(
                f"the factory returned a {type(loader).__name__}, not an iterable loader; it "
                f"should return a DataLoader (or any iterable of batches)"
            )
        return loader

    build.__signature__ = _signature(factory)  # type: ignore[attr-defined]
    return build


def _signature(factory: Factory) -> Any:
    import inspect

    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return inspect.Signature()


@dataclass
class Diagnosis:
    """What the doctor measured and concluded (samples/s throughout)."""

    load_rate: float
    step_rate: float | None
    loop_rate: float
    with_nostall: TuneResult
    without_nostall: tuple[Setting, float]
    device: str

    @property
    def bound(self) -> str:
        """input-bound, compute-bound or balanced; unknown without a step."""
        if self.step_rate is None:
            return "unknown (no --step given)"
        if self.load_rate < 0.9 * self.step_rate:
            return "input-bound"
        if self.load_rate > 1.1 * self.step_rate:
            return "compute-bound"
        return "balanced"

    @property
    def best(self) -> tuple[Setting, float]:
        """The fastest setting found, with or without nostall."""
        ours = (self.with_nostall.best, self.with_nostall.samples_per_s)
        return max(ours, self.without_nostall, key=lambda pair: pair[1])

    @property
    def speedup(self) -> float:
        """The best setting's rate over the loop as the factory builds it."""
        return self.best[1] / self.loop_rate if self.loop_rate > 0 else float("inf")

    def summary(self) -> str:
        """The diagnosis in plain words."""
        setting, rate = self.best
        step = (
            f", step {self.step_rate:,.0f} samples/s"
            if self.step_rate is not None
            else " (pass --step to compare with your training step)"
        )
        lines = [
            f"{self.bound}: loading {self.load_rate:,.0f} samples/s{step}; as built, the loop "
            f"runs at {self.loop_rate:,.0f} samples/s.",
            f"best found: {setting.describe()}, {rate:,.0f} samples/s, {self.speedup:.1f}x faster.",
        ]
        if self.bound == "compute-bound" and self.speedup < 1.1:
            lines.append("the step is the bottleneck: faster loading will not help much.")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Every figure, for ``--json``."""
        setting, rate = self.best
        return {
            "device": self.device,
            "bound": self.bound,
            "load_samples_per_s": self.load_rate,
            "step_samples_per_s": self.step_rate,
            "loop_samples_per_s": self.loop_rate,
            "best": {"setting": setting.describe(), "samples_per_s": rate},
            "speedup": self.speedup,
            "tune": self.with_nostall.to_dict(),
            "without_nostall": {
                "setting": self.without_nostall[0].describe(),
                "samples_per_s": self.without_nostall[1],
            },
            "summary": self.summary(),
        }

    def to_html(self) -> str:
        """A self-contained page (no scripts, no downloads) with a bar chart of every trial."""
        trials = [("as built", self.loop_rate)]
        trials += [(s.describe(), r) for s, r in self.with_nostall.curve]
        trials.append((self.without_nostall[0].describe(), self.without_nostall[1]))
        top = max(r for _, r in trials) or 1.0
        bar_h, width = 22, 460
        bars = []
        for i, (label, rate) in enumerate(trials):
            y = i * (bar_h + 6)
            w = max(1.0, width * rate / top)
            bars.append(
                f'<text x="0" y="{y + 15}" font-size="12">{html.escape(label)}</text>'
                f'<rect x="330" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#3b7dd8"/>'
                f'<text x="{335 + w:.1f}" y="{y + 15}" font-size="12">{rate:,.0f}</text>'
            )
        height = len(trials) * (bar_h + 6)
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
            for k, v in (
                ("device", self.device),
                ("verdict", self.bound),
                ("load only (samples/s)", f"{self.load_rate:,.0f}"),
                (
                    "step only (samples/s)",
                    "n/a" if self.step_rate is None else f"{self.step_rate:,.0f}",
                ),
                ("loop as built (samples/s)", f"{self.loop_rate:,.0f}"),
                ("best found", f"{self.best[0].describe()}: {self.best[1]:,.0f}"),
                ("speed-up", f"{self.speedup:.2f}x"),
            )
        )
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>nostall doctor</title>"
            "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head>"
            f"<body><h1>nostall doctor</h1><p>{html.escape(self.summary())}</p>"
            f"<table>{rows}</table><h2>samples/s of every setting tried</h2>"
            f"<svg width='{330 + width + 80}' height='{height}' "
            f"xmlns='http://www.w3.org/2000/svg'>{''.join(bars)}</svg></body></html>\n"
        )


def diagnose(
    factory: Factory,
    *,
    step: Step | None = None,
    device: DeviceLike = None,
    max_batches: int = 300,
    progress: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Measure the user's loader (and step), search for a faster setting, and say what to do.

    Args:
        factory: builds the loader (see :mod:`nostall._tune`).
        step: the training step, called with a batch on the device.
        device: where batches go (default: CUDA when available).
        max_batches: the most batches the settings search (:func:`nostall.tune`) may pull; the
            fixed measurements around it pull up to 43 more (14 for each of the three loops
            timed, one for the step).
        progress: called with a line as each of the five phases starts.

    Exceptions raised by ``factory``, by the loaders it builds or by ``step`` propagate
    unchanged, with their tracebacks: they are the user's code failing, not a diagnosis.

    Raises:
        ConfigurationError: (a ``ValueError``) the factory does not return an iterable.
        TypeError: ``factory``, ``step`` or ``progress`` is not callable, ``max_batches`` not
            an int; ``device`` of a type that names no device.
        ValueError: ``max_batches`` < 1; ``device`` names no device.
        DeviceUnavailableError: ``device`` is not on this machine.
    """
    _arguments.function(
        "diagnose",
        "factory",
        factory,
        hint="pass the function that builds your loader (make_loader, not make_loader())",
    )
    _arguments.function(
        "diagnose", "step", step, optional=True, hint="pass your training step, step(batch)"
    )
    _arguments.integer("diagnose", "max_batches", max_batches, low=1, example=300)
    _arguments.function(
        "diagnose", "progress", progress, optional=True, hint="pass e.g. progress=print"
    )
    dev = resolve_device(device)
    say = progress or (lambda _: None)
    build = _checked(factory)
    say("[1/5] load only: the loader as the factory builds it")
    load_rate, _ = measure(build, DEFAULT, dev, batches=12)
    step_rate = None
    if step is not None:
        say("[2/5] step only: your step on one device-resident batch")
        step_rate = _step_rate(build, step, dev)
    say("[3/5] the loop as built: loading and step together")
    loop_rate, _ = measure(build, DEFAULT, dev, batches=12, step=step)
    say(f"[4/5] searching loader settings with nostall.prefetch (at most {max_batches} batches)")
    tuned = tune(build, max_batches=max_batches, device=dev, step=step)
    say("[5/5] the best loader settings without nostall")
    plain = Setting(tuned.best.num_workers, None)
    plain_rate, _ = measure(build, plain, dev, batches=12, step=step)
    return Diagnosis(load_rate, step_rate, loop_rate, tuned, (plain, plain_rate), str(dev))


def _step_rate(build: Factory, step: Step, device: Any) -> float:
    batch = to_device(next(iter(build())), device)
    step(batch)  # warm-up
    synchronize(device)
    n = 10
    start = time.perf_counter()
    for _ in range(n):
        step(batch)
    synchronize(device)
    return n * (batch_size_of(batch) or 1) / (time.perf_counter() - start)


def write_reports(diagnosis: Diagnosis, json_path: str | None, html_path: str | None) -> None:
    """Write ``--json`` and ``--html`` where asked."""
    if json_path:
        Path(json_path).write_text(json.dumps(diagnosis.to_dict(), indent=2) + "\n")
    if html_path:
        Path(html_path).write_text(diagnosis.to_html())
