"""specdec.request_parameters: settings sent as request parameters or in vLLM's
`sampling_parameters` become the arrays their inputs would have held, an input tensor wins
over them, and every bad value is an `InputError` naming the parameter."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specdec.bls import STEPS
from specdec.errors import InputError
from specdec.request_parameters import (SAMPLING_PARAMETERS, ParameterInputs, parameter_array, parse_parameters,
                                        setting_names)
from specdec.tensors import scalar
from specdec.wordlist import split_words

from conftest import ROOT

TEMPLATES = ROOT / "model_repository"


def _config(model: str) -> dict:
    """The `input` block of a template as Triton gives it to `initialize` (JSON)."""
    text = (TEMPLATES / model / "config.pbtxt").read_text()
    block = re.search(r"^input \[(.*?)^\]", text, re.S | re.M).group(1)
    return {"name": model, "input": [{"name": name, "data_type": dtype}
                                     for name, dtype in re.findall(r'name: "(\w+)" data_type: (\S+)', block)]}


def _sampling(obj) -> np.ndarray:
    return np.array([[json.dumps(obj).encode()]], object)


def test_sampling_parameters_win_over_request_parameters_and_null_means_not_sent():
    values = parse_parameters(json.dumps({"temperature": 0.9, "max_tokens": 7, "top_k": 5}),
                              _sampling({"temperature": 0.5, "top_k": None, "seed": 3}))
    assert values == {"temperature": 0.5, "max_tokens": 7, "seed": 3}
    assert parse_parameters(None, None) == {} and parse_parameters("{}", None) == {}
    # vLLM's ignore_eos is TensorRT-LLM's end_id -1; an end_id sent beside it wins
    assert parse_parameters('{"ignore_eos": true}', None) == {"end_id": -1}
    assert parse_parameters(None, _sampling({"ignore_eos": "true", "end_id": 5})) == {"end_id": 5}
    assert parse_parameters('{"ignore_eos": false}', None) == {}
    with pytest.raises(InputError, match="request parameter ignore_eos"):
        parse_parameters('{"ignore_eos": 1}', None)


@pytest.mark.parametrize("request_parameters,sampling,field", [
    ("{not json", None, "request parameters"),
    ("[1]", None, "request parameters"),
    (None, np.array([[b"{not json"]], object), SAMPLING_PARAMETERS),
    (None, np.array([[b'"a string"']], object), SAMPLING_PARAMETERS),
    (None, np.array([[b"{}", b"{}"]], object), SAMPLING_PARAMETERS),
    (None, np.array([[3]], np.int32), SAMPLING_PARAMETERS),
])
def test_what_is_not_one_json_object_is_refused_naming_where_it_came_from(request_parameters, sampling, field):
    with pytest.raises(InputError, match=field):
        parse_parameters(request_parameters, sampling)


@pytest.mark.parametrize("value,dtype,expected", [
    (0, np.float32, 0.0), (0.7, np.float32, 0.7), ("0.7", np.float32, 0.7), (5, np.int32, 5), (5.0, np.int32, 5),
    (" 12 ", np.int32, 12), (2**63, np.uint64, 2**63), (True, np.bool_, True), ("false", np.bool_, False),
])
def test_values_become_the_array_their_input_would_hold(value, dtype, expected):
    array = parameter_array(value, "p", dtype, rows=3)
    assert array.dtype == dtype and array.shape == (3, 1)
    kind = {np.float32: "float", np.int32: "int", np.uint64: "int", np.bool_: "bool"}[dtype]
    assert scalar(array[1:2], "p", kind) == pytest.approx(expected)


@pytest.mark.parametrize("value,dtype", [
    ("hot", np.float32), (True, np.float32), (float("inf"), np.float32), ([0.5], np.float32), (None, np.float32),
    (0.5, np.int32), ("3.5", np.int32), (False, np.int32), (-1, np.uint64), (2**31, np.int32),
    ("yes", np.bool_), (1, np.bool_), (3, np.object_), (["a", 3], np.object_),
])
def test_a_value_of_the_wrong_kind_names_the_parameter(value, dtype):
    with pytest.raises(InputError, match="request parameter temperature"):
        parameter_array(value, "temperature", dtype, rows=1)


@pytest.mark.parametrize("words", [["\n\n"], ["a,b", "c"], ['say "hi"', "x"], ["User:"]])
def test_vllms_stop_strings_are_each_one_literal_word(words):
    """The word-list inputs read each string as a CSV line (TensorRT-LLM's format); vLLM's
    `stop` strings are literal, so each must come back as itself, commas and quotes included."""
    for value in (words, words[0]) if len(words) == 1 else (words,):
        array = parameter_array(value, "stop", np.object_, rows=2)
        assert array.shape == (2, len(words))
        assert split_words(array[1].tolist()) == words
    # stop_words keeps TensorRT-LLM's CSV meaning: "a,b" is two words there
    assert split_words(parameter_array("a,b", "stop_words", np.object_, rows=1)[0].tolist()) == ["a", "b"]


def test_an_input_tensor_wins_and_a_parameter_fills_only_what_is_missing():
    settings = ParameterInputs(names={"runtime_top_k": ("top_k",), "temperature": ("temperature",)},
                               dtypes={"runtime_top_k": np.int32, "temperature": np.float32})
    sent = {"temperature": np.array([[0.3]], np.float32)}
    get = settings.getter(sent.get, {"temperature": 0.9, "top_k": 4, "seed": 1}, rows=2)
    assert get("temperature").item() == pytest.approx(0.3)
    assert get("runtime_top_k").tolist() == [[4], [4]] and get("runtime_top_k").dtype == np.int32
    assert get("seed") is None  # no input of this model stands for it
    read = sent.get
    assert settings.getter(read, {}, rows=1) is read


@pytest.mark.parametrize("model,step", [("preprocessing", 0), ("speculative_decoding", 1)])
def test_each_setting_reaches_its_input_with_the_type_the_ensemble_declares(model, step):
    """The parameter named as an ensemble input becomes the tensor that input would have
    been: the step's input has the ensemble input's data type, so no value changes type."""
    ensemble = {spec["name"]: spec["data_type"] for spec in _config("ensemble")["input"]}
    names = setting_names(STEPS[step].input_map)
    settings = ParameterInputs.from_config(_config(model), names)  # asserts every input exists
    declared = {spec["name"]: spec["data_type"] for spec in _config(model)["input"]}
    for model_input, parameters in names.items():
        assert declared[model_input] == ensemble[parameters[0]], model_input
        assert settings.dtypes[model_input] is not None
    every = {p for ps in names.values() for p in ps}
    assert not {"text_input", SAMPLING_PARAMETERS} & every
    if model == "speculative_decoding":
        assert names["runtime_top_k"] == ("top_k",) and names["streaming"] == ("stream",)
        assert names["min_p"] == ("min_p",)
        assert names["num_return_sequences"] == ("num_return_sequences", "n")
        assert "stop" not in every  # TensorRT-LLM's `stop` input (end a request) is never set by vLLM's `stop`
    else:
        assert names["REQUEST_OUTPUT_LEN"] == ("max_tokens",) and names["STOP_WORDS_DICT"] == ("stop_words", "stop")
