"""Checks of the callbacks' common arguments, with Keras-style messages."""

import os


def check_verbose(value):
    """`verbose`: 0 (silent) or 1 (print); a bool counts as 0/1."""
    if value not in (0, 1) or not isinstance(value, (int, bool)):
        raise ValueError(
            "Invalid value for argument `verbose`. Received: "
            f"verbose={value!r}. Expected 0 (silent) or 1 (print)."
        )
    return int(value)


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(
            f"Invalid type for argument `{name}`. Received: {name}={value!r} "
            f"of type {type(value).__name__}. Expected a bool."
        )
    return value


def check_directory(name, value):
    """A directory argument: None, a str or an os.PathLike (not created
    here)."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"Invalid type for argument `{name}`. Received: {name}={value!r} "
            f"of type {type(value).__name__}. Expected a directory path (str "
            "or os.PathLike) or None."
        )
    if isinstance(value, str) and not value:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}=''. "
            "Expected a directory path or None."
        )
    return None if value is None else os.fspath(value)
