"""What a source is: decided once, by ``nostall._sources.sources.classify``, and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader, IterableDataset

import nostall
from nostall._sources.sources import Client, classify

PACKAGE = Path(nostall.__file__).parent

#: Ways of asking a source's type. Only ``_sources`` asks them of a source; the clients'
#: modules define their own recognisers (``is_fabric_loader``, ``is_prepared_shard``) and
#: use them inside, and ``_sources`` calls them.
_TYPE_QUESTIONS = re.compile(
    r"isinstance\([^)]*\b(DataLoader|IterableDataset|Iterator)\)"
    r"|issubclass\(type\("
    r"|\b(is_prepared_shard|is_fabric_loader|prepared_loader_types|is_dispatcher)\("
)
_RECOGNISERS = {"_sources/sources.py", "_clients/fabric.py", "_clients/accelerate.py"}


def test_no_module_but_sources_asks_what_a_source_is() -> None:
    """Every "is it a DataLoader?" in the package is asked in ``_sources`` (or a recogniser)."""
    asked = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name in _RECOGNISERS:
            continue
        lines = [
            f"{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if _TYPE_QUESTIONS.search(line) and not line.lstrip().startswith(("#", "def "))
        ]
        if lines:
            asked[name] = lines
    assert {} == asked


def test_the_recognisers_are_called_only_by_sources_and_their_own_module() -> None:
    """``fabric``'s and ``accelerate``'s recognisers are not asked by each other."""
    for own, others in (
        ("_clients/fabric.py", "is_prepared_shard("),
        ("_clients/accelerate.py", "is_fabric_"),
    ):
        assert others not in (PACKAGE / own).read_text()


class _Stream(IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def test_a_map_style_loader() -> None:
    """A DataLoader over a list: counted, skippable, loadable by threads."""
    loader = DataLoader(as_dataset(list(range(8))), batch_size=2)
    kind = classify(loader)
    assert kind.loader is loader
    assert kind.inner is loader
    assert (kind.client, kind.map_style, kind.torch_iteration) == (Client.PLAIN, True, True)
    assert (kind.counted, kind.skippable, kind.one_shot, kind.stateful) == (
        True,
        True,
        False,
        False,
    )
    assert (kind.workers, kind.persistent, kind.restarts_workers) == (0, False, False)


def test_an_iterable_dataset_loader_estimates_its_length() -> None:
    """A DataLoader over an IterableDataset: its len() is not a count; no sampler to skip by."""
    kind = classify(DataLoader(_Stream(), batch_size=2))
    assert (kind.map_style, kind.counted, kind.skippable) == (False, False, False)
    assert classify(_Stream()).iterable_dataset


def test_workers_are_read_when_asked() -> None:
    """``num_workers`` set on the loader after classifying is what the kind answers."""
    loader = DataLoader(as_dataset(list(range(8))), batch_size=2)
    kind = classify(loader)
    loader.num_workers = 2
    assert (kind.workers, kind.restarts_workers, kind.skippable) == (2, True, True)


def test_persistent_workers_keep_their_draws() -> None:
    """A loader with persistent workers is not skipped through a copy (its draws would move)."""
    loader = DataLoader(
        as_dataset(list(range(8))), batch_size=2, num_workers=1, persistent_workers=True
    )
    kind = classify(loader)
    assert (kind.persistent, kind.restarts_workers, kind.skippable) == (True, False, False)


class Countdown:
    """An iterator as most are written: ``__iter__`` returns it, and nothing more."""

    def __init__(self) -> None:
        self.left = 3

    def __iter__(self) -> Countdown:
        """Itself."""
        return self

    def __next__(self) -> int:
        if not self.left:
            raise StopIteration
        self.left -= 1
        return self.left


class Restarting(Countdown):
    """An iterator whose ``__iter__`` starts it again, as Ray Train's prepared loader's does."""

    def __iter__(self) -> Restarting:
        self.left = 3
        return self


@pytest.mark.parametrize(
    ("source", "one_shot", "counted"),
    [
        ([torch.zeros(1)], False, True),
        ((torch.zeros(1),), False, True),
        (iter([torch.zeros(1)]), True, False),
        ((x for x in range(3)), True, False),
        (map(int, "123"), True, False),
        (Countdown(), True, False),
        (Restarting(), False, False),
        (range(3), False, False),
    ],
    ids=["list", "tuple", "list-iterator", "generator", "map", "iterator", "restarting", "range"],
)
def test_plain_iterables(source: object, one_shot: bool, counted: bool) -> None:
    """Lists and tuples are counted; an iterator is one-shot unless ``__iter__`` restarts it."""
    kind = classify(source)
    assert (kind.loader, kind.one_shot, kind.counted) == (None, one_shot, counted)


def test_a_source_with_its_own_state_is_stateful() -> None:
    """``state_dict`` and ``load_state_dict`` both: the source resumes itself."""

    class Own:
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(())

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    assert classify(Own()).stateful
    assert not classify([1]).stateful


def test_a_subclass_with_its_own_iteration_is_not_torchs() -> None:
    """A DataLoader subclass overriding ``__iter__`` cannot be loaded by threads."""

    class Own(DataLoader[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return super().__iter__()

    kind = classify(Own(as_dataset([1, 2])))
    assert (kind.dataloader_type, kind.torch_iteration) == (True, False)
