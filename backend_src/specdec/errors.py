"""The engine's error types and the one validation helper.

`InputError` is the caller's fault (bad request field): the Triton adapter turns it
into an INVALID_ARG error (HTTP 400) and the model stays healthy. `BusyError` is a
full request queue, nobody's fault: the adapter answers UNAVAILABLE (HTTP 503), and
the same request may succeed later. `ConfigError` is a broken deployment (bad config,
missing weights): the model refuses to load with it.
"""
from __future__ import annotations


class InputError(ValueError):
    """A request field is wrong; the message names the field and what was expected."""


class BusyError(Exception):
    """The engine cannot take the request now (its queue is full); retrying later may work."""


class ConfigError(RuntimeError):
    """The model's configuration or checkpoints are unusable; raised at load time."""


def validate_that(condition: bool, message: str) -> None:
    """Raises `InputError(message)` unless `condition` holds."""
    if not condition:
        raise InputError(message)
