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
- `finish_reason` is "stop" for a stop string, end of turn or end token, "length" when
  max_tokens (or the context) ran out;
- a generation ends early by closing its stream: on a stop string the front door saw
  first, on a client that went away (the web layer cancels the awaiting task), or on
  an error. Closing before the final response cancels the Triton request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from specdec.config import EngineConfig
from specdec.wordlist import encode_words, to_word_list

from .protocol import CHAT, Generation, OpenAIError, bad_field
from .responses import Shapes, TokenLogProb, usage
from .stops import StopMatcher
from .tokenization import Tokenizer
from .triton_grpc import TEXT, TOKENS, Piece, ServerFacts, TargetModel, build_inputs, csv_word, wanted_outputs

OWNER = "specdec-triton"


@dataclass
class Call:
    """A prepared request: where it goes, what is sent, and the prompt's size."""

    gen: Generation
    target: TargetModel
    arrays: dict
    outputs: list[str]  # what Triton sends back
    prompt_tokens: int
    max_tokens: int
    shapes: Shapes


class Output:
    """Accumulates one generation's pieces into visible text, log-probs and counts."""

    def __init__(self, call: Call, tokenizer: Tokenizer, max_context: int):
        self.call = call
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.matcher = StopMatcher(call.gen.stop) if call.gen.stop else None
        self.detok = tokenizer.detokenizer() if call.target.kind == TOKENS else None
        self.raw = []  # every text piece received (text models without num_output_tokens: re-encoded for the count)
        self.n_tokens = 0  # token models: ids received; text models: num_output_tokens received
        self.counted = False  # a text model sent num_output_tokens
        self.text = ""  # visible text so far
        self._entries: list[TokenLogProb] = []  # log-probs not yet sent
        self._raw_chars = 0  # token text offsets (log-prob entries)

    @property
    def stopped(self) -> bool:
        return self.matcher is not None and self.matcher.stopped

    def add(self, piece: Piece) -> tuple[str, list[TokenLogProb]]:
        """The visible text this piece adds and the log-probs that may be sent with it."""
        if self.detok is not None:
            piece_text = self.detok.add(piece.token_ids, final=piece.final)
            self.n_tokens += len(piece.token_ids)
            if self.call.gen.logprobs:
                for token_id, logprob in zip(piece.token_ids, piece.log_probs):
                    token = self.tokenizer.token_text(token_id)
                    self._entries.append(TokenLogProb(token, float(logprob), self._raw_chars))
                    self._raw_chars += len(token)
        else:
            piece_text = piece.text
            if piece.num_tokens is not None:
                self.n_tokens += piece.num_tokens
                self.counted = True
        self.raw.append(piece_text)
        visible = self.matcher.feed(piece_text) if self.matcher else piece_text
        if piece.final and self.matcher:
            visible += self.matcher.finish()
        self.text += visible
        return visible, self._ready(final=piece.final or self.stopped)

    def _ready(self, final: bool) -> list[TokenLogProb]:
        """Entries whose token starts inside the visible text (all of those at the end)."""
        limit = len(self.text)
        ready = [e for e in self._entries if e.offset < limit or (final and not self.stopped)]
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
                 alias: Optional[str] = None):
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
        self.created = int(time.time())

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

    # -- requests -------------------------------------------------------------------------
    def prepare(self, gen: Generation) -> Call:
        """Validates `gen` against its model and builds the Triton inputs."""
        target = self._target(gen.model)
        templated = gen.endpoint == CHAT
        prompt = self.tokenizer.chat_prompt(gen.messages) if templated else gen.prompt
        ids = self.tokenizer.prompt_ids(prompt, templated)
        max_tokens = gen.max_tokens or self.default_max_tokens
        if target.kind == TEXT and gen.logprobs:
            raise bad_field("logprobs", f"the model '{target.name}' returns text only, not tokens; ask a "
                                        f"token-level model ({', '.join(self._token_models()) or 'none served'})")
        # A request with stop strings streams from the model even when its client does not:
        # the front door then ends the generation at the first match on the text.
        values = {"max_tokens": max_tokens, "stream": gen.stream or bool(gen.stop), **gen.sampling,
                  **gen.speculative}
        if target.kind == TEXT:
            values["text_input"] = self.tokenizer.text_prompt(prompt, templated)
            values["stop_words"] = [csv_word(w) for w in gen.stop] or None
            values["end_id"] = -1 if gen.ignore_eos else None
        else:
            values["input_ids"] = ids
            values["input_lengths"] = len(ids)
            words = encode_words(gen.stop, self.tokenizer.encode_word)
            values["stop_words_list"] = to_word_list(words) if words else None
            eos = self.tokenizer.eos_id
            values["end_id"] = -1 if gen.ignore_eos or eos is None else eos
            values["return_log_probs"] = True if gen.logprobs else None
        if "exclude_input_in_output" in target.inputs:  # the answer is the new text only
            values["exclude_input_in_output"] = True
        arrays = build_inputs(target, values)
        shapes = Shapes(gen.endpoint, gen.model, logprobs=gen.logprobs, include_usage=gen.include_usage)
        return Call(gen, target, arrays, wanted_outputs(target, gen.logprobs), len(ids), max_tokens, shapes)

    def _token_models(self) -> list[str]:
        return [n for n in self.names if self.targets[n].kind == TOKENS]

    async def complete(self, gen: Generation) -> dict:
        """The whole answer of a non-streamed request."""
        call = self.prepare(gen)
        out = Output(call, self.tokenizer, self.max_context)
        entries: list[TokenLogProb] = []
        stream = self.client.stream(call.target, call.arrays, call.shapes.id, call.outputs)
        try:
            async for piece in stream:
                entries += out.add(piece)[1]
                if piece.final or out.stopped:
                    break
        finally:
            stream.close()
        return call.shapes.answer(out.text, out.finish_reason(), out.usage(), entries)

    async def chunks(self, gen: Generation) -> AsyncIterator[dict]:
        """The chunks of a streamed request. Nothing is yielded before Triton's first
        response, so a request the model refuses raises here, before any header is sent."""
        call = self.prepare(gen)
        out = Output(call, self.tokenizer, self.max_context)
        shapes = call.shapes
        stream = self.client.stream(call.target, call.arrays, shapes.id, call.outputs)
        first = True
        try:
            async for piece in stream:
                text, entries = out.add(piece)
                if first and gen.endpoint == CHAT:
                    yield shapes.chunk(text, entries, first=True)
                elif text or entries:
                    yield shapes.chunk(text, entries)
                first = False
                if piece.final or out.stopped:
                    break
        finally:
            stream.close()
        yield shapes.chunk("", finish_reason=out.finish_reason())
        if gen.include_usage:
            yield shapes.usage_chunk(out.usage())
