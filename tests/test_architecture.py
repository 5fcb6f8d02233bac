"""The wings and their import rules: which part of nostall may import which.

nostall's private modules live in wings, one package per part of the data path (see
``nostall.__doc__``). A module may be as long as its concept needs, one concept per module; what
holds the architecture is the direction of the imports, checked here for every import of every
module, at the top of a file or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nostall

PACKAGE = Path(nostall.__file__).parent

#: Modules at the top that every wing shares: each imports only others of them.
SHARED = frozenset(
    {
        "_arguments",
        "_device",
        "_exceptions",
        "_exit",
        "_stacks",
        "_thread_bound",
        "_torch_compat",
        "_transform_state",
        "_warn",
    }
)

#: The facade, at the top: ``Prefetcher`` and the loader attributes it forwards.
FACADE = frozenset({"_prefetcher", "_loader_attributes"})

#: Which part may import which, besides itself and the shared modules. Read down the table:
#: a part imports only parts on rows above it, so the wings cannot import in a cycle.
#: ``nostall`` is the package's face (``__init__``, ``__main__``), which may import anything.
MAY_IMPORT: dict[str, frozenset[str]] = {
    # The public GPU toolkit: nested batches moved, devices, timing, streams.
    "cuda": frozenset(),
    # What nostall knows of each framework's loader; nothing here imports a framework.
    "_clients": frozenset(),
    # Host to device: a staged batch, copy streams. Knows no source, epoch or framework.
    "_staging": frozenset({"cuda"}),
    # What the source is (its kind, sampler, draws, shards), decided with the clients' help.
    "_sources": frozenset({"_clients"}),
    # threads=: loading threads over a source's samples.
    "_loading": frozenset({"_sources", "_clients"}),
    # Opening the source's epochs and resuming them. Fabric's iter() count and accelerate's
    # shard mirror are part of an epoch's order: the epoch source drives them through
    # _clients, where each framework's knowledge stays in its one module.
    "_epochs": frozenset({"_loading", "_sources", "_clients"}),
    # The hand-off: producer, channel, iteration, lineage. No client.
    "_engine": frozenset({"_epochs", "_loading", "_sources", "_staging", "cuda"}),
    # Prefetcher. The clients only inside its methods (see LAZY_ONLY).
    "facade": frozenset({"_engine", "_epochs", "_sources", "_staging"}),
    # The public transforms (on the device: cuda's uploads).
    "transforms": frozenset({"cuda"}),
    # nostall.bench: contenders run through the facade and measured with the toolkit; the
    # warning of a source's draws, which a trial expects of its augmented workload; the
    # transforms of the contender that decodes on the device.
    "bench": frozenset({"facade", "_engine", "_sources", "cuda", "transforms"}),
    # doctor, tune, trial, thread safety, specs, the CLI: they run the facade.
    "_tools": frozenset(
        {"nostall", "bench", "facade", "_engine", "_epochs", "_loading", "_sources", "_staging"}
        | {"_clients", "cuda"}
    ),
}

#: Imports a part makes only inside a function, never at import time. The facade asks the
#: clients for what Prefetcher's existing behaviour needs (Fabric's device, accelerate's
#: skip_first_batches route, Lightning's fetcher): when a prefetcher is built or counted.
LAZY_ONLY = frozenset({("facade", "_clients")})

#: Modules held to less than their wing may import. The channel knows nothing of sources,
#: epochs, devices or loading threads: a threaded epoch's pacer reaches it as an observer.
NARROWER: dict[str, frozenset[str]] = {"nostall._engine.channel": frozenset()}


def part_of(module: str) -> str | None:
    """The part ``module`` (``nostall.x.y``) belongs to; None for a module in none."""
    parts = module.split(".")
    if parts[0] != "nostall":
        return None
    if len(parts) == 1 or parts[1] == "__main__":
        return "nostall"
    if parts[1] in SHARED:
        return "shared"
    if parts[1] in FACADE:
        return "facade"
    return parts[1] if parts[1] in MAY_IMPORT else None


def _imported(module: str, is_package: bool, source: str) -> list[tuple[str, int, bool]]:
    """What ``source`` imports of nostall: (module, line, inside a function), each import."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:  # ``from . import x`` imports the module x, if any
                    name = f"{target}.{alias.name}"
                    found.append((name if _exists(name) else target, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(source), False)
    return [(name, line, lazy) for name, line, lazy in found if name.split(".")[0] == "nostall"]


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (the text of ``module``) that the rules above forbid."""
    mine = part_of(module)
    if mine is None or mine == "nostall":
        return []
    allowed = MAY_IMPORT.get(mine, frozenset()) | {mine, "shared"}
    if mine == "shared":
        allowed = frozenset({"shared"})
    bad = []
    for target, line, lazy in _imported(module, is_package, source):
        theirs = part_of(target)
        if module in NARROWER and theirs != "shared":
            ok = theirs in NARROWER[module] or target.startswith(f"nostall.{mine}.")
            ok = ok and target != f"nostall.{mine}"  # not the wing's own package, which is all
        elif (mine, theirs) in LAZY_ONLY:
            ok = lazy
        else:
            ok = theirs in allowed
        if not ok:
            bad.append(f"{module}:{line} imports {target} ({mine} -> {theirs})")
    return bad


def _modules() -> list[tuple[str, bool, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["nostall", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        out.append((".".join(parts[:-1] if is_package else parts), is_package, path))
    return out


def test_every_module_has_its_place() -> None:
    """Each module is in a wing, a shared module, or the facade: none is left over."""
    assert [] == [m for m, _, _ in _modules() if part_of(m) is None]


def test_the_wings_import_only_what_the_table_allows() -> None:
    """Every nostall import of every module, at the top or inside a function, keeps the table."""
    assert [] == [v for m, pkg, path in _modules() for v in violations(m, path.read_text(), pkg)]


def test_the_table_is_acyclic() -> None:
    """Each part imports only parts above it in ``MAY_IMPORT`` (or the face, for the tools)."""
    rows = list(MAY_IMPORT)
    later = {
        row: sorted(other for other in MAY_IMPORT[row] if other in rows[rows.index(row) :])
        for row in rows
    }
    assert {} == {row: others for row, others in later.items() if others}


def test_a_forbidden_import_is_caught() -> None:
    """Canary: the check names a forbidden import, lazy or not, relative or absolute."""
    assert [] != violations(
        "nostall._engine.channel", "def f():\n    from .._loading import pacing\n"
    )
    assert [] != violations("nostall._engine.iteration", "import nostall._clients.fabric\n")
    assert [] != violations("nostall._prefetcher", "from ._clients.fabric import fabric_device\n")
    assert [] == violations(
        "nostall._prefetcher", "def f():\n    from ._clients.fabric import fabric_device\n"
    )
    assert [] != violations("nostall._exceptions", "from ._sources.sources import source_kind\n")
