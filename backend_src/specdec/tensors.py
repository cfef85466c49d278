"""Request tensors → Python values, with errors that name the field.

Owns the checks every Triton adapter repeats: a tensor that should hold one number
or one string per request, its type and shape, and splitting a request of several
batch entries (TensorRT-LLM's batch size > 1) into one getter per entry. Works on numpy arrays only (the
adapters pass `tensor.as_numpy()`), never imports Triton. With `max_batch_size > 0`
a per-request scalar arrives as shape `[1, 1]`, with `max_batch_size: 0` as `[1]`;
both are accepted.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .errors import InputError, validate_that

_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string"}


def scalar(array: Optional[np.ndarray], field: str, kind: str, default=None):
    """The single value of `array` as int/float/bool/str; `default` when the input is absent."""
    assert kind in _KINDS, kind
    if array is None:
        return default
    array = np.asarray(array)
    validate_that(array.size == 1,
                  f"{field} must hold exactly one value per request, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if kind == "str":
        validate_that(isinstance(value, (bytes, str)), f"{field} must be {_KINDS[kind]}")
        try:
            return value.decode("utf-8") if isinstance(value, bytes) else value
        except UnicodeDecodeError as e:
            raise InputError(f"{field} is not valid UTF-8: {e}") from None
    if kind == "bool":
        validate_that(array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer),
                      f"{field} must be {_KINDS[kind]}, got {array.dtype}")
        return bool(value)
    if kind == "int":
        validate_that(np.issubdtype(array.dtype, np.integer),
                      f"{field} must be {_KINDS[kind]}, got {array.dtype}")
        return int(value)
    validate_that(np.issubdtype(array.dtype, np.number), f"{field} must be {_KINDS[kind]}, got {array.dtype}")
    value = float(value)
    validate_that(np.isfinite(value), f"{field} must be finite, got {value}")
    return value


def token_ids(array: Optional[np.ndarray], field: str) -> list[int]:
    """A request's token ids from `[L]` or `[1, L]` (the batch dim)."""
    validate_that(array is not None, f"{field} is required")
    array = np.asarray(array)
    validate_that(np.issubdtype(array.dtype, np.integer), f"{field} must be integer token ids, got {array.dtype}")
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    validate_that(array.ndim == 1, f"{field} must have shape [L] per request, got {list(array.shape)}")
    return array.astype(np.int64).tolist()


def strings(array: Optional[np.ndarray]) -> list[bytes]:
    """All strings of a BYTES tensor of any shape (absent → [])."""
    if array is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode() for v in np.asarray(array).reshape(-1)]


Getter = Callable[[str], Optional[np.ndarray]]


def row_getters(get: Getter, n: int, field: Callable[[str], str] = str) -> list[Getter]:
    """One getter per batch entry of a request of `n` entries: each gives every input's row
    of that entry, `[1, ...]`, and refuses an input with another number of rows (named by
    `field(input name)`). With `n == 1` the request's own getter is returned."""
    if n == 1:
        return [get]

    def row_getter(row: int) -> Getter:
        def get_row(name: str) -> Optional[np.ndarray]:
            array = get(name)
            if array is None:
                return None
            validate_that(array.ndim >= 1 and array.shape[0] == n,
                          f"{field(name)} has shape {list(array.shape)}, but the request has {n} batch "
                          f"entries and every input needs one row per entry")
            return array[row:row + 1]
        return get_row

    return [row_getter(row) for row in range(n)]
