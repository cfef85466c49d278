"""Triton `preprocessing`: text → token ids, word strings → TensorRT-LLM word lists,
bias words → a dense `EMBEDDING_BIAS` (`specdec.logit_bias`).

Settings may also come as request parameters or in vLLM's `SAMPLING_PARAMETERS` JSON
(`specdec.request_parameters`): `max_tokens`, `stop_words` (or vLLM's `stop`), `bad_words`,
`end_id`, `pad_id`. Without any, `max_tokens` is the `default_max_tokens` parameter
(vLLM's 16 by default; empty: max_tokens is required).

Thin adapter: reads the tokenizer once; per request converts tensors and routes any
`InputError` to a Triton INVALID_ARG error for that request only. A request of N
batch entries (TensorRT-LLM's batch size > 1: `text_input` `[N, 1]`) gives `[N, ...]`
outputs, token ids padded to the longest entry (REQUEST_INPUT_LEN says how many count).
The word-list format lives in `specdec.wordlist`, tested without Triton.
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

from specdec.bls import STEPS
from specdec.errors import ConfigError, validate_that
from specdec.logit_bias import embedding_bias
from specdec.model_config import flag, load_tokenizer, param
from specdec.request_parameters import ParameterInputs, parse_parameters, setting_names
from specdec.tensors import row_getters, scalar, strings
from specdec.triton_glue import input_reader, request_parameters, respond_each
from specdec.wordlist import encode_words, split_words, stack_word_lists, to_word_list

_FIELDS = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
           "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
           "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
           "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights"}  # the ensemble's names


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if int(config.get("max_batch_size", 0)) < 1:  # its outputs carry the batch dimension the others expect
            raise ConfigError(f"max_batch_size must be >= 1 (the template's triton_max_batch_size), got "
                              f"{config.get('max_batch_size', 0)}: the entries take [1, 1] per request, "
                              f"as TensorRT-LLM's do")
        self.tokenizer = load_tokenizer(config)
        self.add_special_tokens = flag(config, "add_special_tokens", True)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.default_end_id = -1 if eos is None else int(eos)
        self.default_pad_id = int(pad) if pad is not None else self.default_end_id
        self.vocab_size = len(self.tokenizer)
        self.settings = ParameterInputs.from_config(config, setting_names(STEPS[0].input_map))
        default = param(config, "default_max_tokens", "").strip()
        if default and not (default.isdigit() and int(default) >= 1):
            raise ConfigError(f"parameter 'default_max_tokens' must be an integer >= 1 or empty, got {default!r}")
        self.default_max_tokens = int(default) if default else None

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def _row(self, get) -> dict:
        """One batch entry's outputs (unstacked)."""
        validate_that(get("QUERY") is not None, "text_input is required")
        query = scalar(get("QUERY"), "text_input", "str")
        validate_that(query.strip() != "", "text_input must not be empty")
        max_tokens = scalar(get("REQUEST_OUTPUT_LEN"), "max_tokens", "int", self.default_max_tokens)
        validate_that(max_tokens is not None, "max_tokens is required (as an input or a request parameter)")
        validate_that(max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}")
        input_ids = self.tokenizer.encode(query, add_special_tokens=self.add_special_tokens)
        weights = get("EMBEDDING_BIAS_WEIGHTS")
        return {
            "INPUT_ID": input_ids, "REQUEST_INPUT_LEN": len(input_ids), "REQUEST_OUTPUT_LEN": max_tokens,
            "OUT_END_ID": scalar(get("END_ID"), "end_id", "int", self.default_end_id),
            "OUT_PAD_ID": scalar(get("PAD_ID"), "pad_id", "int", self.default_pad_id),
            "BAD_WORDS_IDS": to_word_list(encode_words(split_words(strings(get("BAD_WORDS_DICT"))),
                                                       self._encode_word)),
            "STOP_WORDS_IDS": to_word_list(encode_words(split_words(strings(get("STOP_WORDS_DICT"))),
                                                        self._encode_word)),
            "EMBEDDING_BIAS": embedding_bias(
                [scalar(w, "embedding_bias_words", "str") for w in strings(get("EMBEDDING_BIAS_WORDS"))],
                [] if weights is None else weights.reshape(-1).tolist(),
                self._encode_word, self.vocab_size),
        }

    def _one(self, request) -> list:
        get = input_reader(pb_utils, request)

        query = get("QUERY")
        n = query.shape[0] if query is not None and query.ndim == 2 else 1
        get = self.settings.getter(get, parse_parameters(request_parameters(request), get("SAMPLING_PARAMETERS")), n)
        rows = [self._row(get_row) for get_row in row_getters(get, n, lambda name: _FIELDS.get(name, name))]
        ids = np.zeros((n, max(len(r["INPUT_ID"]) for r in rows)), dtype=np.int32)  # padding: never read
        for i, r in enumerate(rows):
            ids[i, :len(r["INPUT_ID"])] = r["INPUT_ID"]
        outputs = {"INPUT_ID": ids}
        for name in ("REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"):
            outputs[name] = np.array([[r[name]] for r in rows], dtype=np.int32)  # [N, 1]
        for name in ("BAD_WORDS_IDS", "STOP_WORDS_IDS"):
            outputs[name] = stack_word_lists([r[name] for r in rows])  # [N, 2, L]
        width = max(len(r["EMBEDDING_BIAS"]) for r in rows)  # vocab, or 0 when no entry has bias words
        outputs["EMBEDDING_BIAS"] = np.zeros((n, width), dtype=np.float32)
        for i, r in enumerate(rows):
            outputs["EMBEDDING_BIAS"][i, :len(r["EMBEDDING_BIAS"])] = r["EMBEDDING_BIAS"]
        return [pb_utils.Tensor(name, value) for name, value in outputs.items()]

    def execute(self, requests):
        return respond_each(pb_utils, requests, self._one)
