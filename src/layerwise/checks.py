"""Checks for numeric settings of config objects: one wording for "must be a positive int / number" everywhere.

Example::

    >>> positive_ints(epochs=3, batch_size=32)
    >>> positive_ints(epochs=0)
    Traceback (most recent call last):
    ValueError: epochs must be a positive int, got 0
"""

from __future__ import annotations

from .errors import SpecError


def positive_ints(**values: object) -> None:
    """``ValueError`` naming the first value that is not an int >= 1 (bools are refused; ``None`` is not allowed)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{name} must be a positive int, got {value!r}")


def positive_numbers(**values: object) -> None:
    """``ValueError`` naming the first value that is not a number > 0 (e.g. a learning rate)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SpecError(f"{name} must be a positive number (e.g. 1e-3), got {value!r}")
