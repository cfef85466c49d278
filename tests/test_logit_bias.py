"""specdec.logit_bias: TensorRT-LLM's bias words and dense embedding bias, and the
engine's sparse form."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.logit_bias import embedding_bias, sparse_bias

ENCODE = {"cat": [5], " dog": [6, 7], "cats": [5, 8], "": []}.__getitem__


def test_each_word_adds_its_weight_at_each_of_its_tokens():
    bias = embedding_bias(["cat", " dog", "cats", ""], [1.5, -2.0, 0.25, 9.0], ENCODE, 10)
    assert bias.dtype == np.float32 and bias.shape == (10,)
    assert bias.tolist() == [0, 0, 0, 0, 0, 1.75, -2.0, -2.0, 0.25, 0]
    assert embedding_bias([], [], ENCODE, 10).shape == (0,)  # none: TensorRT-LLM's empty tensor


@pytest.mark.parametrize("words, weights, match", [
    (["cat"], [], "same length"),
    (["cat"], [float("nan")], "finite"),
    ([" dog"], [1.0], "outside the vocabulary"),
])
def test_bad_bias_words_are_refused(words, weights, match):
    with pytest.raises(InputError, match=match):
        embedding_bias(words, weights, ENCODE, 7)


def test_sparse_bias_keeps_the_nonzero_entries():
    dense = embedding_bias(["cat", " dog"], [1.5, -2.0], ENCODE, 10)
    assert sparse_bias(dense[None]) == {5: 1.5, 6: -2.0, 7: -2.0}
    assert sparse_bias(None) == {} and sparse_bias(np.zeros((1, 0), np.float32)) == {}
    with pytest.raises(InputError, match="embedding_bias"):
        sparse_bias(np.array([0.0, np.inf], np.float32))
