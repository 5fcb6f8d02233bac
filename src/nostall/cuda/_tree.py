"""Walking nested batches: apply a function to every tensor, rebuild each container as its own type.

A batch is a tree whose leaves are tensors or other values. Containers are rebuilt with their exact
type: ``tuple``, ``list`` and ``dict`` (fast path), namedtuples, other tuple and list subclasses,
``Mapping`` types (``OrderedDict``, ``defaultdict`` with its factory, other ``Mapping``
subclasses), and dataclass instances (frozen ones too). Objects that bring their own method (a
``.to()`` or ``.pin_memory()``) are handed to ``on_object``. Everything else (str, bytes, numbers,
None, NumPy arrays, arbitrary objects) is a leaf returned unchanged.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Set
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: Returned by an ``on_object`` callback that does not handle the object it was given.
UNHANDLED: Any = object()

TensorFn = Callable[[torch.Tensor], torch.Tensor]
ObjectFn = Callable[[Any], Any]

# Exact types that can never hold a tensor; checked first because they are most leaves.
_ATOMS = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})


def map_tensors(batch: T, on_tensor: TensorFn, on_object: ObjectFn | None = None) -> T:
    """Return ``batch`` with ``on_tensor`` applied to every tensor, every container rebuilt.

    Args:
        batch: any nested structure.
        on_tensor: applied to each tensor leaf; its result takes the tensor's place.
        on_object: tried on every object that is not a tensor, an atom or a built-in container
            before it is walked; returns :data:`UNHANDLED` to let the walk continue.

    The input is never modified: mutable containers are copied, not updated in place.

    Raises:
        ValueError: the walk ran out of Python's recursion limit on a batch nested deeper
            than a quarter of it (:func:`nesting_depth`): a list in a list 5000 deep, say.
            The walk recurses (two or three frames a level) because a depth counter or an
            explicit stack would slow every batch; a ``RecursionError`` of a shallower batch
            (raised by ``on_object``, say) propagates unchanged.
    """
    try:
        # The fast path of _walk, inline: the common batch costs no extra call.
        cls = type(batch)
        if cls is tuple:
            return tuple([_walk(x, on_tensor, on_object) for x in batch])  # type: ignore[attr-defined,return-value]
        if cls is list:
            return [_walk(x, on_tensor, on_object) for x in batch]  # type: ignore[attr-defined,return-value]
        if cls is dict:
            return {k: _walk(v, on_tensor, on_object) for k, v in batch.items()}  # type: ignore[attr-defined,return-value]
        return _walk(batch, on_tensor, on_object)
    except RecursionError as e:
        depth = nesting_depth(batch)
        if depth * 4 < sys.getrecursionlimit():
            raise  # not the batch's depth: someone's own recursion
        raise ValueError(
            f"this batch nests containers {depth} levels deep (its outermost a "
            f"{type(batch).__qualname__}), too deep for nostall's walk under Python's "
            f"recursion limit (sys.getrecursionlimit() = {sys.getrecursionlimit()}). Flatten "
            f"it, or hold the deep part in an object with its own .to(device, "
            f"non_blocking=False) (and .pin_memory()) method, which nostall calls instead of "
            f"walking it"
        ) from e


def _walk(batch: T, on_tensor: TensorFn, on_object: ObjectFn | None) -> T:
    """:func:`map_tensors`, recursively."""
    cls = type(batch)
    if cls is torch.Tensor:
        return on_tensor(batch)  # type: ignore[arg-type,return-value]
    if cls in _ATOMS:
        return batch
    # Fast path: the exact containers that default_collate produces.
    if cls is tuple:
        return tuple([_walk(x, on_tensor, on_object) for x in batch])  # type: ignore[attr-defined,return-value]
    if cls is list:
        return [_walk(x, on_tensor, on_object) for x in batch]  # type: ignore[attr-defined,return-value]
    if cls is dict:
        return {k: _walk(v, on_tensor, on_object) for k, v in batch.items()}  # type: ignore[attr-defined,return-value]
    return _map_other(batch, on_tensor, on_object)  # type: ignore[no-any-return]


def _map_other(batch: Any, on_tensor: TensorFn, on_object: ObjectFn | None) -> Any:
    if isinstance(batch, torch.Tensor):  # subclasses such as nn.Parameter
        return on_tensor(batch)
    if on_object is not None:
        # An object's own method wins over walking it (e.g. a Mapping that defines .to()).
        result = on_object(batch)
        if result is not UNHANDLED:
            return result
    cls = type(batch)
    if isinstance(batch, tuple):
        items = [_walk(x, on_tensor, on_object) for x in batch]
        if hasattr(batch, "_fields"):  # namedtuple: fields are positional arguments
            return cls(*items)
        return _rebuild(cls, items)
    if isinstance(batch, list):
        new_list = copy.copy(batch)  # keeps a subclass's attributes
        new_list[:] = [_walk(x, on_tensor, on_object) for x in batch]
        return new_list
    if isinstance(batch, Mapping):
        new = {k: _walk(v, on_tensor, on_object) for k, v in batch.items()}
        if isinstance(batch, dict):
            # copy.copy keeps the type, a defaultdict's factory and any instance attributes;
            # updating existing keys keeps their order.
            new_dict = copy.copy(batch)
            new_dict.update(new)
            return new_dict
        return _rebuild(cls, new)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        new_obj = copy.copy(batch)
        for field in dataclasses.fields(batch):
            value = _walk(getattr(batch, field.name), on_tensor, on_object)
            object.__setattr__(new_obj, field.name, value)  # works for frozen dataclasses too
        return new_obj
    return batch


def _rebuild(cls: type, contents: Any) -> Any:
    try:
        return cls(contents)
    except Exception as e:
        raise TypeError(
            f"nostall cannot rebuild a {cls.__qualname__} from its moved contents ({e}); give "
            f"{cls.__qualname__} a .to(device, non_blocking=False) method (and .pin_memory() if "
            f"it should be pinned) so that nostall calls it instead of walking the object"
        ) from e


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in ``batch`` in reading order, looking also inside objects' attributes.

    Reading order: depth first, left to right (a tuple's entries, a mapping's values, a
    dataclass's fields, an object's attributes, each in order), so the first tensor of
    ``(images, labels)`` is ``images``. Used to find the tensors an object's own ``.to()``
    produced (to protect them from memory reuse across CUDA streams), to weigh a batch and to
    count its samples. Each object is visited once. Deques, sets and frozensets are looked into
    (in their iteration order), and so are the attributes of a Tensor subclass, which may keep
    more tensors there: an object's ``.to()`` may keep its copies anywhere.
    """
    seen: set[int] = set()
    stack = [batch]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield obj
            if type(obj) is not torch.Tensor and id(obj) not in seen:
                seen.add(id(obj))
                stack.extend(reversed(list(getattr(obj, "__dict__", {}).values())))
            continue
        if type(obj) in _ATOMS or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (tuple, list, collections.deque, Set)):
            children: list[Any] = list(obj)
        elif isinstance(obj, Mapping):
            children = list(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        elif not isinstance(obj, type) and (hasattr(obj, "__dict__") or _slots(obj)):
            children = list(getattr(obj, "__dict__", {}).values())
            # Slotted objects keep their tensors outside __dict__: missing them would leave
            # their memory unprotected from reuse across CUDA streams.
            children += [getattr(obj, name) for name in _slots(obj) if hasattr(obj, name)]
        else:
            continue
        stack.extend(reversed(children))  # popped from the end: the first child comes next


def _slots(obj: Any) -> list[str]:
    """The ``__slots__`` names of ``obj``'s class and its bases (``__dict__``/weakref aside)."""
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


def nesting_depth(batch: Any) -> int:
    """How many containers deep ``batch`` nests (0 for a leaf), walked without recursion.

    Containers are those :func:`map_tensors` walks (tuples, lists, mappings, dataclasses);
    each is counted once, at the depth first found, so a batch that contains itself ends.
    """
    deepest = 0
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(batch, 0)]
    while stack:
        obj, depth = stack.pop()
        if type(obj) in _ATOMS or isinstance(obj, torch.Tensor) or id(obj) in seen:
            continue
        if isinstance(obj, (tuple, list)):
            children: list[Any] = list(obj)
        elif isinstance(obj, Mapping):
            children = list(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        else:
            continue
        seen.add(id(obj))
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def batch_size_of(batch: Any) -> int | None:
    """The number of samples in ``batch``: the first dimension of its first tensor.

    None when the batch holds no tensor, or its first tensor is a scalar.
    """
    for tensor in iter_tensors(batch):
        return int(tensor.shape[0]) if tensor.dim() > 0 else None
    return None
