"""The public surface: exactly what __all__ lists, sorted, and the exception tree."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import nostall


def test_public_names_are_exactly_all() -> None:
    """Every public name is in __all__, and __all__ is sorted (transforms, cuda: public modules)."""
    public = {
        name
        for name in dir(nostall)  # the names imported on first use too
        if not name.startswith("_")
        and (
            not isinstance(getattr(nostall, name), types.ModuleType)
            or name in ("transforms", "cuda")
        )
    }
    assert public == set(nostall.__all__) - {"__version__"}
    assert sorted(nostall.__all__) == nostall.__all__
    assert all(getattr(nostall, n).__module__ == "nostall" for n in public - {"cuda", "transforms"})


def test_the_package_and_the_commands_help_load_no_torch() -> None:
    """import nostall, nostall --help and --version answer without loading torch (seconds).

    The public names are imported on first use; each shows as nostall's from then on.
    """
    code = (
        "import sys\n"
        "import nostall\n"
        "from nostall._tools.cli import main\n"
        "for argv in (['--help'], ['--version'], ['bench', '--help'], ['tune', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "print('torch' in sys.modules, nostall.NostallError.__module__)\n"
        "print(type(nostall.prefetch([1])).__module__)\n"  # its module's names: nostall's
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert 0 == done.returncode, done.stderr
    assert ["False nostall", "nostall"] == done.stdout.splitlines()[-2:]
    assert "nostall 0.1.0" in done.stdout


def test_the_gpu_toolkit_is_its_own_tier() -> None:
    """nostall.cuda holds the toolkit; the top level does not repeat it."""
    toolkit = set(nostall.cuda.__all__)
    assert toolkit == {
        "DeviceInfo",
        "Measured",
        "MemoryReport",
        "Timer",
        "Timing",
        "devices",
        "memory_report",
        "pin_memory",
        "release_cached_memory",
        "run_concurrently",
        "timeit",
        "to_device",
    }
    assert not toolkit & set(nostall.__all__)
    assert sorted(nostall.cuda.__all__) == nostall.cuda.__all__
    assert all(getattr(nostall.cuda, n).__module__ == "nostall.cuda" for n in toolkit)


def test_exception_tree() -> None:
    """nostall's exceptions subclass the built-ins whose meaning they share."""
    assert issubclass(nostall.DeviceUnavailableError, nostall.NostallError)
    assert issubclass(nostall.DeviceUnavailableError, RuntimeError)
    assert issubclass(nostall.PrefetcherClosedError, RuntimeError)
    assert issubclass(nostall.ProducerDiedError, RuntimeError)
    assert issubclass(nostall.PrefetchTimeoutError, TimeoutError)
    assert issubclass(nostall.PrefetchTimeoutError, nostall.NostallError)
    assert issubclass(nostall.ProfilingDisabledError, RuntimeError)


def test_py_typed_is_shipped() -> None:
    """The package declares its type hints."""
    from importlib.resources import files

    assert files("nostall").joinpath("py.typed").is_file()


def test_public_classes_and_functions_say_they_are_nostalls() -> None:
    """``nostall.Prefetcher`` in reprs and tracebacks, not a private module's path."""
    for name in nostall.__all__:
        value = getattr(nostall, name)
        if isinstance(value, type) or (callable(value) and not isinstance(value, types.ModuleType)):
            assert value.__module__ == "nostall", name


def test_report_without_profiling_is_a_runtime_error() -> None:
    p = nostall.prefetch([1], "cpu")
    with pytest.raises(RuntimeError, match="pass profile=True") as info:
        p.report()
    assert isinstance(info.value, nostall.ProfilingDisabledError)
    assert isinstance(info.value, nostall.NostallError)
    with pytest.raises(TypeError):
        nostall.prefetch([1], "cpu", profile=True).report(True)  # type: ignore[call-arg]


def test_timeout_errors_carry_what_a_program_needs_and_survive_pickling() -> None:
    """A loop can react to a timeout without parsing the message; the attributes pickle."""

    def stalled() -> Iterator[int]:
        yield 0
        release.wait(10)
        yield 1

    release = threading.Event()
    it = iter(nostall.prefetch(stalled(), "cpu", timeout=0.3))
    assert next(it) == 0
    with pytest.raises(nostall.PrefetchTimeoutError) as info:
        next(it)
    error = pickle.loads(pickle.dumps(info.value))
    assert (error.timeout, error.batch) == (0.3, 1)
    assert error.thread is not None
    assert error.thread.startswith("nostall-prefetch")
    assert "next(source)" in str(error.phase)
    release.set()
    assert next(it) == 1  # nothing lost
    it.close()


PACKAGE = Path(nostall.__file__).parent


#: The engine: the modules a batch goes through, and those that keep its state between them
#: (their paths in the package).
ENGINE = (
    "_prefetcher.py",
    "_engine/iteration.py",
    "_engine/lineage.py",
    "_engine/latest_producer.py",
    "_engine/producer.py",
    "_engine/channel.py",
    "_loading/pacing.py",
    "_epochs/epochs.py",
    "_epochs/drawn_orders.py",
    "_staging/base.py",
    "_staging/cuda.py",
)

#: The engine's fields assigned after construction (see the test); this number only shrinks.
MUTABLE_FIELDS = 40


def _fields(module: str) -> dict[str, tuple[set[str], set[str]]]:
    """Per class of ``module``: its ``self.x`` fields, and those assigned outside ``__init__``."""
    found = {}
    tree = ast.parse((PACKAGE / module).read_text())
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        every, later = set(), set()
        for method in (node for node in cls.body if isinstance(node, ast.FunctionDef)):
            for node in ast.walk(method):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                    else []
                )
                for target in targets:
                    for part in ast.walk(target):
                        if (
                            isinstance(part, ast.Attribute)
                            and isinstance(part.value, ast.Name)
                            and part.value.id == "self"
                        ):
                            every.add(part.attr)
                            if method.name != "__init__":
                                later.add(part.attr)
        found[cls.name] = (every, later)
    return found


def test_the_engines_mutable_state_does_not_grow() -> None:
    """Fields the engine's classes reassign after construction: at most ``MUTABLE_FIELDS``.

    A field set once in ``__init__`` is a part; one assigned again later is state someone must
    keep right. Fewer of them, each owned by the class whose invariant it is.
    """
    later = {
        f"{module}.{name}.{field}"
        for module in ENGINE
        for name, (_, fields) in _fields(module).items()
        for field in fields
    }
    assert len(later) <= MUTABLE_FIELDS, sorted(later)


def test_no_engine_module_writes_the_lineages_fields() -> None:
    """The lineage changes through its verbs: nothing outside it assigns ``lineage.x``."""
    writes = {
        f"{module}:{node.lineno}"
        for module in ENGINE
        if module != "_engine/lineage.py"
        for node in ast.walk(ast.parse((PACKAGE / module).read_text()))
        if isinstance(node, (ast.Assign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for part in ast.walk(target)
        if isinstance(part, ast.Attribute)
        and isinstance(part.value, (ast.Name, ast.Attribute))
        and (part.value.id if isinstance(part.value, ast.Name) else part.value.attr)
        in ("lineage", "_lineage")
    }
    assert set() == writes


def test_prefetch_takes_exactly_the_prefetchers_arguments() -> None:
    """``prefetch()`` spells out ``Prefetcher``'s parameters (help() and IDEs show them there).

    Written twice on purpose, so a test keeps the two the same: names, kinds, defaults and
    annotations.
    """
    import inspect

    theirs = list(inspect.signature(nostall.Prefetcher.__init__).parameters.values())[1:]
    assert list(inspect.signature(nostall.prefetch).parameters.values()) == theirs
