"""Generation settings sent as request parameters, the way vLLM's Triton backend takes them.

A client of vLLM's backend puts its settings in the request's `parameters`, e.g. on the
generate endpoint `{"text_input": "...", "parameters": {"temperature": 0, "max_tokens":
64}}`, or as one JSON object in a `sampling_parameters` input tensor (what a BLS caller
sends: a Python backend request carried no parameters before Triton 24.xx). Triton
forwards an ensemble's request parameters to each of its steps (since 23.10), and the
ensemble routes `sampling_parameters` to each step that reads settings, so each model
reads the ones that stand for its own inputs.

Owns:
- parsing both into one `{name: value}`; a key of `sampling_parameters` wins over the same
  request parameter, a JSON `null` means "not sent", and vLLM's `ignore_eos: true` is
  `end_id` -1;
- turning a value into the array its input tensor would have held (`[rows, 1]`, or
  `[rows, k]` for strings), with an `InputError` that names the parameter;
- a getter that falls back on them for the inputs a request did not send.

An input tensor always wins over a parameter of the same meaning. Names that no input
stands for are ignored, as Triton ignores the parameters a backend does not read (and
each step of the ensemble sees every parameter of the request).
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from .errors import InputError, validate_that
from .tensors import Getter, scalar

# Triton config data types → numpy, for the types a setting's input can have.
_DTYPES = {"TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64,
           "TYPE_FP32": np.float32, "TYPE_FP64": np.float64, "TYPE_STRING": np.object_}
# vLLM's `stop`: each string is one stop word, taken literally. The word-list inputs read
# each of their strings as a CSV line of words (TensorRT-LLM's format), so these are quoted.
LITERAL_WORDS = ("stop",)
SAMPLING_PARAMETERS = "sampling_parameters"  # the ensemble's input (preprocessing's SAMPLING_PARAMETERS)
# Ensemble inputs that are not settings: the text, and lists of numbers (a parameter is one value).
_NOT_SETTINGS = ("text_input", "embedding_bias_words", "embedding_bias_weights", SAMPLING_PARAMETERS)
# vLLM's names for the same settings: its `n` answers per prompt, as num_return_sequences does
_ALIASES = {"stop_words": ("stop",), "num_return_sequences": ("n",)}


def setting_names(input_map: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """{model input: the parameters that stand for it} for one ensemble step (`input_map`
    {model input: ensemble tensor}): each input the ensemble fills from an input of its own
    (not from an earlier step's output, `_`-named) is set by the parameter of that name."""
    return {model_input: (tensor,) + _ALIASES.get(tensor, ()) for model_input, tensor in input_map.items()
            if not tensor.startswith("_") and tensor not in _NOT_SETTINGS}


def parse_parameters(request_parameters: Optional[str], sampling_parameters: Optional[np.ndarray]
                     ) -> dict[str, Any]:
    """The request's settings: its parameters (Triton gives them as a JSON object string),
    then the keys of its `sampling_parameters` tensor (one JSON object) over them."""
    values = _json_object(request_parameters, "request parameters") if request_parameters else {}
    if sampling_parameters is not None:
        text = scalar(sampling_parameters, SAMPLING_PARAMETERS, "str")
        values.update(_json_object(text, SAMPLING_PARAMETERS))
    values = {name: value for name, value in values.items() if value is not None}
    if "ignore_eos" in values and _flag(values.pop("ignore_eos"), "ignore_eos") and "end_id" not in values:
        values["end_id"] = -1  # vLLM's ignore_eos: TensorRT-LLM's end_id -1, never stop at an end token
    return values


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{field} is not valid JSON: {e}") from None
    validate_that(isinstance(value, dict), f"{field} must be a JSON object, got {type(value).__name__}")
    return value


def parameter_array(value: Any, name: str, dtype: type, rows: int) -> np.ndarray:
    """`value` as the input tensor a request of `rows` batch entries would send: `[rows, 1]`
    (a number or a flag, the same on every row), `[rows, k]` (k strings). Strings of numbers
    and of true/false are read as vLLM's backend reads them."""
    if dtype is np.object_:
        items = value if isinstance(value, list) else [value]
        validate_that(all(isinstance(item, str) for item in items),
                      f"request parameter {name} must be a string or a list of strings, got {value!r}")
        if name in LITERAL_WORDS:
            items = [_csv_field(item) for item in items]
        return np.array([[item.encode("utf-8") for item in items]] * rows, dtype=np.object_).reshape(rows, -1)
    if dtype is np.bool_:
        return np.full((rows, 1), _flag(value, name), dtype=np.bool_)
    if np.issubdtype(dtype, np.integer):
        number = _integer(value, name)
        limits = np.iinfo(dtype)
        validate_that(limits.min <= number <= limits.max,
                      f"request parameter {name} must be in [{limits.min}, {limits.max}], got {number}")
        return np.full((rows, 1), number, dtype=dtype)
    return np.full((rows, 1), _number(value, name), dtype=dtype)


def _csv_field(word: str) -> str:
    line = io.StringIO()
    csv.writer(line).writerow([word])
    return line.getvalue().rstrip("\r\n")


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InputError(f"request parameter {name} must be true or false, got {value!r}")


def _integer(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InputError(f"request parameter {name} must be an integer, got {value!r}")


def _number(value: Any, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise InputError(f"request parameter {name} must be a number, got {value!r}") from None
    else:
        raise InputError(f"request parameter {name} must be a number, got {value!r}")
    validate_that(np.isfinite(number), f"request parameter {name} must be finite, got {value!r}")
    return number


@dataclass(frozen=True)
class ParameterInputs:
    """Which parameters stand for which of one model's inputs, and those inputs' types."""

    names: Mapping[str, tuple[str, ...]]  # input name -> parameter names, the first one sent wins
    dtypes: Mapping[str, type]  # input name -> numpy dtype of its tensor

    @classmethod
    def from_config(cls, config: dict, names: Mapping[str, tuple[str, ...]]) -> "ParameterInputs":
        """`names` over the inputs of a Triton model config (`json.loads(args["model_config"])`)."""
        declared = {spec["name"]: spec["data_type"] for spec in config.get("input", [])}
        missing = sorted(set(names) - set(declared))
        assert not missing, f"no such inputs in {config.get('name')!r}: {missing}"
        return cls(names=dict(names), dtypes={name: _DTYPES[declared[name]] for name in names})

    def getter(self, get: Getter, values: Mapping[str, Any], rows: int) -> Getter:
        """`get`, falling back on `values` (`parse_parameters`) for the inputs it lacks, as
        the arrays of a request of `rows` batch entries."""
        if not values:
            return get

        def get_or_parameter(input_name: str) -> Optional[np.ndarray]:
            array = get(input_name)
            if array is not None:
                return array
            for name in self.names.get(input_name, ()):
                if name in values:
                    return parameter_array(values[name], name, self.dtypes[input_name], rows)
            return None

        return get_or_parameter
