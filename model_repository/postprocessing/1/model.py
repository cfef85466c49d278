"""Triton `postprocessing`: token ids → text, stateless per call.

Thin adapter over `specdec.detokenizer.decode_delta`. Per response of
`speculative_decoding` it gets (tensor contract in docs/DESIGN.md, "Streaming
detokenization"):

    TOKENS_BATCH [1, beam, T]   tokens of this response (streaming: only the new ones)
    SEQUENCE_LENGTH [1, beam]   how many of them are valid
    CONTEXT_IDS [1, beam, C]    streaming: up to 8 tokens emitted before them; else C = 0
    IS_FINAL [1, 1]             the entry's last response (flushes held-back text)

and returns `OUTPUT` [beam] (one string per beam, batch and beams flattened, as
TensorRT-LLM's postprocessing: the ensemble's `text_output` is `[1]`) =
decode(CONTEXT_IDS + tokens) minus decode(CONTEXT_IDS), holding back an incomplete
UTF-8 character unless final. With no CONTEXT_IDS/IS_FINAL (a non-streamed response)
this is the plain decode of the tokens. The other outputs of `speculative_decoding`
(log-probs, batch and sequence index, perf metrics) pass through (zeros when absent)
so every ensemble output leaves from this one step, as one response.
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

from specdec.detokenizer import decode_delta
from specdec.errors import InputError
from specdec.model_config import flag, load_tokenizer
from specdec.triton_glue import input_reader, respond_each

_PASSTHROUGH = [  # (input, dtype, shape without batch when absent); output: OUT_<input>
    ("CUM_LOG_PROBS", np.float32, (1,)),
    ("CUMULATIVE_LOGPROB", np.float32, (1,)),
    ("OUTPUT_LOG_PROBS", np.float32, (1, 0)),
    ("ACCEPTANCE_RATE", np.float32, (1,)),
    ("TOTAL_ACCEPTED_DRAFT_TOKENS", np.int32, (1,)),
    ("TOTAL_DRAFT_TOKENS", np.int32, (1,)),
    ("NUM_OUTPUT_TOKENS", np.uint32, (1,)),
    ("FINISH_REASON", np.object_, (1,)),
    ("NUM_INPUT_TOKENS", np.uint32, (1,)),
    ("BATCH_INDEX", np.int32, (1,)),
    ("SEQUENCE_INDEX", np.int32, (1,)),
    ("KV_CACHE_ALLOC_NEW_BLOCKS", np.int32, (1,)),
    ("KV_CACHE_REUSED_BLOCKS", np.int32, (1,)),
    ("KV_CACHE_ALLOC_TOTAL_BLOCKS", np.int32, (1,)),
    ("ARRIVAL_TIME_NS", np.int64, (1,)),
    ("FIRST_SCHEDULED_TIME_NS", np.int64, (1,)),
    ("FIRST_TOKEN_TIME_NS", np.int64, (1,)),
    ("LAST_TOKEN_TIME_NS", np.int64, (1,)),
]


UNFINISHED = b"None"  # finish_reason while the answer goes on (vLLM's str(None))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.tokenizer = load_tokenizer(config)
        self.skip_special_tokens = flag(config, "skip_special_tokens", True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _one(self, request) -> list:
        get = input_reader(pb_utils, request)

        tokens = get("TOKENS_BATCH")  # [1, beam, T]
        lengths = get("SEQUENCE_LENGTH")  # [1, beam]
        if tokens.ndim != 3 or lengths.ndim != 2 or tokens.shape[:2] != lengths.shape:
            raise InputError(f"TOKENS_BATCH {list(tokens.shape)} and SEQUENCE_LENGTH "
                             f"{list(lengths.shape)} do not match as [1, beam, T] and [1, beam]")
        context = get("CONTEXT_IDS")
        final_flag = get("IS_FINAL")
        final = True if final_flag is None else bool(final_flag.reshape(-1)[0])
        texts = []
        for beam in range(tokens.shape[1]):
            new = tokens[0, beam, :int(lengths[0, beam])].tolist()
            ctx = context[0, beam].tolist() if context is not None and context.shape[1] > beam else []
            texts.append(decode_delta(self._decode, ctx, new, final).encode("utf-8"))
        outputs = [pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))]
        for name, dtype, shape in _PASSTHROUGH:
            value = get(name)
            if value is None:
                value = np.full((1,) + shape, UNFINISHED if dtype is np.object_ else 0, dtype=dtype)
            value = value.astype(dtype)
            outputs.append(pb_utils.Tensor("OUT_" + name, value))
        return outputs

    def execute(self, requests):
        return respond_each(pb_utils, requests, self._one)
