"""The public surface: exactly what __all__ lists, sorted, and the exception tree."""

from __future__ import annotations

import types

import nostall


def test_public_names_are_exactly_all() -> None:
    """Every public name is in __all__, and __all__ is sorted (transforms is a public module)."""
    public = {
        name
        for name, value in vars(nostall).items()
        if not name.startswith("_")
        and (not isinstance(value, types.ModuleType) or name == "transforms")
    }
    assert public == set(nostall.__all__) - {"__version__"}
    assert sorted(nostall.__all__) == nostall.__all__


def test_exception_tree() -> None:
    """nostall's exceptions subclass the built-ins whose meaning they share."""
    assert issubclass(nostall.DeviceUnavailableError, nostall.NostallError)
    assert issubclass(nostall.DeviceUnavailableError, RuntimeError)
    assert issubclass(nostall.PrefetcherClosedError, RuntimeError)
    assert issubclass(nostall.ProducerDiedError, RuntimeError)
    assert issubclass(nostall.PrefetchTimeoutError, TimeoutError)
    assert issubclass(nostall.PrefetchTimeoutError, nostall.NostallError)


def test_py_typed_is_shipped() -> None:
    """The package declares its type hints."""
    from importlib.resources import files

    assert files("nostall").joinpath("py.typed").is_file()
