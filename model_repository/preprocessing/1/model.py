"""Triton `preprocessing`: text → token ids, word strings → TensorRT-LLM word lists.

Thin adapter: reads the tokenizer once; per request converts tensors and routes any
`InputError` to a Triton INVALID_ARG error for that request only. The word-list
format lives in `specdec.wordlist`, tested without Triton.
"""
from __future__ import annotations

import os
import sys

# The Python-backend stub runs an isolated interpreter that ignores PYTHONPATH; put its
# entries first (tools/triton_env.py sets it) so the environment's packages (numpy<2)
# and `specdec` are found. Must run before numpy or triton_python_backend_utils load.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.errors import InputError, validate_that
from specdec.model_config import flag, load_tokenizer
from specdec.tensors import scalar, strings
from specdec.wordlist import encode_words, split_words, to_word_list


def _error(message: str):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.tokenizer = load_tokenizer(config)
        self.add_special_tokens = flag(config, "add_special_tokens", True)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.default_end_id = -1 if eos is None else int(eos)
        self.default_pad_id = int(pad) if pad is not None else self.default_end_id

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def _one(self, request) -> list:
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        validate_that(get("QUERY") is not None, "text_input is required")
        validate_that(get("REQUEST_OUTPUT_LEN") is not None, "max_tokens is required")
        query = scalar(get("QUERY"), "text_input", "str")
        validate_that(query.strip() != "", "text_input must not be empty")
        max_tokens = scalar(get("REQUEST_OUTPUT_LEN"), "max_tokens", "int")
        validate_that(max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}")
        end_id = scalar(get("END_ID"), "end_id", "int", self.default_end_id)
        pad_id = scalar(get("PAD_ID"), "pad_id", "int", self.default_pad_id)
        input_ids = self.tokenizer.encode(query, add_special_tokens=self.add_special_tokens)
        bad = to_word_list(encode_words(split_words(strings(get("BAD_WORDS_DICT"))), self._encode_word))
        stop = to_word_list(encode_words(split_words(strings(get("STOP_WORDS_DICT"))), self._encode_word))

        def out(name, values):  # every output gets the batch dim of 1
            return pb_utils.Tensor(name, np.asarray(values, dtype=np.int32)[None])

        return [out("INPUT_ID", input_ids), out("REQUEST_INPUT_LEN", [len(input_ids)]),
                out("BAD_WORDS_IDS", bad), out("STOP_WORDS_IDS", stop),
                out("REQUEST_OUTPUT_LEN", [max_tokens]), out("OUT_END_ID", [end_id]),
                out("OUT_PAD_ID", [pad_id])]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._one(request)))
            except InputError as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_error(str(e))))
        return responses
