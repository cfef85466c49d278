"""specdec.triton_glue against a stand-in for the Python backend's `pb_utils`.

The real module exists only inside Triton's stub process; the end-to-end tests cover
the same helpers there (a 400 names the field, a busy engine answers 503).
"""
from types import SimpleNamespace

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.triton_glue import ERROR_CODES, error_code_name, input_reader, respond_each, triton_error


class _Error:
    def __init__(self, message, code=None):
        self.message, self._code = message, code

    def code(self):
        return self._code


def _backend(with_codes: bool):
    error = type("TritonError", (_Error,), {name: 100 + i for i, name in enumerate(ERROR_CODES)} if with_codes else {})
    tensors = {"QUERY": np.array([[b"hi"]], dtype=object)}
    return SimpleNamespace(
        TritonError=error,
        InferenceResponse=lambda output_tensors, error=None: SimpleNamespace(outputs=output_tensors, error=error),
        get_input_tensor_by_name=lambda request, name: (
            SimpleNamespace(as_numpy=lambda: tensors[name]) if name in tensors else None))


@pytest.mark.parametrize("code", ERROR_CODES)
def test_an_error_carries_its_code_and_reads_back_by_name(code):
    pb_utils = _backend(with_codes=True)
    error = triton_error(pb_utils, "max_tokens must be >= 1", code)
    assert error.message == "max_tokens must be >= 1"
    assert error.code() == getattr(pb_utils.TritonError, code)
    assert error_code_name(pb_utils, error) == code


def test_a_backend_without_codes_gets_plain_errors_named_internal():
    pb_utils = _backend(with_codes=False)
    error = triton_error(pb_utils, "bad", "UNAVAILABLE")
    assert error.code() is None
    assert error_code_name(pb_utils, error) == "INTERNAL"


def test_an_unknown_code_is_refused():
    with pytest.raises(ValueError, match="INVALID_ARGUMENT"):
        triton_error(_backend(with_codes=True), "bad", "INVALID_ARGUMENT")


def test_inputs_read_as_arrays_and_absent_ones_as_none():
    get = input_reader(_backend(with_codes=True), request=object())
    assert get("QUERY").tolist() == [[b"hi"]]
    assert get("STOP_WORDS_DICT") is None


def test_a_bad_request_gets_its_own_400_and_the_rest_of_the_batch_is_answered():
    pb_utils = _backend(with_codes=True)

    def outputs_of(request):
        if request < 0:
            raise InputError(f"max_tokens must be >= 1, got {request}")
        return [request * 10]

    responses = respond_each(pb_utils, [1, -2, 3], outputs_of)
    assert [r.outputs for r in responses] == [[10], [], [30]]
    assert [r.error is None for r in responses] == [True, False, True]
    assert responses[1].error.message == "max_tokens must be >= 1, got -2"
    assert error_code_name(pb_utils, responses[1].error) == "INVALID_ARG"


def test_an_unexpected_failure_is_not_turned_into_a_400():
    def outputs_of(request):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        respond_each(_backend(with_codes=True), [1], outputs_of)
