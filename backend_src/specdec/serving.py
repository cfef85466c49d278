"""Tensors ⇄ engine dataclasses for the `speculative_decoding` Triton adapter.

Owns: building validated `GenerationRequest`s from a request's named input arrays
(TensorRT-LLM's input names, aliases and value conventions, one engine request per
batch entry), recognising TensorRT-LLM's `stop` requests, and turning the engine's
`StepOutput`s back into the output arrays of each response, in the shapes
TensorRT-LLM's `tensorrt_llm` model answers, plus the streaming-detokenization
context (docs/DESIGN.md, "Streaming detokenization" and "TensorRT-LLM's conventions").
Never imports Triton: the adapter passes `name -> numpy array or None` and sends the
dicts this module returns; tests drive it directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .detokenizer import CONTEXT_TOKENS
from .errors import InputError, validate_that
from .logit_bias import sparse_bias
from .request import GenerationRequest, SamplingParams, SpecParams, StepOutput
from .tensors import Getter, row_getters, scalar, token_ids
from .wordlist import from_word_list


@dataclass(frozen=True)
class ResponseOptions:
    """How a request's answers are shaped (the adapter's concern, not the engine's)."""

    streaming: bool = False
    exclude_input_in_output: bool = False  # not streaming only: a stream never repeats the prompt
    batch_index: int = 0  # the entry's row in its Triton request (TensorRT-LLM's `batch_index`)
    sequence_index: int = 0  # which of the entry's num_return_sequences answers (TensorRT-LLM's `sequence_index`)


def _first(get: Getter, names: tuple[str, ...], kind: str, default=None):
    """The value of the first input present among `names` (aliases), named after it."""
    for name in names:
        array = get(name)
        if array is not None:
            return scalar(array, name, kind)
    return default


def is_stop_request(get: Getter) -> bool:
    """TensorRT-LLM's `stop` input: true asks to end every running request that has this
    request's request_id; such a request carries nothing else worth reading."""
    return _first(get, ("stop",), "bool", False)


def batch_entries(get: Getter) -> int:
    """How many batch entries a request holds (TensorRT-LLM's batch size > 1): `input_ids`
    `[N, L]` makes N (`[L]`, with `max_batch_size: 0`, one)."""
    ids = get("input_ids")
    validate_that(ids is not None, "input_ids is required")
    n = ids.shape[0] if ids.ndim == 2 else 1
    validate_that(n >= 1, "input_ids holds no batch entry (shape [0, L])")
    return n


def batch_rows(get: Getter) -> list[Getter]:
    """One getter per batch entry of a request (`batch_entries`)."""
    return row_getters(get, batch_entries(get))


MAX_RETURN_SEQUENCES = 128  # sequences per batch entry (OpenAI's limit on n)
# vLLM's backend sends these outputs when asked; here they are on every response.
VLLM_OUTPUT_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
# Each asks for log-probs: vLLM's `cumulative_logprob` output is 0 without them.
LOG_PROB_FLAGS = ("return_log_probs", "return_logprobs", "return_cumulative_logprob")
# The engine's finish reasons in vLLM's words (its backend's `finish_reason` output).
VLLM_FINISH_REASONS = {"length": "length", "stop": "stop", "end_id": "stop", "cancelled": "abort"}


def trtllm_sampling(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float],
                    min_p: Optional[float] = None) -> tuple[float, int, float]:
    """`(temperature, top_k, top_p)` for `SamplingParams` from TensorRT-LLM's request values
    (None: not sent), and `min_p`, which TensorRT-LLM's Triton backend does not take.

    TensorRT-LLM's Triton backend treats a top_p of 0 or less as unset, an unset top_k
    or top_p is 0 and an unset temperature 1; its sampling layers then decode:

        top_k 0, top_p 0      greedy (they set top_k to 1)
        top_k 1               greedy
        top_k k > 1, top_p 0  top-k sampling (they set top_p to 1)
        top_k 0, top_p p      top-p sampling
        top_k k, top_p p      both

    A min_p above 0 asks for sampling as a top_k or top_p does: with top_k 0 and top_p 0
    it is min-p sampling, not greedy. Temperature 0 is greedy here (TensorRT-LLM divides
    the logits by it plus 1e-6: an argmax). A top_k of -1 is 0, vLLM's and SGLang's way
    to say no top-k (TensorRT-LLM refuses it; vLLM's clients send it as a request
    parameter, which Triton's generate endpoint makes into the top_k input). Another
    negative top_k, a negative temperature and a top_p above 1 are refused, as
    TensorRT-LLM's SamplingConfig checks refuse them.
    """
    validate_that(top_k is None or top_k >= -1,
                  f"top_k must be >= 0 (0 or -1: no top-k filtering), got {top_k}")
    validate_that(top_p is None or top_p <= 1.0,
                  f"top_p must be in (0, 1] (0 or less means unset, TensorRT-LLM's convention), got {top_p}")
    validate_that(temperature is None or temperature >= 0.0,
                  f"temperature must be >= 0, got {temperature}")
    k = max(top_k or 0, 0)
    p = top_p if top_p is not None and top_p > 0.0 else 0.0
    t = 1.0 if temperature is None else temperature
    if t == 0.0 or k == 1 or (k == 0 and p == 0.0 and not min_p):
        return 0.0, 0, 1.0
    return t, k, p if p > 0.0 else 1.0


def _refuse_unsupported(get: Getter) -> None:
    """TensorRT-LLM options the engine has no equivalent for: their defaults are
    accepted, anything else is refused with the reason."""
    beam_width = _first(get, ("beam_width",), "int", 1)
    validate_that(beam_width == 1, f"beam_width must be 1: beam search is not supported (speculative "
                                   f"decoding verifies one sequence per request), got {beam_width}")
    for name in ("return_context_logits", "return_generation_logits"):
        validate_that(not _first(get, (name,), "bool", False),
                      f"{name} is not supported: the engine does not return logits "
                      f"(return_log_probs gives each output token's log-probability)")
    _first(get, ("len_penalty", "length_penalty"), "float")  # beam-search only: type-checked, unused
    for name in VLLM_OUTPUT_FLAGS:  # their outputs are on every response: type-checked, unused
        _first(get, (name,), "bool")


def return_sequences(get: Getter) -> int:
    """How many sequences one batch entry asks for (`num_return_sequences`, vLLM's `n`)."""
    n = _first(get, ("num_return_sequences",), "int", 1)
    validate_that(1 <= n <= MAX_RETURN_SEQUENCES,
                  f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {n}")
    return n


def build_request(request_id: str, get: Getter, exclude_input_default: bool = False, batch_index: int = 0,
                  sequence_index: int = 0) -> tuple[GenerationRequest, ResponseOptions]:
    """A `GenerationRequest` from one batch entry's TensorRT-LLM-named inputs; raises
    `InputError` naming the field. `sequence_index` s of the entry's `return_sequences`:
    its seed, if one was sent, is seed + s, so that the sequences differ and repeat.

    Validation against the model (vocabulary, context, max_tokens limit) is the
    engine's, in `Engine.submit`; here only types, shapes, TensorRT-LLM's conventions
    and what the engine cannot express (beam search, logits).
    """
    ids = token_ids(get("input_ids"), "input_ids")
    length = _first(get, ("input_lengths",), "int", len(ids))
    validate_that(0 <= length <= len(ids), f"input_lengths must be in [0, {len(ids)}], got {length}")
    ids = ids[:length]
    validate_that(get("request_output_len") is not None, "request_output_len (max_tokens) is required")
    max_tokens = _first(get, ("request_output_len",), "int")
    _refuse_unsupported(get)
    end_id = _first(get, ("end_id",), "int")
    _first(get, ("pad_id",), "int")  # nothing is padded (one sequence per response): type-checked, unused
    words = {}
    for name in ("stop_words_list", "bad_words_list"):
        array = get(name)
        words[name] = [] if array is None else from_word_list(array, name)
    min_p = _first(get, ("min_p",), "float", 0.0)
    temperature, top_k, top_p = trtllm_sampling(_first(get, ("temperature",), "float"),
                                                _first(get, ("runtime_top_k", "top_k"), "int"),
                                                _first(get, ("runtime_top_p", "top_p"), "float"), min_p)
    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        seed=_seed(_first(get, ("seed", "random_seed"), "int"), sequence_index),
        repetition_penalty=_first(get, ("repetition_penalty",), "float", 1.0),
        presence_penalty=_first(get, ("presence_penalty",), "float", 0.0),
        frequency_penalty=_first(get, ("frequency_penalty",), "float", 0.0),
        min_tokens=_first(get, ("min_tokens", "min_length"), "int", 0),
    )
    spec = SpecParams(
        method=_first(get, ("speculative_method",), "str") or None,
        choices=_first(get, ("speculative_choices",), "str") or None,
        depth=_first(get, ("eagle_depth",), "int"),
        top_k=_first(get, ("eagle_top_k",), "int"),
        total_tokens=_first(get, ("eagle_total_tokens",), "int"),
        num_draft_tokens=_first(get, ("num_draft_tokens",), "int"),
        prompt_lookup_tokens=_first(get, ("prompt_lookup_tokens",), "int"),
    )
    request = GenerationRequest(
        request_id=request_id, input_ids=ids, max_tokens=max_tokens,
        end_id=None if end_id is None or end_id < 0 else end_id,  # -1: never stop on an end token
        stop_words=words["stop_words_list"], bad_words=words["bad_words_list"],
        sampling=sampling, spec=spec, logit_bias=sparse_bias(get("embedding_bias")),
        return_log_probs=any(_first(get, (name,), "bool", False) for name in LOG_PROB_FLAGS),
        top_log_probs=_first(get, ("top_log_probs",), "int", 0),
        return_prompt_log_probs=_first(get, ("return_prompt_log_probs",), "bool", False),
        return_perf_metrics=_first(get, ("return_perf_metrics",), "bool", False),
    )
    options = ResponseOptions(
        streaming=_first(get, ("streaming", "stream"), "bool", False),
        exclude_input_in_output=_first(get, ("exclude_input_in_output",), "bool", exclude_input_default),
        batch_index=batch_index, sequence_index=sequence_index,
    )
    return request, options


def _seed(seed: Optional[int], sequence_index: int) -> Optional[int]:
    """Sequence s of a request draws with seed + s (wrapping, as the seed input is UINT64)."""
    return seed if seed is None or seed < 0 else (seed + sequence_index) % 2 ** 64  # (a negative one is refused)


def _one(value, dtype) -> np.ndarray:
    """A per-response scalar output: `[1, 1]` (batch 1, one value), as TensorRT-LLM sends them."""
    return np.array([[value]], dtype=dtype)


ENDED_ON_A_TOKEN = ("stop", "end_id")  # finish reasons of a request whose last step generated a token


@dataclass
class ResponseBuilder:
    """Turns one engine request's `StepOutput`s into response tensors (batch dim 1, beam 1).

    Streaming (as TensorRT-LLM's executor): one response per step with new tokens (and
    always one for the final step); `output_ids` holds the new tokens only, never the
    prompt, whatever `exclude_input_in_output` says. Not streaming: one response, on
    the final step, with all tokens, the prompt first unless excluded. `context_ids`
    holds up to `CONTEXT_TOKENS` tokens sent before `output_ids` (empty when not
    streaming), `is_final` marks the entry's last response. The perf-metric outputs
    (TensorRT-LLM's names) are on every response: times are `time.monotonic_ns()`
    (TensorRT-LLM's steady clock), and the KV "blocks" are the engine's slots, one per
    request, never reused.
    """

    prompt: list[int]
    options: ResponseOptions
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    sent: list[int] = field(default_factory=list)  # tokens already in earlier responses
    pending: list[int] = field(default_factory=list)  # tokens not yet sent
    pending_log_probs: list[float] = field(default_factory=list)
    pending_top: list[list[tuple[int, float]]] = field(default_factory=list)  # alternatives per token
    prompt_log_probs: list[float] = field(default_factory=list)  # until the first response carries them
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)
    cum_log_prob: float = 0.0
    first_token_ns: int = 0
    last_token_ns: int = 0

    def add(self, step: StepOutput) -> Optional[dict[str, np.ndarray]]:
        """The response arrays for this step, or None when nothing is to be sent yet."""
        assert step.error is None, "the adapter answers failed steps with an error response"
        # A request that ends on an end or stop token generated a token even when none is
        # sent (the end token never is; a stop string's tokens are cut): its times say so.
        if step.token_ids or (step.finished and step.finish_reason in ENDED_ON_A_TOKEN):
            self.last_token_ns = time.monotonic_ns()
            self.first_token_ns = self.first_token_ns or self.last_token_ns
        self.cum_log_prob += float(sum(step.log_probs))
        self.pending.extend(step.token_ids)
        self.pending_log_probs.extend(step.log_probs)
        self.pending_top.extend(step.top_log_probs)
        self.prompt_log_probs.extend(step.prompt_log_probs)
        self.prompt_top.extend(step.prompt_top_log_probs)
        if not step.finished and (not self.options.streaming or not step.token_ids):
            return None
        new = list(self.pending)
        if not self.options.streaming and not self.options.exclude_input_in_output:
            new = self.prompt + new
        context = self.sent[max(0, len(self.sent) - CONTEXT_TOKENS):] if self.options.streaming else []
        stats = step.stats
        scheduled = step.scheduled_ns > 0
        arrays = {
            "output_ids": np.array(new, dtype=np.int32).reshape(1, 1, len(new)),
            "sequence_length": _one(len(new), np.int32),
            "context_ids": np.array(context, dtype=np.int32).reshape(1, 1, len(context)),
            "is_final": _one(step.finished, np.bool_),
            "cum_log_probs": _one(self.cum_log_prob, np.float32),
            "cumulative_logprob": _one(self.cum_log_prob, np.float32),  # the vLLM backend's name
            "output_log_probs": np.array(self.pending_log_probs, dtype=np.float32).reshape(
                1, 1, len(self.pending_log_probs)),
            # [1, 1, tokens, K]: the K most likely ids of each token's distribution and
            # their log-probs (top_log_probs: K; tokens 0 without it)
            "output_top_token_ids": _top(self.pending_top, 0, np.int32),
            "output_top_log_probs": _top(self.pending_top, 1, np.float32),
            # the prompt's tokens 2..L scored (return_prompt_log_probs): in the first response only
            "prompt_log_probs": np.array(self.prompt_log_probs, dtype=np.float32).reshape(
                1, 1, len(self.prompt_log_probs)),
            "prompt_top_token_ids": _top(self.prompt_top, 0, np.int32),
            "prompt_top_log_probs": _top(self.prompt_top, 1, np.float32),
            "batch_index": _one(self.options.batch_index, np.int32),
            "sequence_index": _one(self.options.sequence_index, np.int32),
            "kv_cache_alloc_new_blocks": _one(int(scheduled), np.int32),
            "kv_cache_reused_blocks": _one(0, np.int32),
            "kv_cache_alloc_total_blocks": _one(int(scheduled), np.int32),
            "arrival_time_ns": _one(self.arrival_ns, np.int64),
            "first_scheduled_time_ns": _one(step.scheduled_ns, np.int64),
            "first_token_time_ns": _one(self.first_token_ns, np.int64),
            "last_token_time_ns": _one(self.last_token_ns, np.int64),
            "acceptance_rate": _one(stats.acceptance_rate if stats else 0.0, np.float32),
            "total_accepted_draft_tokens": _one(stats.total_accepted_draft_tokens if stats else 0, np.int32),
            "total_draft_tokens": _one(stats.total_draft_tokens if stats else 0, np.int32),
            # generated tokens in this response (the prompt never counts): the vLLM
            # backend's output of this name, which OpenAI front ends read for `usage`
            "num_output_tokens": _one(len(self.pending), np.uint32),
            # the vLLM backend's: why the answer ended ("None" before its last response), prompt tokens
            "finish_reason": np.array([[VLLM_FINISH_REASONS.get(step.finish_reason, str(step.finish_reason))
                                        if step.finished else "None"]], dtype=np.object_),
            "num_input_tokens": _one(len(self.prompt), np.uint32),
        }
        self.sent.extend(self.pending)
        self.pending, self.pending_log_probs, self.pending_top = [], [], []
        self.prompt_log_probs, self.prompt_top = [], []
        return arrays


def _top(alternatives: list[list[tuple[int, float]]], field_index: int, dtype) -> np.ndarray:
    """Ids (field 0) or log-probs (1) of each token's alternatives, [1, 1, T, K]."""
    k = len(alternatives[0]) if alternatives else 0
    values = [[pair[field_index] for pair in token] for token in alternatives]
    return np.array(values, dtype=dtype).reshape(1, 1, len(alternatives), k)


@dataclass
class BatchAnswer:
    """The answers of one Triton request, one `ResponseBuilder` per answer: each batch
    entry's num_return_sequences of them.

    Each answer is its own engine request and sends its own responses, told apart by
    `batch_index` and `sequence_index`; Triton's final flag goes with the response that
    ends the last answer still running (TensorRT-LLM's backend does the same for batch
    size > 1).
    """

    builders: list[ResponseBuilder]
    running: set[int] = field(default_factory=set)

    def __post_init__(self):
        self.running = set(range(len(self.builders)))

    def add(self, answer: int, step: StepOutput) -> tuple[Optional[dict[str, np.ndarray]], bool]:
        """(the arrays to send or None, whether that response is the request's last)."""
        arrays = self.builders[answer].add(step)
        if step.finished:
            self.running.discard(answer)
        return arrays, arrays is not None and not self.running


def refuse_batch(rows: int, answers: int, decoupled: bool) -> None:
    """A request answered by several engine requests (`rows` batch entries, and each
    entry's num_return_sequences: `answers` in all) needs responses of its own for each:
    decoupled mode only."""
    if answers > 1 and not decoupled:
        what = f"{rows} batch entries" if rows > 1 else f"num_return_sequences {answers}"
        raise InputError(f"a request with {what} needs the model in decoupled mode "
                         f"(decoupled_mode:true): each answer is sent in its own responses")
