"""specdec.serving: tensors → GenerationRequest and StepOutputs → response arrays, without Triton."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.request import AcceptanceStats, StepOutput
from specdec.serving import ResponseBuilder, ResponseOptions, build_request
from specdec.wordlist import to_word_list


def _getter(**inputs):
    """Inputs as the adapter sees them with max_batch_size > 0: a batch dim of 1."""
    arrays = {k: v if isinstance(v, np.ndarray) else np.array([[v]]) for k, v in inputs.items()}
    return arrays.get


BASE = dict(input_ids=np.array([[5, 6, 7, 0]], np.int32), input_lengths=np.array([[3]], np.int32),
            request_output_len=np.array([[4]], np.int32))


def test_build_request_reads_trtllm_names_and_aliases():
    req, opts = build_request("r1", _getter(
        **BASE, end_id=np.array([[2]], np.int32), pad_id=np.array([[-1]], np.int32),
        runtime_top_k=np.array([[3]], np.int32), runtime_top_p=np.array([[0.5]], np.float32),
        temperature=np.array([[0.7]], np.float32), random_seed=np.array([[9]], np.uint64),
        min_length=np.array([[2]], np.int32), streaming=np.array([[True]]),
        stop_words_list=to_word_list([[1, 2], [3]])[None], speculative_method=np.array([[b"eagle3"]], object),
        eagle_depth=np.array([[4]], np.int32)))
    assert req.input_ids == [5, 6, 7] and req.max_tokens == 4
    assert req.end_id == 2 and req.pad_id is None
    assert (req.sampling.top_k, req.sampling.top_p, req.sampling.seed, req.sampling.min_tokens) == (3, 0.5, 9, 2)
    assert req.sampling.temperature == pytest.approx(0.7)
    assert req.stop_words == [[1, 2], [3]] and req.bad_words == []
    assert req.spec.method == "eagle3" and req.spec.depth == 4
    assert opts == ResponseOptions(streaming=True, exclude_input_in_output=False)


def test_defaults_are_greedy_and_exclude_default_comes_from_config():
    req, opts = build_request("r", _getter(**BASE), exclude_input_default=True)
    assert req.sampling.greedy and req.end_id is None and opts.exclude_input_in_output


@pytest.mark.parametrize("extra,match", [
    (dict(beam_width=np.array([[2]], np.int32)), "beam_width must be 1"),
    (dict(temperature=np.array([[1, 2]], np.float32)), "temperature must hold exactly one value"),
    (dict(runtime_top_k=np.array([[1.5]], np.float32)), "runtime_top_k must be an integer"),
    (dict(temperature=np.array([[np.nan]], np.float32)), "temperature must be finite"),
    (dict(input_lengths=np.array([[9]], np.int32)), "input_lengths must be in"),
    (dict(stop_words_list=np.zeros((1, 3, 2), np.int32)), "stop_words_list must have shape"),
    (dict(input_ids=np.array([[0.5]], np.float32)), "input_ids must be integer"),
])
def test_bad_inputs_name_the_field(extra, match):
    with pytest.raises(InputError, match=match):
        build_request("r", _getter(**{**BASE, **extra}))


def test_engine_validation_names_fields():
    req, _ = build_request("r", _getter(**{**BASE, "temperature": np.array([[-1.0]], np.float32)}))
    with pytest.raises(InputError, match="temperature must be >= 0"):
        req.validate(vocab_size=100, max_context=64, max_tokens_limit=8)


def _step(tokens, finished=False, log_probs=None):
    return StepOutput("r", tokens, log_probs or [], finished, "length" if finished else None,
                      stats=AcceptanceStats(total_draft_tokens=4, total_accepted_draft_tokens=3))


def test_streaming_responses_carry_context_and_final_flag():
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=True, exclude_input_in_output=True))
    first = b.add(_step([10, 11], log_probs=[-1.0, -2.0]))
    assert first["output_ids"].tolist() == [[[10, 11]]] and first["context_ids"].shape == (1, 1, 0)
    assert first["cum_log_probs"].tolist() == [[-3.0]] and not first["is_final"][0, 0]
    assert b.add(_step([])) is None  # nothing new, not final: no response
    last = b.add(_step([12], finished=True, log_probs=[-0.5]))
    assert last["output_ids"].tolist() == [[[12]]] and last["context_ids"].tolist() == [[[10, 11]]]
    assert last["is_final"][0, 0] and last["sequence_length"].tolist() == [[1]]
    assert last["acceptance_rate"].tolist() == [[0.75]] and last["total_draft_tokens"].tolist() == [[4]]


def test_non_streaming_collects_everything_with_the_prompt():
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=False, exclude_input_in_output=False))
    assert b.add(_step([10])) is None
    out = b.add(_step([11], finished=True))
    assert out["output_ids"].tolist() == [[[1, 2, 10, 11]]] and out["sequence_length"].tolist() == [[4]]
    assert out["context_ids"].shape == (1, 1, 0) and out["is_final"][0, 0]


def test_cancelled_with_no_tokens_still_answers_final():
    b = ResponseBuilder([1], ResponseOptions(streaming=True, exclude_input_in_output=True))
    out = b.add(StepOutput("r", [], [], True, "cancelled"))
    assert out["is_final"][0, 0] and out["output_ids"].shape == (1, 1, 0)
