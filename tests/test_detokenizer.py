"""specdec.detokenizer: streamed pieces concatenate to the one-shot decode, byte for byte."""
from __future__ import annotations

import random

import pytest

from specdec.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, decode_delta
from specdec.request import StepOutput
from specdec.serving import ResponseBuilder, ResponseOptions

TEXTS = ["What is ML? It is machine learning.", "héllo wörld €uro 日本語 テキスト 😀🚀 ok",
         "  leading spaces\n\ttabs and\r\nnewlines  ", "ﬁ ligature, Ω, ß, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "a" * 50]


def _splits(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """Random step sizes, including empty steps and one step holding everything."""
    steps, i = [], 0
    while i < len(ids):
        k = rng.choice([0, 1, 1, 2, 3, 5, len(ids)])
        steps.append(ids[i:i + k])
        i += k
    return steps


def _token_sequences(tokenizer, rng: random.Random, count: int):
    vocab = len(tokenizer)
    for n in range(count):
        if n % 2:  # arbitrary ids: byte fragments, invalid UTF-8, special tokens
            yield [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        else:  # real text, cut at random points of its tokenization
            text = rng.choice(TEXTS)
            ids = tokenizer.encode(text, add_special_tokens=False)
            yield ids[rng.randint(0, len(ids) // 2):]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_pieces_equal_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    for ids in _token_sequences(tokenizer, rng, 300):
        detok = IncrementalDetokenizer(decode)
        pieces = [detok.add(step) for step in _splits(rng, ids)] + [detok.finish()]
        assert "".join(pieces) == decode(ids), ids
        assert detok.text == decode(ids)


def test_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    if len(ids) < 2:
        pytest.skip("the emoji is one token in this vocabulary")
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert detok.add(ids[:1]) == ""  # only part of the 4 UTF-8 bytes
    assert detok.add(ids[1:]) == "😀"


def test_invalid_bytes_at_the_end_are_flushed_by_finish(tokenizer):
    ids = tokenizer.encode("é", add_special_tokens=False)
    if len(ids) < 2:
        pytest.skip("é is one token in this vocabulary")
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.add(ids[:1]), detok.finish()]
    assert "".join(pieces) == tokenizer.decode(ids[:1])  # one U+FFFD, not lost


def test_stateless_helper_with_the_adapter_contract(tokenizer):
    """The speculative_decoding → postprocessing path without Triton: ResponseBuilder arrays
    fed to decode_delta exactly as postprocessing/1/model.py does."""
    rng = random.Random(7)
    decode = tokenizer.decode
    for ids in _token_sequences(tokenizer, rng, 100):
        prompt = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=True)[:5]
        for exclude in (True, False):
            stream = ResponseBuilder(prompt, ResponseOptions(streaming=True, exclude_input_in_output=exclude))
            whole = ResponseBuilder(prompt, ResponseOptions(streaming=False, exclude_input_in_output=exclude))
            steps = _splits(rng, ids) or [[]]
            pieces, text = [], None
            for n, step in enumerate(steps):
                out = StepOutput("r", step, [], finished=n == len(steps) - 1)
                for builder in (stream, whole):
                    arrays = builder.add(out)
                    if arrays is None:
                        continue
                    new = arrays["output_ids"][0, 0, :arrays["sequence_length"][0, 0]].tolist()
                    piece = decode_delta(decode, arrays["context_ids"][0, 0].tolist(), new,
                                         bool(arrays["is_final"][0, 0]))
                    if builder is stream:
                        assert len(arrays["context_ids"][0, 0]) <= CONTEXT_TOKENS
                        pieces.append(piece)
                    else:
                        text = piece
            # A stream never repeats the prompt (TensorRT-LLM's convention); the one response does
            # unless it is excluded.
            assert "".join(pieces) == decode(ids)
            assert text == decode((prompt if not exclude else []) + ids)
