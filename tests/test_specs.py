"""The user's code named as MODULE:FUNCTION: loaded, checked, and its own errors left alone.

The command line's handling of the same cases (one line and status 2, or the user's traceback)
is tested in test_doctor.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from nostall._exceptions import ConfigurationError
from nostall._tools.specs import checked_factory, load_callable

_names = itertools.count()


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"user_specs_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(
        "CONSTANT = 3\n"
        "def make(num_workers=0):\n    return [1, 2, 3]\n"
        "def returns_int():\n    return 42\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_spec_loads_the_function(module: str) -> None:
    assert load_callable(f"{module}:make", "factory")() == [1, 2, 3]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must be MODULE:FUNCTION"),
        (".relative:make", "must be MODULE:FUNCTION with an absolute module name"),
        ("nope_no_such_module:missing", "cannot import module 'nope_no_such_module'"),
        ("{m}:missing", "has no attribute 'missing' for factory$"),
        ("{m}:mak", r"has no attribute 'mak' for factory; did you mean {m}:make\?"),
        ("{m}.py:make", r"name the module, not its file: {m}:make"),
        ("src/{m}.py:make", r"name the module, not its file: src.{m}:make"),
        ("{m}:CONSTANT", "is an int, not a function; factory must be callable"),
    ],
)
def test_a_bad_spec_is_a_configuration_error(module: str, spec: str, message: str) -> None:
    """A bad spec is a ConfigurationError, still a ValueError for Python callers."""
    with pytest.raises(ConfigurationError, match=message.format(m=module)):
        load_callable(spec.format(m=module), "factory")
    assert issubclass(ConfigurationError, ValueError)


def test_a_factory_that_builds_no_iterable_is_a_configuration_error(module: str) -> None:
    build = checked_factory(load_callable(f"{module}:returns_int", "factory"))
    with pytest.raises(ConfigurationError, match="returned an int, not an iterable loader"):
        build()


def test_a_checked_factory_keeps_the_signature_the_tuner_reads(module: str) -> None:
    """The doctor passes num_workers only to a factory that takes it."""
    from nostall._tools.tune import accepted_knobs

    build = checked_factory(load_callable(f"{module}:make", "factory"))
    assert accepted_knobs(build) == {"num_workers"}
    assert build(num_workers=2) == [1, 2, 3]
