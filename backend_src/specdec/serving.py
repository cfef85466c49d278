"""Tensors ⇄ engine dataclasses for the `speculative_decoding` Triton adapter.

Owns: building a validated `GenerationRequest` from a request's named input arrays
(TensorRT-LLM's input names and their aliases), and turning the engine's
`StepOutput`s back into the output arrays of one response, including the
streaming-detokenization context (docs/DESIGN.md, "Streaming detokenization").
Never imports Triton: the adapter passes `name -> numpy array or None` and sends the
dicts this module returns; tests drive it directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .detokenizer import CONTEXT_TOKENS
from .errors import validate_that
from .request import GenerationRequest, SamplingParams, SpecParams, StepOutput
from .tensors import scalar, token_ids
from .wordlist import from_word_list

Getter = Callable[[str], Optional[np.ndarray]]


@dataclass(frozen=True)
class ResponseOptions:
    """How a request's answers are shaped (the adapter's concern, not the engine's)."""

    streaming: bool = False
    exclude_input_in_output: bool = False


def _first(get: Getter, names: tuple[str, ...], kind: str, default=None):
    """The value of the first input present among `names` (aliases), named after it."""
    for name in names:
        array = get(name)
        if array is not None:
            return scalar(array, name, kind)
    return default


def build_request(request_id: str, get: Getter, exclude_input_default: bool = False
                  ) -> tuple[GenerationRequest, ResponseOptions]:
    """A `GenerationRequest` from TensorRT-LLM-named inputs; raises `InputError` naming the field.

    Validation against the model (vocabulary, context, max_tokens limit) is the
    engine's, in `Engine.submit`; here only types, shapes and what the engine cannot
    express (beam search) are checked.
    """
    ids = token_ids(get("input_ids"), "input_ids")
    length = _first(get, ("input_lengths",), "int", len(ids))
    validate_that(0 <= length <= len(ids), f"input_lengths must be in [0, {len(ids)}], got {length}")
    ids = ids[:length]
    validate_that(get("request_output_len") is not None, "request_output_len (max_tokens) is required")
    max_tokens = _first(get, ("request_output_len",), "int")
    beam_width = _first(get, ("beam_width",), "int", 1)
    validate_that(beam_width == 1, f"beam_width must be 1 (beam search is not supported), got {beam_width}")
    _first(get, ("len_penalty", "length_penalty"), "float")  # beam-search only: type-checked, unused
    end_id = _first(get, ("end_id",), "int")
    pad_id = _first(get, ("pad_id",), "int")
    words = {}
    for name in ("stop_words_list", "bad_words_list"):
        array = get(name)
        words[name] = [] if array is None else from_word_list(array, name)
    sampling = SamplingParams(
        temperature=_first(get, ("temperature",), "float", 0.0),
        top_k=_first(get, ("runtime_top_k", "top_k"), "int", 0),
        top_p=_first(get, ("runtime_top_p", "top_p"), "float", 1.0),
        seed=_first(get, ("seed", "random_seed"), "int"),
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
    )
    request = GenerationRequest(
        request_id=request_id, input_ids=ids, max_tokens=max_tokens,
        end_id=None if end_id is None or end_id < 0 else end_id,  # -1: never stop on an end token
        pad_id=None if pad_id is None or pad_id < 0 else pad_id,
        stop_words=words["stop_words_list"], bad_words=words["bad_words_list"],
        sampling=sampling, spec=spec,
        return_log_probs=_first(get, ("return_log_probs",), "bool", False),
        return_perf_metrics=_first(get, ("return_perf_metrics",), "bool", False),
    )
    options = ResponseOptions(
        streaming=_first(get, ("streaming", "stream"), "bool", False),
        exclude_input_in_output=_first(get, ("exclude_input_in_output",), "bool", exclude_input_default),
    )
    return request, options


@dataclass
class ResponseBuilder:
    """Turns one request's `StepOutput`s into response tensors (batch dim 1, beam 1).

    Streaming: one response per step with new tokens (and always one for the final
    step); `output_ids` holds the new tokens, preceded on the first response by the
    prompt when the input is not excluded, so the streamed text concatenates to the
    non-streamed `text_output`. Non-streaming: one response, on the final step, with
    all tokens. `context_ids` holds up to `CONTEXT_TOKENS` tokens already sent before
    `output_ids` (empty when not streaming), `is_final` marks the last response.
    """

    prompt: list[int]
    options: ResponseOptions
    sent: list[int] = field(default_factory=list)  # tokens already in earlier responses
    pending: list[int] = field(default_factory=list)  # non-streaming: tokens not yet sent
    pending_log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    first: bool = True

    def add(self, step: StepOutput) -> Optional[dict[str, np.ndarray]]:
        """The response arrays for this step, or None when nothing is to be sent yet."""
        assert step.error is None, "the adapter answers failed steps with an error response"
        self.cum_log_prob += float(sum(step.log_probs))
        self.pending.extend(step.token_ids)
        self.pending_log_probs.extend(step.log_probs)
        if not step.finished and (not self.options.streaming or not step.token_ids):
            return None
        new = list(self.pending)
        if self.first and not self.options.exclude_input_in_output:
            new = self.prompt + new
        context = self.sent[max(0, len(self.sent) - CONTEXT_TOKENS):] if self.options.streaming else []
        stats = step.stats
        arrays = {
            "output_ids": np.array([[new]], dtype=np.int32).reshape(1, 1, len(new)),
            "sequence_length": np.array([[len(new)]], dtype=np.int32),
            "context_ids": np.array([[context]], dtype=np.int32).reshape(1, 1, len(context)),
            "is_final": np.array([[step.finished]], dtype=np.bool_),
            "cum_log_probs": np.array([[self.cum_log_prob]], dtype=np.float32),
            "output_log_probs": np.array([[self.pending_log_probs]], dtype=np.float32).reshape(
                1, 1, len(self.pending_log_probs)),
            "acceptance_rate": np.array([[stats.acceptance_rate if stats else 0.0]], dtype=np.float32),
            "total_accepted_draft_tokens": np.array(
                [[stats.total_accepted_draft_tokens if stats else 0]], dtype=np.int32),
            "total_draft_tokens": np.array([[stats.total_draft_tokens if stats else 0]], dtype=np.int32),
        }
        self.sent.extend(new)
        self.pending, self.pending_log_probs, self.first = [], [], False
        return arrays
