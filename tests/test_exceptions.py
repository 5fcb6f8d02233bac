"""Notes on the user's own exceptions."""

from __future__ import annotations

from nostall._exceptions import add_note, noted


def test_add_note_without_add_note_support() -> None:
    """On Python 3.10 the note is kept in __notes__ all the same."""

    class OldStyle(Exception):
        add_note = None

    error = OldStyle()
    del OldStyle.add_note
    add_note(error, "first")
    add_note(error, "second")
    assert ["first", "second"] == getattr(error, "__notes__", None)


def test_noted_returns_the_same_object_with_where_it_happened() -> None:
    error = KeyError("k")
    assert noted(error, "raised by next(source) for batch 3") is error
    assert getattr(error, "__notes__", None) == [
        "nostall: raised by next(source) for batch 3; re-raised in the consumer after the "
        "batches before it"
    ]
