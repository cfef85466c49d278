"""specdec.wordlist: TensorRT-LLM [2, L] word lists, both directions."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.wordlist import encode_words, from_word_list, split_words, stack_word_lists, to_word_list


def test_split_words_csv_like_tensorrt_llm():
    assert split_words([b"foo,bar"]) == ["foo", "bar"]
    assert split_words(["", b""]) == []
    assert split_words(['"a,b",c', "d"]) == ["a,b", "c", "d"]
    assert split_words([" x, y"]) == [" x", " y"]  # spaces are part of the word (BPE)


def test_to_word_list_layout():
    out = to_word_list([[7, 8], [9]])
    assert out.dtype == np.int32
    assert out.tolist() == [[7, 8, 9], [2, 3, -1]]
    assert to_word_list([]).tolist() == [[0], [-1]]
    assert to_word_list([[5]], pad_to=3).tolist() == [[5, 0, 0], [1, -1, -1]]


def test_round_trip_and_batch():
    rng = np.random.default_rng(0)
    for _ in range(50):
        words = [rng.integers(0, 100, rng.integers(1, 4)).tolist() for _ in range(rng.integers(0, 5))]
        assert from_word_list(to_word_list(words)) == words
        assert from_word_list(to_word_list(words)[None]) == words  # batch dim of 1
    batch = stack_word_lists([to_word_list([[1, 2]]), to_word_list([[3], [4], [5]])])
    assert batch.shape == (2, 2, 3)
    assert [from_word_list(b) for b in batch] == [[[1, 2]], [[3], [4], [5]]]


def test_encode_words_drops_empty_encodings():
    vocab = {"a": [1], "bc": [2, 3], "": []}
    assert encode_words(["a", "", "bc"], lambda w: vocab[w]) == [[1], [2, 3]]


@pytest.mark.parametrize("array,match", [
    (np.zeros((3, 2), np.int32), r"stop_words_list must have shape \[2, L\]"),
    (np.array([[1, 2], [2, 1]], np.int32), "offsets must increase"),
    (np.array([[1, 2], [5, -1]], np.int32), "offsets must increase"),
    (np.array([[1.0], [1.0]]), "integer"),
])
def test_from_word_list_rejects_malformed(array, match):
    with pytest.raises(InputError, match=match):
        from_word_list(array, "stop_words_list")
