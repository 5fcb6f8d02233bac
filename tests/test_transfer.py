"""to_device and pin_memory: every container keeps its type; leaves move or stay as they should.

The meta device stands in for a GPU on machines without one: moving there changes every tensor
visibly, so a tensor left behind shows.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import nostall
from nostall import DeviceUnavailableError

META = torch.device("meta")


def on_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


PlainPair = namedtuple("PlainPair", ["a", "b"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    meta: dict[str, Any]
    note: str = "n"


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedSample:
    image: torch.Tensor


class TaggedList(list[Any]):
    tag = "class"
    extra: str  # set on an instance by a test: instance attributes travel too


class TaggedTuple(tuple[Any, ...]):
    pass


class ReadOnly(Mapping[str, Any]):
    """An immutable Mapping that is not a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Movable:
    """A batch type with its own .to() that accepts non_blocking."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.calls: list[dict[str, Any]] = []

    def to(self, device: Any, non_blocking: bool = False) -> Movable:
        out = Movable(self.t.to(device))
        out.calls = [*self.calls, {"device": device, "non_blocking": non_blocking}]
        return out


class OldMovable:
    """A batch type whose .to() does not accept non_blocking."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> OldMovable:
        return OldMovable(self.t.to(device))


def test_tensor() -> None:
    """A bare tensor moves, dtype kept."""
    out = nostall.cuda.to_device(torch.ones(3, dtype=torch.bfloat16), META)
    assert on_meta(out)
    assert torch.bfloat16 == out.dtype


def test_builtin_containers_fast_path() -> None:
    """tuple, list and dict are rebuilt as themselves, nested."""
    batch = ([torch.ones(1)], {"a": (torch.ones(1), 3)}, torch.zeros(2))
    out = nostall.cuda.to_device(batch, "meta")
    assert type(out) is tuple
    assert type(out[0]) is list
    assert on_meta(out[0][0])
    assert type(out[1]) is dict
    assert on_meta(out[1]["a"][0])
    assert 3 == out[1]["a"][1]
    assert on_meta(out[2])


@pytest.mark.parametrize("leaf", ["text", b"bytes", 3, 2.5, True, None, 1j])
def test_atoms_unchanged(leaf: Any) -> None:
    """str, bytes, numbers and None come back as the same object."""
    assert nostall.cuda.to_device([leaf], META)[0] is leaf


def test_numpy_array_is_a_leaf() -> None:
    """Non-tensor leaves pass through unchanged."""
    arr = np.arange(3)
    assert nostall.cuda.to_device({"a": arr}, META)["a"] is arr


def test_ordered_dict_keeps_type_and_order() -> None:
    """OrderedDict stays an OrderedDict with its key order."""
    batch = OrderedDict([("z", torch.ones(1)), ("a", 1)])
    out = nostall.cuda.to_device(batch, META)
    assert type(out) is OrderedDict
    assert ["z", "a"] == list(out)
    assert on_meta(out["z"])


def test_defaultdict_keeps_its_factory() -> None:
    """defaultdict keeps default_factory."""
    batch: defaultdict[str, Any] = defaultdict(list, {"x": torch.ones(1)})
    out = nostall.cuda.to_device(batch, META)
    assert type(out) is defaultdict
    assert list is out.default_factory
    assert on_meta(out["x"])
    assert [] == out["missing"]


def test_mapping_that_is_not_a_dict() -> None:
    """Other Mapping types are rebuilt from a dict of their moved values."""
    out = nostall.cuda.to_device(ReadOnly({"x": torch.ones(1)}), META)
    assert type(out) is ReadOnly
    assert on_meta(out["x"])


def test_namedtuples() -> None:
    """typing.NamedTuple and collections.namedtuple keep their type and fields."""
    out = nostall.cuda.to_device([Pair(torch.ones(1), 4), PlainPair(torch.ones(1), "b")], META)
    assert type(out[0]) is Pair
    assert on_meta(out[0].image)
    assert 4 == out[0].label
    assert type(out[1]) is PlainPair
    assert "b" == out[1].b


def test_list_and_tuple_subclasses() -> None:
    """Subclasses keep their type and instance attributes."""
    batch = TaggedList([torch.ones(1)])
    batch.extra = "kept"
    out = nostall.cuda.to_device((batch, TaggedTuple([torch.ones(1)])), META)
    assert type(out[0]) is TaggedList
    assert "kept" == out[0].extra
    assert on_meta(out[0][0])
    assert type(out[1]) is TaggedTuple
    assert on_meta(out[1][0])


def test_dataclasses_plain_frozen_and_slotted() -> None:
    """Dataclass instances are copied with moved fields; frozen and slotted ones too."""
    out = nostall.cuda.to_device(
        [
            Sample(torch.ones(1), {"m": torch.ones(1)}),
            FrozenSample(torch.ones(1), 2),
            SlottedSample(torch.ones(1)),
        ],
        META,
    )
    assert type(out[0]) is Sample
    assert on_meta(out[0].image)
    assert on_meta(out[0].meta["m"])
    assert "n" == out[0].note
    assert type(out[1]) is FrozenSample
    assert on_meta(out[1].image)
    assert 2 == out[1].label
    assert type(out[2]) is SlottedSample
    assert on_meta(out[2].image)


def test_input_is_never_modified() -> None:
    """Every container is copied; the original batch still holds CPU tensors."""
    sample = Sample(torch.ones(1), {"m": torch.ones(1)})
    batch = {"s": sample, "l": [torch.ones(1)]}
    nostall.cuda.to_device(batch, META)
    assert "cpu" == sample.image.device.type
    assert "cpu" == sample.meta["m"].device.type
    assert "cpu" == batch["l"][0].device.type  # type: ignore[index]


def test_object_with_its_own_to_is_called_with_non_blocking() -> None:
    """.to(device, non_blocking=...) is called on objects that define it."""
    out = nostall.cuda.to_device({"m": Movable(torch.ones(1))}, META, non_blocking=True)
    assert on_meta(out["m"].t)
    assert [{"device": META, "non_blocking": True}] == out["m"].calls


def test_object_whose_to_refuses_non_blocking_falls_back() -> None:
    """An object whose .to() takes only the device still moves."""
    out = nostall.cuda.to_device(OldMovable(torch.ones(1)), META, non_blocking=True)
    assert on_meta(out.t)


def test_own_to_wins_over_walking() -> None:
    """A dict subclass with its own .to() (like a tokenizer's BatchEncoding) is not walked."""

    class Encoding(dict[str, Any]):
        def to(self, device: Any, non_blocking: bool = False) -> str:
            return f"moved by itself to {device}"

    moved: object = nostall.cuda.to_device(Encoding(a=torch.ones(1)), META)  # its .to()'s str
    assert "moved by itself to meta" == moved


def test_unrebuildable_container_says_how_to_fix() -> None:
    """A tuple subclass that cannot be rebuilt from its items gets a clear TypeError."""

    class Strict(tuple[Any, ...]):
        def __new__(cls, a: Any, b: Any) -> Strict:
            return super().__new__(cls, (a, b))

    with pytest.raises(TypeError, match=r"cannot rebuild a .*Strict.*give .*\.to\(device"):
        nostall.cuda.to_device(Strict(torch.ones(1), 2), META)


def test_to_device_rejects_an_unavailable_device() -> None:
    """The device is checked with the same clear error as prefetch()."""
    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    with pytest.raises(DeviceUnavailableError):
        nostall.cuda.to_device(torch.ones(1), "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_pin_memory_without_cuda_says_why() -> None:
    """Pinning needs CUDA; the error says so and what to do."""
    with pytest.raises(DeviceUnavailableError, match="pin_memory\\(\\) needs CUDA"):
        nostall.cuda.pin_memory(torch.ones(1))


def test_pin_memory_walks_and_calls_own_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_memory pins every CPU tensor and calls objects' own .pin_memory()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pinned: list[torch.Tensor] = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t)
        return t.clone()

    monkeypatch.setattr("nostall.cuda._transfer._pin_tensor", fake_pin)

    class Custom:
        def pin_memory(self) -> str:
            return "pinned by itself"

    a, b = torch.ones(1), torch.zeros(2)
    out = nostall.cuda.pin_memory({"a": a, "rest": (b, Custom(), "s")})
    assert [a, b] == pinned
    rest = out["rest"]
    assert isinstance(rest, tuple)
    assert "pinned by itself" == rest[1]
    assert "s" == rest[2]


def test_iter_tensors_finds_tensors_inside_objects() -> None:
    """Tensors inside containers, dataclasses and plain objects' attributes are found once."""
    from nostall.cuda._tree import iter_tensors

    shared = torch.ones(1)
    obj = Movable(shared)
    found = list(iter_tensors([obj, {"x": shared}, Sample(torch.zeros(1), {}), "s", 3]))
    assert 3 == len(found)
    assert sum(t is shared for t in found) == 2


def _sparse_and_nested() -> dict[str, tuple[torch.Tensor, int]]:
    """Each kind of tensor with its own memory layout, and how many dense parts hold it."""
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    parts = [torch.ones(2, 3), torch.ones(4, 3)]
    return {
        "dense": (torch.ones(3), 1),
        "coo": (coo, 2),
        "csr": (coo.to_sparse_csr(), 3),
        "csc": (coo.to_sparse_csc(), 3),
        "jagged": (torch.nested.nested_tensor(parts, layout=torch.jagged), 2),
        "strided nested": (torch.nested.nested_tensor(parts), 2),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # beta/prototype notices of sparse, nested
@pytest.mark.parametrize("kind", ["dense", "coo", "csr", "csc", "jagged", "strided nested"])
def test_record_stream_reaches_the_memory_of_sparse_and_nested_tensors(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """record_stream needs storage: sparse and nested tensors are recorded through their parts."""
    from nostall.cuda._transfer import record_stream

    tensor, count = _sparse_and_nested()[kind]
    recorded: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: recorded.append(t))
    record_stream(tensor, "stream")  # type: ignore[arg-type]
    assert len(recorded) == count
    for part in recorded:
        assert part.layout == torch.strided
        assert not part.is_nested
        part.untyped_storage()  # each part has storage, which record_stream needs
    held = {p.untyped_storage().data_ptr() for p in recorded}
    if kind == "dense":
        assert recorded == [tensor]
    elif kind == "jagged":
        assert tensor.values().untyped_storage().data_ptr() in held


def test_compact_leaves_tensor_subclasses_as_they_are() -> None:
    """A subclass (torchvision's tv_tensors) keeps its type and metadata: never compacted."""
    from nostall.cuda._transfer import compact

    class Boxes(torch.Tensor):
        pass

    whole = torch.arange(40.0).reshape(10, 4)
    view = whole[:, ::2]
    assert compact(view).is_contiguous()
    boxes = whole.as_subclass(Boxes)[:, ::2]
    assert compact(boxes) is boxes


def test_compact_asks_a_contiguous_tensor_for_no_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common batch (contiguous) is returned at one C call; only others have spans summed."""
    from nostall.cuda._transfer import compact

    asked: list[int] = []
    stride = torch.Tensor.stride

    def counted(self: torch.Tensor, *args: Any) -> Any:
        asked.append(1)
        return stride(self, *args)

    whole, empty = torch.arange(40.0).reshape(10, 4), torch.zeros(0, 3)
    transposed = whole.t()
    monkeypatch.setattr(torch.Tensor, "stride", counted)
    assert compact(whole) is whole
    assert compact(empty) is empty
    assert asked == []
    assert compact(transposed) is transposed  # not contiguous, but dense: kept as it is
    assert asked == [1]
    assert compact(whole[:, ::2]).is_contiguous()
