"""OpenAI request bodies → a validated `Generation`, and OpenAI's error shape.

Owns: which request fields the front door understands, their types and ranges, and
the one error type (`OpenAIError`) whose `body()` is OpenAI's error JSON. A bad field
is a 400 whose message and `param` name it. Never touches the network, a tokenizer or
Triton: `service.py` turns a `Generation` into a Triton request.

Fields, per endpoint (anything else in the body is ignored, as vLLM does):

    both     model, max_tokens, temperature, top_p, seed, stop, n, stream,
             stream_options.include_usage, presence_penalty, frequency_penalty,
             logit_bias ({token id: bias in [-100, 100]})
    chat     messages, max_completion_tokens (wins over max_tokens), logprobs (bool),
             top_logprobs (0-20, with logprobs), tools (none), response_format (text only)
    text     prompt (a string, a list of token ids, or a list of either: one answer per
             prompt), logprobs (0-20: the sampled token's log-probability and that many
             alternatives), echo (with logprobs: the prompt's scored too; max_tokens 0 then
             scores the prompt alone), suffix (none), best_of (n only)
    extra    top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
             include_stop_str_in_output (vLLM's names) and the
             ensemble's speculative inputs: speculative_method, speculative_choices,
             eagle_depth, eagle_top_k, eagle_total_tokens, num_draft_tokens, prompt_lookup_tokens

A sampling field the client leaves out takes the served model's default
(`sampling_defaults.py`: its generation_config.json, as in vLLM and SGLang), else OpenAI's:
temperature 1 and top_p 1 (the ensemble's own default is greedy; clients that want greedy
send temperature 0). `n` choices per prompt,
and the prompts of one completions request, are at most `MAX_CHOICES` together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from specdec.request import MAX_TOP_LOG_PROBS, METHODS

CHAT, COMPLETIONS = "chat.completions", "completions"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 128  # OpenAI's limit on n; here on prompts x n of one request
Prompt = Union[str, tuple[int, ...]]  # text, or token ids


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type_: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> OpenAIError:
    """A 400 for one request field; the message starts with the field's name."""
    return OpenAIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Generation:
    """One validated OpenAI request, in the ensemble's terms.

    `sampling` and `speculative` map ensemble input names to values and hold only what
    the client set, plus the sampling defaults; `prompts` are set for
    completions, `messages` (role and text content) for chat. Every prompt gets `n`
    choices.
    """

    endpoint: str  # CHAT | COMPLETIONS
    model: str
    prompts: tuple[Prompt, ...] = ()
    messages: tuple[dict, ...] = ()
    n: int = 1
    echo: bool = False  # completions: each choice's text starts with its prompt
    max_tokens: Optional[int] = None  # None: the server's default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: the answer ends before the first of these tokens
    include_stop_str_in_output: bool = False  # vLLM's: the answer ends after the stop string or token instead
    # a text model's stop_token_ids, turned into stop strings: (text, token id), for stop_reason
    stop_token_texts: tuple[tuple[str, int], ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (chat's top_logprobs, completions' logprobs)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    sampling: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] = field(default_factory=dict)


# -- typed field readers: None when absent or null ---------------------------------------------
def _present(body: dict, name: str) -> bool:
    return body.get(name) is not None


def _bool(body: dict, name: str) -> Optional[bool]:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_field(name, f"must be a boolean, got {value!r}")
    return value


def _int(body: dict, name: str, lo: Optional[int] = None, hi: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise bad_field(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_field(name, f"must be <= {hi}, got {value}")
    return value


def _number(body: dict, name: str, lo: Optional[float] = None, hi: Optional[float] = None,
            lo_open: bool = False) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_field(name, f"must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad_field(name, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_field(name, f"must be <= {hi}, got {value}")
    return float(value)


def _str(body: dict, name: str, choices: tuple[str, ...] = ()) -> Optional[str]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_field(name, f"must be a string, got {value!r}")
    if choices and value not in choices:
        raise bad_field(name, f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _only(body: dict, name: str, allowed, why: str) -> None:
    """A field we accept only at its no-op value(s)."""
    if body.get(name) is not None and body[name] not in allowed:
        raise bad_field(name, f"{why}, got {body[name]!r}")


# -- the request ------------------------------------------------------------------------------
def parse_request(body: Any, endpoint: str, sampling_defaults: Optional[dict] = None) -> Generation:
    """Validates an OpenAI request body for `endpoint`; raises `OpenAIError` (400).
    `sampling_defaults` (ensemble input names, `sampling_defaults.load`) fill in the
    sampling fields the body leaves out."""
    assert endpoint in (CHAT, COMPLETIONS), endpoint
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = _str(body, "model")
    if not model:
        raise bad_field("model", "is required")

    n = _int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    stream = bool(_bool(body, "stream"))
    include_usage = False
    if _present(body, "stream_options"):
        options = body["stream_options"]
        if not stream:
            raise bad_field("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad_field("stream_options", f"must be an object, got {options!r}")
        include_usage = bool(_bool(options, "include_usage"))

    if endpoint == CHAT:
        prompts, messages, echo = (), _messages(body), False
        if body.get("tools"):
            raise bad_field("tools", "tool calls are not supported")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad_field("response_format", f"only {{'type': 'text'}} is supported, got {fmt!r}")
        logprobs = bool(_bool(body, "logprobs"))
        top_logprobs = _int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOG_PROBS) or 0
        if top_logprobs and not logprobs:
            raise bad_field("top_logprobs", f"needs logprobs: true, got {top_logprobs} without it")
        max_tokens = _int(body, "max_completion_tokens", lo=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", lo=1)
        else:
            _int(body, "max_tokens", lo=1)  # still type-checked
    else:
        prompts, messages = _prompts(body), ()
        if len(prompts) * n > MAX_CHOICES:
            raise bad_field("n", f"{len(prompts)} prompts x n {n} = {len(prompts) * n} choices, more than "
                                 f"the {MAX_CHOICES} one request may ask for")
        top_logprobs = _int(body, "logprobs", lo=0, hi=MAX_TOP_LOG_PROBS)
        logprobs, top_logprobs = top_logprobs is not None, top_logprobs or 0
        echo = bool(_bool(body, "echo"))
        _only(body, "suffix", ("",), "suffix is not supported")
        best_of = _int(body, "best_of", lo=1)
        if best_of is not None and best_of != n:
            raise bad_field("best_of", f"must equal n ({n}): every sampled choice is returned, got {best_of}")
        max_tokens = _int(body, "max_tokens", lo=0)
        if max_tokens == 0 and not echo:
            raise bad_field("max_tokens", "must be >= 1 (0 only with echo: the prompt alone, scored with logprobs)")

    sampling: dict[str, Any] = {
        "temperature": _number(body, "temperature", lo=0.0, hi=2.0),
        "top_p": _number(body, "top_p", lo=0.0, hi=1.0, lo_open=True),
        "min_p": _number(body, "min_p", lo=0.0, hi=1.0) or None,  # 0 is off: sent to no model
        "seed": _int(body, "seed", lo=0, hi=2 ** 64 - 1),
        "presence_penalty": _number(body, "presence_penalty", lo=-2.0, hi=2.0),
        "frequency_penalty": _number(body, "frequency_penalty", lo=-2.0, hi=2.0),
        "repetition_penalty": _number(body, "repetition_penalty", lo=0.0, lo_open=True),
        "min_tokens": _int(body, "min_tokens", lo=0),
    }
    top_k = _int(body, "top_k", lo=-1)
    sampling["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1 and the engine's 0: no top-k
    sampling = {k: v for k, v in sampling.items() if v is not None}
    for name, value in (sampling_defaults or {}).items():  # the model's, for fields the client left out
        if not _present(body, name):
            sampling[name] = value
    sampling.setdefault("temperature", 1.0)  # OpenAI's defaults, not the ensemble's greedy
    sampling.setdefault("top_p", 1.0)
    if max_tokens is not None and sampling.get("min_tokens", 0) > max_tokens:
        raise bad_field("min_tokens", f"must be <= max_tokens ({max_tokens}), got {sampling['min_tokens']}")

    speculative = {
        "speculative_method": _str(body, "speculative_method", METHODS),
        "speculative_choices": _str(body, "speculative_choices"),
        "eagle_depth": _int(body, "eagle_depth", lo=1),
        "eagle_top_k": _int(body, "eagle_top_k", lo=1),
        "eagle_total_tokens": _int(body, "eagle_total_tokens", lo=1),
        "num_draft_tokens": _int(body, "num_draft_tokens", lo=0),
        "prompt_lookup_tokens": _int(body, "prompt_lookup_tokens", lo=0),
    }
    return Generation(
        endpoint=endpoint, model=model, prompts=prompts, messages=messages, n=n, echo=echo, max_tokens=max_tokens,
        stop=_stop(body), stop_token_ids=_stop_token_ids(body),
        include_stop_str_in_output=bool(_bool(body, "include_stop_str_in_output")), stream=stream,
        include_usage=include_usage,
        logprobs=logprobs, top_logprobs=top_logprobs,
        ignore_eos=bool(_bool(body, "ignore_eos")), logit_bias=_logit_bias(body), sampling=sampling,
        speculative={k: v for k, v in speculative.items() if v is not None})


def tokenize_model(body: Any) -> str:
    """The `model` of a /tokenize or /detokenize body (vLLM's endpoints)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = _str(body, "model")
    if not model:
        raise bad_field("model", "is required")
    return model


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_field("logit_bias", f"must be an object mapping token ids to biases, got {_short(bias)}")
    out = {}
    for key, value in bias.items():
        if not str(key).isdigit():
            raise bad_field("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_field("logit_bias", f"biases must be numbers in [-100, 100], got {value!r} for token {key}")
        out[int(key)] = float(value)
    return out


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_field("stop", f"must be a string or a list of strings, got {stop!r}")
    if any(w == "" for w in words):
        raise bad_field("stop", "must not hold an empty string")
    return tuple(dict.fromkeys(words))


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad_field("stop_token_ids", f"must be a list of token ids (integers >= 0), got {_short(ids)}")
    return tuple(dict.fromkeys(ids))


def _prompts(body: dict) -> tuple[Prompt, ...]:
    """The completions prompt(s), in the API's four forms: a string, a list of strings,
    a list of token ids, or a list of lists of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_field("prompt", "is required")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_field("prompt", "must be a string, a non-empty list of token ids (integers >= 0), or a "
                                  f"non-empty list of either, got {_short(prompt)}")
    for i, p in enumerate(prompts):
        if not p:
            raise bad_field("prompt", "must not be empty" if len(prompts) == 1 else f"[{i}] must not be empty")
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompts)


def _token_ids(value: Any) -> bool:
    """A non-empty list of integers >= 0 (bools are not token ids)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_field(where, f"must be an object, got {message!r}")
        role = message.get("role")
        if role not in ROLES:
            raise bad_field(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if message.get("tool_calls"):
            raise bad_field(f"{where}.tool_calls", "tool calls are not supported")
        out.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return tuple(out)


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, f"must be a string or a list of text parts, got {content!r}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{j}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)
