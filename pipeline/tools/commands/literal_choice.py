"""A command-line word checked against the values of a `Literal` type, typed as that Literal."""

from __future__ import annotations

from typing import TypeVar

Choice = TypeVar("Choice", bound=str)


def pick(word: str, allowed: tuple[Choice, ...]) -> Choice | None:
    """`word` as one of `allowed`, or None when it is none of them."""
    for value in allowed:
        if word == value:
            return value
    return None
