"""The transform's state contract: both halves checkpointed, half of it refused at prefetch()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import CountingTransform

import nostall
from nostall import transforms as T
from nostall._transform_state import StatefulTransform, stateful

DATA = [torch.full((2,), float(i)) for i in range(6)]


class SavesOnly:
    """A transform with state_dict() and no load_state_dict()."""

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": 0}


class LoadsOnly:
    """A transform with load_state_dict() and no state_dict()."""

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_a_transform_with_both_methods_is_checkpointed_and_restored() -> None:
    """The state after the last batch handed out is saved, and a resumed run goes on from it."""
    p = nostall.prefetch(DATA, "cpu", transform=CountingTransform())
    got = []
    for batch in p:
        got.append(float(batch[0]))
        if len(got) == 2:
            saved = p.state_dict()
    assert {"seen": 2} == saved["transform"]
    resumed = nostall.prefetch(DATA, "cpu", transform=CountingTransform())
    resumed.load_state_dict(saved)
    assert got[2:] == [float(b[0]) for b in resumed]


def test_a_transform_with_only_state_dict_is_refused_at_prefetch() -> None:
    """Its state would be saved and never restored: a TypeError names the argument and the fix."""
    with pytest.raises(TypeError, match=r"transform= has state_dict\(\) but no load_state_dict"):
        nostall.prefetch(DATA, "cpu", transform=SavesOnly())


def test_the_refusal_of_a_half_contract_says_what_to_add() -> None:
    """The message names the type received and the method to give it."""
    with pytest.raises(
        TypeError, match=r"a SavesOnly\).*Give SavesOnly a load_state_dict\(state\)"
    ):
        nostall.Prefetcher(DATA, "cpu", transform=SavesOnly())


def test_a_transform_with_only_load_state_dict_is_refused_at_prefetch() -> None:
    """No checkpoint would hold its state: a resume would start it afresh, silently."""
    with pytest.raises(TypeError, match=r"transform= has load_state_dict\(\) but no state_dict"):
        nostall.prefetch(DATA, "cpu", transform=LoadsOnly())


@pytest.mark.parametrize("transform", [None, lambda batch: batch * 2], ids=["none", "lambda"])
def test_a_transform_without_state_has_nothing_to_keep(transform: Any) -> None:
    """No state_dict(), no load_state_dict(): not stateful, and not refused."""
    assert stateful(transform) is None


@pytest.mark.parametrize(
    "transform",
    [T.Normalize([0.5], [0.5]), T.Compose([T.RandomHorizontalFlip(seed=0)]), torch.nn.Identity()],
    ids=["Normalize", "Compose", "nn.Module"],
)
def test_nostalls_transforms_and_modules_keep_the_contract(transform: Any) -> None:
    """Every nostall transform, and a torch module, is a StatefulTransform."""
    assert isinstance(transform, T.StatefulTransform)
    assert stateful(transform) is transform


def test_the_protocol_is_exported_from_the_transforms_package() -> None:
    """Users can annotate and check their own transforms against it."""
    assert T.StatefulTransform is StatefulTransform
