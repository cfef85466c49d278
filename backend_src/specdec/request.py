"""What a caller asks of the engine and what the engine answers, as typed dataclasses.

The engine knows nothing about Triton or tokenization: requests arrive as token ids
and parameters, answers leave as token ids, log-probs and acceptance counters. The
Triton adapter (`model_repository/speculative_decoding/1/model.py`) fills these from
tensors; tests and benchmarks build them directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .errors import validate_that

METHODS = ("none", "medusa", "eagle", "eagle2", "eagle3", "draft_model")
MAX_TOP_LOG_PROBS = 20  # alternatives per token a request may ask for (OpenAI's and vLLM's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy (top_k/top_p/min_p then ignored)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]: keep tokens at least min_p times as likely as the likeliest; 0: off
    seed: Optional[int] = None  # None: drawn from the engine's generator at admission
    repetition_penalty: float = 1.0  # > 0; 1 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # end_id and stop words are suppressed before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        validate_that(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        validate_that(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        validate_that(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        validate_that(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        validate_that(self.repetition_penalty > 0.0,
                      f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        validate_that(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        validate_that(self.seed is None or self.seed >= 0, f"seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculative-decoding overrides; None fields take the model's config."""

    method: Optional[str] = None  # one of METHODS
    choices: Optional[str] = None  # tree for medusa/eagle: name, "{0,0},{0,1}", JSON, YAML path
    depth: Optional[int] = None  # EAGLE-2/3 dynamic tree depth
    top_k: Optional[int] = None  # EAGLE-2/3 expansion per depth
    total_tokens: Optional[int] = None  # EAGLE-2/3 tree size (draft tokens + root)
    num_draft_tokens: Optional[int] = None  # draft_model chain length
    typical_acceptance: Optional[bool] = None  # medusa: typical (lossy) instead of exact
    posterior_threshold: Optional[float] = None
    posterior_alpha: Optional[float] = None
    prompt_lookup_tokens: Optional[int] = None  # eagle/medusa: tokens of the branch copied from the text

    def validate(self) -> None:
        validate_that(self.method is None or self.method in METHODS,
                      f"speculative_method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("depth", "top_k", "total_tokens"):
            v = getattr(self, name)
            validate_that(v is None or v >= 1, f"eagle_{name} must be >= 1, got {v}")
        validate_that(self.num_draft_tokens is None or self.num_draft_tokens >= 0,
                      f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        validate_that(self.prompt_lookup_tokens is None or self.prompt_lookup_tokens >= 0,
                      f"prompt_lookup_tokens must be >= 0, got {self.prompt_lookup_tokens}")


@dataclass
class GenerationRequest:
    """One generation request, already tokenized."""

    request_id: str
    input_ids: list[int]
    max_tokens: int
    end_id: Optional[int] = None  # None: never stop on an end token
    pad_id: Optional[int] = None
    stop_words: list[list[int]] = field(default_factory=list)  # token sequences
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences never produced
    # added to the target's logits before sampling or verifying: {token id: bias}
    # (OpenAI's logit_bias; TensorRT-LLM's embedding_bias, dense there)
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)
    return_log_probs: bool = False
    # alternatives per output token: the most likely ids of the distribution the token was
    # drawn from, with their log-probs (OpenAI's top_logprobs); 0 for none
    top_log_probs: int = 0
    # each prompt token's log-prob under the target's own distribution after the tokens
    # before it (and its top_log_probs alternatives), on the first output
    return_prompt_log_probs: bool = False
    return_perf_metrics: bool = False

    def validate(self, vocab_size: int, max_context: int, max_tokens_limit: int) -> None:
        validate_that(len(self.input_ids) > 0, "input_ids must not be empty (empty text_input?)")
        validate_that(all(0 <= t < vocab_size for t in self.input_ids),
                      f"input_ids must be token ids in [0, {vocab_size})")
        validate_that(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        validate_that(self.max_tokens <= max_tokens_limit,
                      f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}")
        validate_that(len(self.input_ids) < max_context,
                      f"prompt has {len(self.input_ids)} tokens; the model's context is {max_context}")
        for name in ("end_id", "pad_id"):
            v = getattr(self, name)
            validate_that(v is None or 0 <= v < vocab_size, f"{name} must be in [0, {vocab_size}), got {v}")
        for name in ("stop_words", "bad_words"):
            for word in getattr(self, name):
                validate_that(len(word) > 0 and all(0 <= t < vocab_size for t in word),
                              f"{name} holds an empty word or an id outside [0, {vocab_size})")
        validate_that(all(0 <= t < vocab_size and math.isfinite(b) for t, b in self.logit_bias.items()),
                      f"logit_bias (embedding_bias) must hold finite biases of token ids in [0, {vocab_size})")
        validate_that(0 <= self.top_log_probs <= MAX_TOP_LOG_PROBS,
                      f"top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}], got {self.top_log_probs}")
        self.sampling.validate()
        self.spec.validate()


@dataclass
class AcceptanceStats:
    """Counters of one request's speculation (TensorRT-LLM's perf-metric names).

    tau (mean acceptance length) = tokens emitted per target forward, counting the
    bonus token: a step that accepts 3 drafts emits 4 tokens.
    """

    total_draft_tokens: int = 0  # draft tokens sent to verification
    total_accepted_draft_tokens: int = 0
    target_forwards: int = 0  # decode/verify forwards of the target (prefill excluded)
    emitted_tokens: int = 0  # tokens emitted by those forwards

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0

    @property
    def tau(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0


@dataclass
class StepOutput:
    """New tokens of one request after one engine step (a delta, not the whole text)."""

    request_id: str
    token_ids: list[int]  # new output tokens (already cut at a stop word / end_id)
    log_probs: list[float]  # one per token when return_log_probs, else empty
    finished: bool
    finish_reason: Optional[str] = None  # "length" | "stop" | "end_id" | "cancelled" | "error"
    error: Optional[str] = None  # set when finish_reason == "error"
    stats: Optional[AcceptanceStats] = None  # cumulative, set on every output
    scheduled_ns: int = 0  # time.monotonic_ns() when the request got its KV slot; 0 while it waits
    # one list per token when top_log_probs > 0, else empty: (token id, log-prob), most likely first
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    # on the request's first output with return_prompt_log_probs: prompt tokens 2..L, each
    # token's log-prob (and its alternatives when top_log_probs > 0); empty otherwise
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
