"""One OpenAI request, end to end, without HTTP: model lookup, prompt, Triton inputs,
the stream of pieces, stop strings, usage, finish reason, the answer or its chunks.

Owns the rules that tie the other modules together:
- a chat prompt is the tokenizer's chat template over the messages; `prompt_tokens`
  counts it as the model sees it (token models: the ids sent; text models: encoded
  as their preprocessing encodes it);
- `completion_tokens` is exact for token models (the ids returned) and for text models
  that say how many tokens each response holds (`num_output_tokens`, the vLLM backend's
  output, which this repository's `ensemble` and `tensorrt_llm_bls` send); for other
  text models it is the text re-encoded, which can differ by a few tokens (and
  log-probs, which need each token, are refused for text models);
- `finish_reason` is "stop" for a stop string, a stop token, end of turn or end token,
  "length" when max_tokens (or the context) ran out;
- vLLM's `stop_token_ids`: a token model's answer ends before the first of them (the
  token counts in `completion_tokens` and its text is left out, as in vLLM; its
  log-prob is left out with it); a text model gets each token's text as one more stop
  string (refused, like `logit_bias`, for a token whose text does not encode back to it
  alone). With vLLM's `include_stop_str_in_output` the answer ends after the stop
  string or token instead, and every choice says in vLLM's `stop_reason` which stop
  string or token id ended it (null for end of turn and length);
- a generation ends early by closing its stream: on a stop string the front door saw
  first, on a client that went away (the web layer cancels the awaiting task), or on
  an error. Closing before the final response cancels the Triton request;
- `n` choices, and several completions prompts, are one Triton request each, up to the
  engine's batch size at once (in-flight batching takes them together; the next starts
  as one ends) and read as they come (`merge.py`); an error in one closes the others.
  Choice j of a seeded request samples with seed + j, so the choices differ and the
  request still repeats. `prompt_tokens` counts each prompt once, `completion_tokens`
  every choice (as vLLM does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Optional, Sequence

import numpy as np

from specdec.config import EngineConfig
from specdec.wordlist import encode_words, to_word_list

from .merge import merge
from .protocol import CHAT, Generation, OpenAIError, Prompt, bad_field, parse_request, tokenize_model
from .responses import Shapes, TokenLogProb, usage
from .stops import StopMatcher
from .tokenization import Tokenizer
from .triton_grpc import TEXT, TOKENS, Piece, ServerFacts, TargetModel, build_inputs, csv_word, wanted_outputs

OWNER = "specdec-triton"


@dataclass
class Call:
    """One choice's Triton request: where it goes, what is sent, and the prompt's size."""

    gen: Generation
    target: TargetModel
    arrays: dict
    outputs: list[str]  # what Triton sends back
    prompt_tokens: int
    max_tokens: int
    index: int  # the choice's index in the answer: prompt * n + choice
    request_id: str
    echo: str = ""  # the text that leads the answer (completions' echo)
    prompt_ids: tuple[int, ...] = ()  # set when the prompt's tokens are scored (echo with logprobs)


@dataclass
class Delta:
    """What one response added to choice `index`; `output` is set once it has finished."""

    index: int
    text: str
    entries: list[TokenLogProb]
    output: Optional["Output"] = None


def log_prob_entry(tokenizer: Tokenizer, token_id: int, logprob: Optional[float], offset: int,
                   top: Sequence[tuple[int, float]]) -> TokenLogProb:
    """A token's log-prob entry: its text, and its alternatives as (text, log-prob)."""
    return TokenLogProb(tokenizer.token_text(token_id), logprob, offset,
                        tuple((tokenizer.token_text(i), float(lp)) for i, lp in top))


class Output:
    """Accumulates one generation's pieces into visible text, log-probs and counts."""

    def __init__(self, call: Call, tokenizer: Tokenizer, max_context: int):
        self.call = call
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.matcher = StopMatcher(call.gen.stop, call.gen.include_stop_str_in_output) if call.gen.stop else None
        self.detok = tokenizer.detokenizer() if call.target.kind == TOKENS else None
        self.stop_ids = frozenset(call.gen.stop_token_ids) if self.detok is not None else frozenset()
        self.stop_token: Optional[int] = None  # the token of stop_token_ids that came
        self.raw = []  # every text piece received (text models without num_output_tokens: re-encoded for the count)
        self.n_tokens = 0  # token models: ids received; text models: num_output_tokens received
        self.counted = False  # a text model sent num_output_tokens
        self.text = ""  # visible text so far
        self._entries: list[TokenLogProb] = []  # log-probs not yet sent
        self._raw_chars = 0  # token text offsets (log-prob entries)

    @property
    def string_stopped(self) -> bool:
        return self.matcher is not None and self.matcher.stopped

    @property
    def token_stopped(self) -> bool:
        return self.stop_token is not None

    @property
    def stopped(self) -> bool:
        return self.string_stopped or self.token_stopped

    def stop_reason(self) -> Optional[int | str]:
        """vLLM's `stop_reason`: the stop token id or stop string that ended the answer;
        None when it ended otherwise (end of turn, length). A text model's stop token,
        matched as its text, is reported as the token."""
        if self.token_stopped:
            return self.stop_token
        if self.string_stopped:
            return dict(self.call.gen.stop_token_texts).get(self.matcher.matched, self.matcher.matched)
        return None

    def add(self, piece: Piece) -> tuple[str, list[TokenLogProb]]:
        """The visible text this piece adds and the log-probs that may be sent with it."""
        final = piece.final
        if self.detok is not None:
            ids, log_probs = list(piece.token_ids), list(piece.log_probs)
            tops = piece.top or [()] * len(ids)
            cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
            self.n_tokens += len(ids) if cut is None else cut + 1  # a stop token counts, what follows it not
            if cut is not None:  # the stop token's text and log-prob are left out unless asked for
                self.stop_token, final = ids[cut], True
                keep = cut + 1 if self.call.gen.include_stop_str_in_output else cut
                ids, log_probs, tops = ids[:keep], log_probs[:keep], tops[:keep]
            piece_text = self.detok.add(ids, final=final)
            if self.call.gen.logprobs:
                for token_id, logprob, top in zip(ids, log_probs, tops):
                    entry = log_prob_entry(self.tokenizer, token_id, float(logprob), self._raw_chars, top)
                    self._entries.append(entry)
                    self._raw_chars += len(entry.token)
        else:
            piece_text = piece.text
            if piece.num_tokens is not None:
                self.n_tokens += piece.num_tokens
                self.counted = True
        self.raw.append(piece_text)
        visible = self.matcher.feed(piece_text) if self.matcher else piece_text
        if final and self.matcher:
            visible += self.matcher.finish()
        self.text += visible
        return visible, self._ready(final=final or self.stopped)

    def _ready(self, final: bool) -> list[TokenLogProb]:
        """Entries whose token starts inside the visible text (all of those at the end,
        unless a stop string cut the text)."""
        limit = len(self.text)
        ready = [e for e in self._entries if e.offset < limit or (final and not self.string_stopped)]
        self._entries = [] if final else self._entries[len(ready):]
        return ready

    def completion_tokens(self) -> int:
        if self.detok is not None or self.counted:
            return self.n_tokens
        return self.tokenizer.count("".join(self.raw))

    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        used = self.completion_tokens()
        if used >= self.call.max_tokens or self.call.prompt_tokens + used >= self.max_context:
            return "length"
        return "stop"

    def usage(self) -> dict:
        return usage(self.call.prompt_tokens, self.completion_tokens())


class Frontend:
    """The served models and the request flow; the web layer only moves JSON."""

    def __init__(self, client, targets: list[TargetModel], tokenizer: Tokenizer, facts: ServerFacts,
                 alias: Optional[str] = None, sampling_defaults: Optional[dict] = None):
        if not targets:
            raise ValueError("no model to serve")
        self.client = client
        self.tokenizer = tokenizer
        self.facts = facts
        self.targets = {t.name: t for t in targets}
        self.names = [t.name for t in targets]
        if alias:
            self.targets[alias] = targets[0]
            self.names.insert(0, alias)
        self.default_max_tokens = facts.max_tokens_limit or EngineConfig.max_tokens_limit
        self.max_context = facts.max_seq_len or EngineConfig.max_seq_len
        # choices of one request in flight at once: more would only wait in the engine's
        # queue, and 128 of them would overflow it (a 503 for the whole request)
        self.choice_window = facts.max_batch_size or EngineConfig.max_batch_size
        self.created = int(time.time())
        # the model's sampling for fields a request leaves out (sampling_defaults.py)
        self.sampling_defaults = dict(sampling_defaults or {})

    # -- models ---------------------------------------------------------------------------
    def _model_json(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": OWNER}

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_json(n) for n in self.names]}

    def model(self, name: str) -> dict:
        self._target(name)
        return self._model_json(name)

    def _target(self, name: str) -> TargetModel:
        target = self.targets.get(name)
        if target is None:
            raise OpenAIError(404, f"The model '{name}' does not exist (served: {', '.join(self.names)})",
                              param="model", code="model_not_found")
        return target

    # -- tokenizer endpoints (vLLM's) ------------------------------------------------------
    def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: a `prompt` as a text prompt is encoded, or `messages` in the
        chat template (`add_generation_prompt`, default true), for a served `model`."""
        self._target(tokenize_model(body))
        if "messages" in body:
            messages = parse_request({"model": "m", "messages": body["messages"]}, CHAT).messages
            add = body.get("add_generation_prompt", True)
            if not isinstance(add, bool):
                raise bad_field("add_generation_prompt", f"must be a boolean, got {add!r}")
            ids = self.tokenizer.prompt_ids(self.tokenizer.chat_prompt(messages, add), templated=True)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_field("prompt", f"must be a string (or send messages), got {prompt!r}")
            ids = self.tokenizer.prompt_ids(prompt, templated=False)
        return {"count": len(ids), "max_model_len": self.max_context, "tokens": ids}

    def detokenize(self, body: dict) -> dict:
        """vLLM's /detokenize: `tokens` back to text, decoded as outputs are."""
        self._target(tokenize_model(body))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_field("tokens", f"must be a list of token ids, got {tokens!r}")
        self.tokenizer.check_ids(tokens, "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}

    # -- requests -------------------------------------------------------------------------
    def shapes(self, gen: Generation) -> Shapes:
        return Shapes(gen.endpoint, gen.model, logprobs=gen.logprobs, top_logprobs=gen.top_logprobs,
                      include_usage=gen.include_usage)

    def prepare(self, gen: Generation, shapes: Optional[Shapes] = None) -> list[Call]:
        """Validates `gen` against its model and builds every choice's Triton inputs, in
        the order of the answer's choices."""
        target = self._target(gen.model)
        if target.kind == TEXT and gen.logprobs:
            raise bad_field("logprobs", f"the model '{target.name}' returns text only, not tokens; "
                                        f"ask a {self._token_models()}")
        if gen.top_logprobs and target.input_for("top_log_probs") is None:
            raise bad_field("top_logprobs" if gen.endpoint == CHAT else "logprobs",
                            f"the model '{target.name}' returns no alternatives (it has no top_log_probs input)")
        bias = self._bias_values(target, gen.logit_bias)
        if gen.stop_token_ids:
            self.tokenizer.check_ids(gen.stop_token_ids, "stop_token_ids")
            if target.kind == TEXT:  # each token's text, as one more stop string
                texts = tuple(self._text_alone(target, t, "stop_token_ids") for t in gen.stop_token_ids)
                gen = replace(gen, stop=tuple(dict.fromkeys(gen.stop + texts)), stop_token_ids=(),
                              stop_token_texts=tuple((x, t) for x, t in zip(texts, gen.stop_token_ids)
                                                     if x not in gen.stop))
        shapes = shapes or self.shapes(gen)
        templated = gen.endpoint == CHAT
        prompts = (self.tokenizer.chat_prompt(gen.messages),) if templated else gen.prompts
        calls = []
        for p, prompt in enumerate(prompts):
            ids = self._prompt_ids(target, prompt, templated)
            for j in range(gen.n):
                index = p * gen.n + j
                request_id = shapes.id if len(prompts) * gen.n == 1 else f"{shapes.id}-{index}"
                calls.append(self._call(gen, target, prompt, ids, j, index, request_id, bias))
        return calls

    def _bias_values(self, target: TargetModel, logit_bias: dict[int, float]) -> dict:
        """`logit_bias` as the model's inputs: a dense `embedding_bias` for a token model;
        for a text model, TensorRT-LLM's bias words (each token's own text, which its
        preprocessing encodes back) and weights, refused for a token whose text does not
        encode back to that token alone."""
        if not logit_bias:
            return {}
        self.tokenizer.check_ids(list(logit_bias), "logit_bias")
        if target.kind == TOKENS:
            if target.input_for("embedding_bias") is None:
                raise bad_field("logit_bias", f"the model '{target.name}' takes no embedding_bias input")
            dense = np.zeros(len(self.tokenizer.hf), dtype=np.float32)
            dense[list(logit_bias)] = list(logit_bias.values())
            return {"embedding_bias": dense}
        if target.input_for("embedding_bias_words") is None:
            raise bad_field("logit_bias", f"the model '{target.name}' takes no embedding_bias_words input")
        words = [self._text_alone(target, token, "logit_bias") for token in logit_bias]
        return {"embedding_bias_words": words, "embedding_bias_weights": list(logit_bias.values())}

    def _text_alone(self, target: TargetModel, token: int, param: str) -> str:
        """The text that stands for `token` in a text model's inputs: its own text, which
        must encode back to that token alone (a 400 on `param` otherwise)."""
        text = self.tokenizer.token_text(token)
        if self.tokenizer.encode_word(text) != [token]:
            raise bad_field(param, f"token {token} ({text!r}) does not encode back to itself alone, so the text "
                                   f"model '{target.name}' cannot take it; send it to a {self._token_models()}")
        return text

    def _prompt_ids(self, target: TargetModel, prompt: Prompt, templated: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.prompt_ids(prompt, templated)
        if target.kind == TEXT:
            raise bad_field("prompt", f"the model '{target.name}' takes text, not token ids; send them to a "
                                      f"{self._token_models()}")
        self.tokenizer.check_ids(prompt, "prompt")
        return list(prompt)

    def _call(self, gen: Generation, target: TargetModel, prompt: Prompt, ids: list[int], choice: int,
              index: int, request_id: str, bias: dict) -> Call:
        templated = gen.endpoint == CHAT
        max_tokens = self.default_max_tokens if gen.max_tokens is None else gen.max_tokens
        score_prompt = gen.echo and gen.logprobs
        sampling = dict(gen.sampling)
        if "seed" in sampling:  # n seeded choices that differ, and repeat
            sampling["seed"] = (sampling["seed"] + choice) % 2 ** 64
        # A request with stop strings or stop tokens streams from the model even when its client
        # does not: the front door then ends the generation at the first match.
        # max_tokens 0 (echo): the engine generates one token, which is dropped here
        values = {"max_tokens": max(max_tokens, 1), "stream": gen.stream or bool(gen.stop or gen.stop_token_ids),
                  **sampling,
                  **gen.speculative, **bias}
        if target.kind == TEXT:
            values["text_input"] = self.tokenizer.text_prompt(prompt, templated)
            values["stop_words"] = [csv_word(w) for w in gen.stop] or None
            values["end_id"] = -1 if gen.ignore_eos else None
        else:
            values["input_ids"] = ids
            values["input_lengths"] = len(ids)
            words = encode_words(gen.stop, self.tokenizer.encode_word) + [[t] for t in gen.stop_token_ids]
            values["stop_words_list"] = to_word_list(words) if words else None
            eos = self.tokenizer.eos_id
            values["end_id"] = -1 if gen.ignore_eos or eos is None else eos
            values["return_log_probs"] = True if gen.logprobs else None
            values["top_log_probs"] = gen.top_logprobs or None
            values["return_prompt_log_probs"] = True if score_prompt else None
        if "exclude_input_in_output" in target.inputs:  # the answer is the new text only
            values["exclude_input_in_output"] = True
        echo = "" if not gen.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        outputs = wanted_outputs(target, gen.logprobs, top=gen.top_logprobs > 0, prompt=score_prompt)
        return Call(gen, target, build_inputs(target, values), outputs, len(ids), max_tokens, index, request_id, echo,
                    tuple(ids) if score_prompt else ())

    def _token_models(self) -> str:
        """The words that send a client to a token-level model, naming the served ones."""
        names = [n for n in self.names if self.targets[n].kind == TOKENS]
        return f"token-level model ({', '.join(names) or 'none served'})"

    async def _choice(self, call: Call) -> AsyncIterator[Delta]:
        """One choice's deltas; the last one carries its finished `Output`. Nothing is
        yielded before Triton's first response (the echo comes with it)."""
        out = Output(call, self.tokenizer, self.max_context)
        stream = self.client.stream(call.target, call.arrays, call.request_id, call.outputs)
        lead, shift = call.echo, len(call.echo)  # generated tokens' text offsets start after the echo
        first = True
        try:
            async for piece in stream:
                scored = self._prompt_entries(call, piece) if first else []
                first = False
                if call.max_tokens == 0:  # the prompt alone: the one generated token is dropped
                    text, entries = "", []
                else:
                    text, entries = out.add(piece)
                    entries = [replace(e, offset=e.offset + shift) for e in entries] if shift else entries
                yield Delta(call.index, lead + text, scored + entries)
                lead = ""
                if piece.final or out.stopped or call.max_tokens == 0:
                    break
        finally:
            stream.close()
        yield Delta(call.index, lead, [], out)

    def _prompt_entries(self, call: Call, piece: Piece) -> list[TokenLogProb]:
        """The scored prompt's log-prob entries (echo with logprobs), from the first
        response: the first token has none, as in OpenAI's and vLLM's answers."""
        if not call.prompt_ids:
            return []
        entries, offset = [], 0
        tops = piece.prompt_top or [()] * len(piece.prompt_log_probs)
        scores = [(None, ())] + list(zip(piece.prompt_log_probs, tops))
        for token_id, (logprob, top) in zip(call.prompt_ids, scores):
            entries.append(log_prob_entry(self.tokenizer, token_id, logprob, offset, top))
            offset += len(entries[-1].token)
        return entries

    def deltas(self, gen: Generation) -> AsyncIterator[Delta]:
        """Every choice's pieces as they come (SGLang's endpoint streams its own events
        from them); a refused request raises here, before any. The caller closes it."""
        return self._deltas(self.prepare(gen))

    def _deltas(self, calls: list[Call]) -> AsyncIterator[Delta]:
        if len(calls) == 1:
            return self._choice(calls[0])
        # closing it closes every choice's stream
        return merge([self._choice(c) for c in calls], limit=self.choice_window)

    @staticmethod
    def _usage(calls: list[Call], outputs: dict[int, "Output"]) -> dict:
        """Each prompt counted once (its first choice's), every choice's tokens."""
        prompt_tokens = sum(c.prompt_tokens for c in calls if c.index % c.gen.n == 0)
        return usage(prompt_tokens, sum(o.completion_tokens() for o in outputs.values()))

    async def collect(self, gen: Generation, calls: Optional[list[Call]] = None
                      ) -> tuple[dict[int, str], dict[int, list[TokenLogProb]], dict[int, Output]]:
        """Every choice's whole text, log-prob entries and finished `Output`, by index
        (`calls`: `prepare(gen)`'s, when the caller has them)."""
        calls = self.prepare(gen) if calls is None else calls
        texts = {c.index: "" for c in calls}
        entries: dict[int, list[TokenLogProb]] = {c.index: [] for c in calls}
        outputs: dict[int, Output] = {}
        deltas = self._deltas(calls)
        try:
            async for delta in deltas:
                texts[delta.index] += delta.text
                entries[delta.index] += delta.entries
                if delta.output is not None:
                    outputs[delta.index] = delta.output
        finally:
            await deltas.aclose()
        return texts, entries, outputs

    async def complete(self, gen: Generation) -> dict:
        """The whole answer of a non-streamed request."""
        shapes = self.shapes(gen)
        calls = self.prepare(gen, shapes)
        texts, entries, outputs = await self.collect(gen, calls)
        choices = [shapes.choice(c.index, texts[c.index], outputs[c.index].finish_reason(), entries[c.index],
                                 outputs[c.index].stop_reason()) for c in calls]
        return shapes.answer(choices, self._usage(calls, outputs))

    async def chunks(self, gen: Generation) -> AsyncIterator[dict]:
        """The chunks of a streamed request. Nothing is yielded before Triton's first
        response, so a request the model refuses raises here, before any header is sent."""
        shapes = self.shapes(gen)
        calls = self.prepare(gen, shapes)
        opened: set[int] = set()  # chat: choices whose first chunk (with the role) was sent
        outputs: dict[int, Output] = {}
        deltas = self._deltas(calls)
        try:
            async for delta in deltas:
                if gen.endpoint == CHAT and delta.index not in opened:
                    opened.add(delta.index)
                    yield shapes.chunk(delta.index, delta.text, delta.entries, first=True)
                elif delta.text or delta.entries:
                    yield shapes.chunk(delta.index, delta.text, delta.entries)
                if delta.output is not None:
                    outputs[delta.index] = delta.output
                    yield shapes.chunk(delta.index, "", finish_reason=delta.output.finish_reason(),
                                       stop_reason=delta.output.stop_reason())
        finally:
            await deltas.aclose()
        if gen.include_usage:
            yield shapes.usage_chunk(self._usage(calls, outputs))
