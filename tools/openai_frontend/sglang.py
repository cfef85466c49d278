"""SGLang's native `POST /generate`, over the front door's request flow.

SGLang's clients and tutorials, and `python -m sglang.bench_serving --backend sglang`,
call it with `text` (a string or a list of them) or `input_ids` (a list of token ids,
or a list of lists), `sampling_params` in SGLang's names, `stream` and `rid`. A
prompt's answer is `{"text": ..., "meta_info": {...}}`; a list of prompts gets a list
(each prompt's `n` answers in a row). A stream is Server-Sent Events whose `text` is
the answer so far (with `index` where a request has several), then `data: [DONE]`.

Owns: SGLang's body → an OpenAI completions body, which `protocol.parse_request`
checks as it checks every OpenAI request (a bad field's error names SGLang's field),
and the answers' shape. Serves the front door's first model (`Frontend.names[0]`).
SGLang's defaults apply: 128 new tokens (or the server's limit, if lower), and for the
sampling the served model's (`sampling_defaults.py`, SGLang's `--sampling-defaults model`),
else temperature 1, top_p 1, top_k off.
"""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Optional

from .protocol import COMPLETIONS, Generation, OpenAIError, bad_field, parse_request
from .service import Frontend, Output

MAX_NEW_TOKENS = 128  # SGLang's default
# SGLang's sampling_params names → the OpenAI body's (vLLM's extras included)
SAMPLING_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
                   "stop_token_ids": "stop_token_ids",
                   "ignore_eos": "ignore_eos", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
                   "n": "n", "sampling_seed": "seed", "no_stop_trim": "include_stop_str_in_output"}


def parse_generate(body: Any, model: str, max_new_tokens: int = MAX_NEW_TOKENS,
                   sampling_defaults: Optional[dict] = None) -> tuple[Generation, bool, list[str]]:
    """(the request as a completions `Generation` for `model`, whether its prompts came as a
    list, one SGLang request id per answer); `max_new_tokens` and `sampling_defaults` where the
    client sets none."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if ("text" in body) == ("input_ids" in body):
        raise bad_field("text", "send text (a string or a list of them) or input_ids, one of the two")
    source = "text" if "text" in body else "input_ids"
    prompt = body[source]
    if source == "input_ids" and not (isinstance(prompt, list) and prompt and (
            all(isinstance(p, list) for p in prompt) or not any(isinstance(p, (list, str)) for p in prompt))):
        raise bad_field("input_ids", f"must be a list of token ids, or a list of such lists, got {prompt!r}")
    batched = isinstance(prompt, list) and (source == "text" or any(isinstance(p, list) for p in prompt))
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise bad_field("sampling_params", f"must be one object for every prompt, got {type(params).__name__}")
    openai = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": body.get("stream", False)}
    openai.update({SAMPLING_PARAMS[k]: v for k, v in params.items() if k in SAMPLING_PARAMS})
    try:
        gen = parse_request(openai, COMPLETIONS, sampling_defaults)
    except OpenAIError as e:
        raise _renamed(e, source) from None
    answers = len(gen.prompts) * gen.n
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(answers)]
    elif isinstance(rids, str) and answers == 1:
        rids = [rids]
    elif not (isinstance(rids, list) and len(rids) == answers and all(isinstance(r, str) for r in rids)):
        raise bad_field("rid", f"must be one string per answer ({answers}), got {rids!r}")
    return gen, batched, rids


def _renamed(error: OpenAIError, source: str) -> OpenAIError:
    """`error` with the field named as the SGLang client sent it."""
    names = {openai: f"sampling_params.{name}" for name, openai in SAMPLING_PARAMS.items()}
    names["prompt"] = source
    name = names.get(error.param or "")
    if name is None:
        return error
    message = error.message.removeprefix(f"{error.param}: ")
    return OpenAIError(error.status, f"{name}: {message}", param=name, code=error.code, type_=error.type)


def meta_info(rid: str, output: Optional[Output]) -> dict:
    """SGLang's `meta_info`; before the answer ends, its id and no finish reason."""
    if output is None:
        return {"id": rid, "finish_reason": None}
    tokens = output.completion_tokens()
    matched = output.stop_reason()
    if matched is None:  # it ended at the end token, which SGLang names by its id
        matched = output.tokenizer.eos_id
    finish = ({"type": "length", "length": tokens} if output.finish_reason() == "length"
              else {"type": "stop", "matched": matched})
    return {"id": rid, "finish_reason": finish, "prompt_tokens": output.call.prompt_tokens,
            "completion_tokens": tokens, "cached_tokens": 0}


async def answer(frontend: Frontend, gen: Generation, batched: bool, rids: list[str]):
    """The whole answer of a request that is not streamed."""
    texts, _, outputs = await frontend.collect(gen)
    answers = [{"text": texts[i], "meta_info": meta_info(rid, outputs.get(i))} for i, rid in enumerate(rids)]
    return answers if batched or len(answers) > 1 else answers[0]


async def events(frontend: Frontend, gen: Generation, rids: list[str]) -> AsyncIterator[dict]:
    """A streamed request's events: each carries its answer's text so far."""
    texts = [""] * len(rids)
    deltas = frontend.deltas(gen)
    try:
        async for delta in deltas:
            if not delta.text and delta.output is None:
                continue
            texts[delta.index] += delta.text
            event = {"text": texts[delta.index], "meta_info": meta_info(rids[delta.index], delta.output)}
            if len(rids) > 1:
                event["index"] = delta.index
            yield event
    finally:
        await deltas.aclose()
