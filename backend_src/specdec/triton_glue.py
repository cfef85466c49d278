"""What the repository's `model.py` files ask of Triton's Python backend: an error with a
status code, a request's inputs as numpy arrays, and one response per request of a batch.

`specdec` never imports Triton: both take the backend's `triton_python_backend_utils`
module (`pb_utils`) as their first argument, so each model.py passes its own.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .errors import InputError

# Status codes of `pb_utils.TritonError`, as the HTTP front end maps them:
# INVALID_ARG → 400, UNAVAILABLE → 503, INTERNAL → 500, CANCELLED → 499.
ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL", "NOT_FOUND", "UNSUPPORTED", "ALREADY_EXISTS")


def triton_error(pb_utils: Any, message: str, code: str = "INVALID_ARG"):
    """A `TritonError` carrying `code`, or a plain one where the backend has no codes
    (Python backends before 23.xx)."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown Triton error code {code!r}; one of {', '.join(ERROR_CODES)}")
    value = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message, value) if value is not None else pb_utils.TritonError(message)


def error_code_name(pb_utils: Any, error) -> str:
    """The name of a `TritonError`'s code (INTERNAL where it has none or an unknown one)."""
    code = error.code() if hasattr(error, "code") else None
    for name in ERROR_CODES:
        if code is not None and code == getattr(pb_utils.TritonError, name, object()):
            return name
    return "INTERNAL"


def input_reader(pb_utils: Any, request) -> Callable[[str], np.ndarray | None]:
    """`get(name)`: the request's input `name` as a numpy array, or None when it was not sent."""
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get


def request_parameters(request) -> str | None:
    """The request's parameters as the backend gives them (a JSON object string); None on
    a Python backend that predates them."""
    read = getattr(request, "parameters", None)
    return None if read is None else read()


def respond_each(pb_utils: Any, requests, outputs_of: Callable[[Any], Sequence]) -> list:
    """One `InferenceResponse` per request, with `outputs_of(request)`'s tensors; a request
    whose inputs raise `InputError` gets an INVALID_ARG (HTTP 400) response of its own and
    the others of the batch are answered as usual."""
    responses = []
    for request in requests:
        try:
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs_of(request)))
        except InputError as e:
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=triton_error(pb_utils, str(e))))
    return responses
