"""The user's code, named on the command line as ``MODULE:FUNCTION``, loaded and checked.

Only what the name itself gets wrong is a :class:`ConfigurationError` (a usage error); whatever
the user's code raises while it runs is theirs, and keeps its traceback.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from .._arguments import kind, not_batches
from .._exceptions import ConfigurationError

Factory = Callable[..., Iterable[Any]]


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
        raise ConfigurationError(
            f"cannot import module {module_name!r} for {what}: {e}{_module_hint(module_name, name)}"
        ) from e
    try:
        target = getattr(module, name)
    except AttributeError:
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")])
        hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
        raise ConfigurationError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{name!r} for {what}{hint}"
        ) from None
    if not callable(target):
        raise ConfigurationError(
            f"{spec} is {kind(target)}, not a function; {what} must be callable"
        )
    return target  # type: ignore[no-any-return]


def _module_hint(module_name: str, name: str) -> str:
    """The fix for a module named as a file (``common.py``, ``src/train``), else ''."""
    dotted = module_name.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
    if dotted == module_name:
        return ""
    return f"; name the module, not its file: {dotted}:{name}"


def _is_the_spec(missing: str | None, module_name: str) -> bool:
    """Whether the module found missing is ``module_name`` or one of its parent packages."""
    return missing is not None and (missing == module_name or module_name.startswith(missing + "."))


def checked_factory(factory: Factory) -> Factory:
    """The factory, failing clearly when it does not build an iterable.

    What the factory raises itself is the user's code failing and propagates untouched; only a
    return value that cannot be iterated, or whose iteration is not batches (a tensor, a str,
    a dict: see :func:`~nostall._arguments.not_batches`), is a :class:`ConfigurationError`
    (the spec names the wrong function).
    """

    def build(**kwargs: Any) -> Iterable[Any]:
        loader = factory(**kwargs)
        if not callable(getattr(type(loader), "__iter__", None)):
            raise ConfigurationError(
                f"the factory returned {kind(loader)}, not an iterable loader; it "
                f"should return a DataLoader (or any iterable of batches)"
            )
        yields = not_batches(loader)
        if yields is not None:  # iterable, but one batch or sample: the wrong function named
            raise ConfigurationError(
                f"the factory returned {kind(loader)}, whose iteration yields {yields}, not a "
                f"loader of batches; it should return a DataLoader (or any iterable of batches)"
            )
        return loader

    build.__signature__ = _signature(factory)  # type: ignore[attr-defined]
    build.__name__ = getattr(factory, "__name__", build.__name__)  # as messages name it
    return build


def _signature(factory: Factory) -> Any:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return inspect.Signature()
