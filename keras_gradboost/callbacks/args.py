"""Checks of the callbacks' arguments, with one rule and Keras-style messages.

An argument of the wrong type raises `ArgumentTypeError` (a `TypeError`):
"Invalid type for argument `x`. Received: x=... of type T. Expected ...". An
argument of the right type with a value outside what is accepted raises
`ValueError`: "Invalid value for argument `x`. Received: x=.... Expected ...".
Each check returns the normalised value.
"""

import numbers
import os


class ArgumentTypeError(TypeError):
    """An argument of the wrong type (a `TypeError`)."""


def type_error(name, value, expected):
    """The `ArgumentTypeError` for argument `name`; `expected` completes
    "Expected ..."."""
    return ArgumentTypeError(
        f"Invalid type for argument `{name}`. Received: {name}={value!r} "
        f"of type {type(value).__name__}. Expected {expected}."
    )


def value_error(name, value, expected):
    """The `ValueError` for argument `name`; `expected` completes
    "Expected ..."."""
    return ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        f"Expected {expected}."
    )


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name, value, minimum, allow_none=False):
    """An int (not a bool) >= `minimum`, or None when `allow_none`."""
    if minimum == 1:
        expected = "a positive int"
    else:
        expected = f"an int >= {minimum}"
    if allow_none:
        expected += " or None"
        if value is None:
            return None
    if not _is_int(value):
        raise type_error(name, value, expected)
    if value < minimum:
        raise value_error(name, value, expected)
    return value


def check_number(name, value, above=None, below=None):
    """A real number (not a bool) strictly between `above` and `below`
    (either bound may be None); returned as a float."""
    if above is not None and below is not None:
        expected = f"a float in ({above:g}, {below:g})"
    elif above is not None:
        expected = f"a float > {above:g}"
    elif below is not None:
        expected = f"a float < {below:g}"
    else:
        expected = "a float"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise type_error(name, value, expected)
    if (above is not None and not value > above) or (
        below is not None and not value < below
    ):
        raise value_error(name, value, expected)
    return float(value)


def check_choice(name, value, choices):
    """One of `choices` (strings)."""
    expected = f"one of {', '.join(map(repr, choices))}"
    if not isinstance(value, str):
        raise type_error(name, value, expected)
    if value not in choices:
        raise value_error(name, value, expected)
    return value


def check_bool(name, value):
    """A bool (an int 0/1 is not accepted: it is often a typo for a count)."""
    if not isinstance(value, bool):
        raise type_error(name, value, "a bool")
    return value


def check_verbose(value):
    """`verbose`: 0 (silent) or 1 (print); a bool counts as 0/1."""
    expected = "0 (silent) or 1 (print)"
    if not isinstance(value, int):  # bool is an int
        raise type_error("verbose", value, expected)
    if value not in (0, 1):
        raise value_error("verbose", value, expected)
    return int(value)


def check_directory(name, value):
    """A directory argument: None, a str or an os.PathLike (not created
    here); returned as a str or None."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise type_error(
            name, value, "a directory path (str or os.PathLike) or None"
        )
    if isinstance(value, str) and not value:
        raise value_error(name, value, "a directory path or None")
    return None if value is None else os.fspath(value)


def check_int_pair(name, value):
    """`(first, last)`: two ints with 0 <= first <= last (a tuple or a
    list); returned as a tuple."""
    expected = "a pair of ints (first, last) with 0 <= first <= last"
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise type_error(name, value, expected)
    if len(value) != 2 or not 0 <= value[0] <= value[1]:
        raise value_error(name, value, expected)
    return tuple(value)
