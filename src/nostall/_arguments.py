"""Checking what users pass: ``TypeError`` for a wrong type, ``ValueError`` for a wrong value.

Every message names the argument (as ``owner(name=...)``), shows what was received and its
type, and says what to pass. ``bool`` is never accepted where a number is meant.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

# torch is imported where a check needs it, not here: the command line's flags (flag_count and
# the others) are parsed by `nostall --help` and `--version`, which must not load torch.


def kind(value: object) -> str:
    """``'an int'``, ``'a float'``: the type of ``value``, with its article."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def received(value: object) -> str:
    """``'got 1.5, a float'``: the value (shortened) and its type."""
    return f"got {value!r:.80}, {kind(value)}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def not_batches(value: object) -> str | None:
    """What iterating ``value`` yields when it is iterable but not batches, else None.

    ``'its characters'`` for a str, ``'its rows'`` for a tensor, ``'its keys'`` for a mapping:
    one batch, or one sample, passed where the loader of many was meant. A map-style
    ``Dataset`` iterated through ``__getitem__`` yields its samples one at a time: a model
    would train on batches of one, or fail on their shape far from the cause.
    """
    import torch
    from torch.utils.data import Dataset

    if isinstance(value, Dataset) and getattr(type(value), "__iter__", None) is None:
        return "its samples, one at a time (not batches: a Dataset is what a DataLoader loads)"
    if not isinstance(value, (str, bytes, bytearray, Mapping, torch.Tensor)):
        return None
    what = {
        str: "its characters",
        bytes: "its bytes",
        bytearray: "its bytes",
        torch.Tensor: "its rows",
    }
    return next((v for k, v in what.items() if isinstance(value, k)), "its keys")


def source(value: object, owner: str = "nostall.prefetch") -> None:
    """An iterable of batches (a DataLoader, a list...), not one batch or a container of keys."""
    from torch.utils.data import Dataset

    cls = type(value)
    yields = not_batches(value)
    if yields is not None:
        fix = (
            "pass DataLoader(dataset, batch_size=...) over it"
            if isinstance(value, Dataset)
            else "pass a DataLoader over your data, or a list of batches (e.g. "
            "list(tensor.split(batch_size)))"
        )
        raise TypeError(
            f"{owner}(source) needs an iterable of batches such as a DataLoader (got a "
            f"{cls.__qualname__}, whose iteration yields {yields}); {fix}"
        )
    if callable(getattr(cls, "__iter__", None)) or callable(getattr(cls, "__getitem__", None)):
        return
    raise TypeError(
        f"{owner}(source) needs an iterable source such as a DataLoader ({received(value)}"
        f"); pass the loader itself, not one of its batches"
    )


def depth(value: object) -> None:
    """An int >= 1 or ``"auto"``."""
    if value == "auto" and isinstance(value, str):
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f'nostall.prefetch(depth=...) must be an int >= 1 or "auto" ({received(value)}); '
            f"pass e.g. depth=2, the number of batches fetched ahead"
        )
    if value < 1:
        raise ValueError(
            f'nostall.prefetch(depth=...) must be >= 1 or "auto" (got depth={value}); pass '
            f"e.g. depth=2, the number of batches fetched ahead"
        )


def timeout(value: object) -> None:
    """None or a number of seconds > 0."""
    if value is None:
        return
    if not _is_number(value):
        raise TypeError(
            f"nostall.prefetch(timeout=...) must be None or a number of seconds "
            f"({received(value)}); pass e.g. timeout=60.0"
        )
    assert isinstance(value, (int, float))
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"nostall.prefetch(timeout=...) must be None or a number of seconds > 0 (got "
            f"timeout={value}); pass e.g. timeout=60.0"
        )


def flag(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """``True`` or ``False`` (or ``None`` where ``optional``)."""
    if isinstance(value, bool) or (optional and value is None):
        return
    choices = "True, False or None" if optional else "True or False"
    raise TypeError(f"{owner}({name}=...) must be {choices} ({received(value)})")


def dtype(owner: str, name: str, value: object, *, floating: bool) -> torch.dtype:
    """A ``torch.dtype`` (a floating one where ``floating``)."""
    import torch

    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{owner}({name}=...) must be a torch.dtype ({received(value)}); pass e.g. "
            f"{name}=torch.float16"
        )
    if floating and not value.is_floating_point:
        raise ValueError(
            f"{owner}({name}=...) must be a floating-point dtype (got {value}); pass "
            f"torch.float32, torch.bfloat16 or torch.float16"
        )
    return value


def number(owner: str, name: str, value: object) -> float:
    """An int or a float."""
    if not _is_number(value):
        raise TypeError(f"{owner}({name}=...) must be a number ({received(value)})")
    assert isinstance(value, (int, float))
    return float(value)


def numbers(owner: str, name: str, value: object) -> tuple[float, ...]:
    """A non-empty sequence of numbers."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise TypeError(
            f"{owner}({name}=...) must be a non-empty sequence of numbers ({received(value)})"
        )
    return tuple(number(owner, f"{name}[{i}]", v) for i, v in enumerate(value))


def pair(owner: str, name: str, value: object) -> tuple[float, float]:
    """Two numbers (low, high)."""
    values = numbers(owner, name, value)
    if len(values) != 2:
        raise ValueError(f"{owner}({name}=...) needs two numbers (low, high), got {value!r}")
    return values[0], values[1]


def size(owner: str, name: str, value: object) -> tuple[int, int]:
    """An int > 0 or a pair of them (height, width)."""
    sides = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(sides, Sequence)
        or isinstance(sides, str)
        or len(sides) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in sides)
    ):
        raise TypeError(
            f"{owner}({name}=...) must be an int or a pair of ints (height, width) "
            f"({received(value)}); pass e.g. {name}=224"
        )
    if sides[0] <= 0 or sides[1] <= 0:
        raise ValueError(f"{owner}({name}=...) must be > 0 (got {name}={value!r})")
    return int(sides[0]), int(sides[1])


def integer(owner: str, name: str, value: object, *, low: int, example: int) -> int:
    """An int >= ``low`` (``bool`` refused: ``True`` is no count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}({name}=...) must be an int >= {low} ({received(value)}); pass e.g. "
            f"{name}={example}"
        )
    if value < low:
        raise ValueError(
            f"{owner}({name}=...) must be >= {low} (got {name}={value}); pass e.g. {name}={example}"
        )
    return value


def function(owner: str, name: str, value: object, *, optional: bool = False, hint: str) -> None:
    """A callable (or ``None`` where ``optional``); ``hint`` says what to pass instead."""
    if callable(value) or (optional and value is None):
        return
    choices = "a function or None" if optional else "a function"
    raise TypeError(f"{owner}({name}=...) must be {choices} ({received(value)}); {hint}")


# -- command-line flags (argparse types) -------------------------------------------------------

N = TypeVar("N", int, float)


def flag_number(kind: Callable[[str], N], low: float, strict: bool) -> Callable[[str], N]:
    """An argparse type: a number of ``kind`` >= ``low`` (> ``low`` when ``strict``)."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low or (strict and value == low):
            bound = f"> {low:g}" if strict else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound} (got {text})")
        return value

    return parse


def flag_list(kind: Callable[[str], N]) -> Callable[[str], tuple[N, ...]]:
    """An argparse type: a comma-separated list of ``kind``."""

    def parse(text: str) -> tuple[N, ...]:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except argparse.ArgumentTypeError:
            raise
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list: {text!r}") from None

    return parse


#: A command-line count (an int >= 1), and a number > 0.
flag_count = flag_number(int, 1, strict=False)
flag_positive = flag_number(float, 0, strict=True)
