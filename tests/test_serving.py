"""specdec.serving: tensors → GenerationRequest and StepOutputs → response arrays, without Triton."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.request import AcceptanceStats, StepOutput
from specdec.serving import (BatchAnswer, ResponseBuilder, ResponseOptions, batch_rows, build_request,
                             is_stop_request, refuse_batch, return_sequences, trtllm_sampling)
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
        min_p=np.array([[0.25]], np.float32), min_length=np.array([[2]], np.int32), streaming=np.array([[True]]),
        stop_words_list=to_word_list([[1, 2], [3]])[None], speculative_method=np.array([[b"eagle3"]], object),
        eagle_depth=np.array([[4]], np.int32), prompt_lookup_tokens=np.array([[0]], np.int32)))
    assert req.input_ids == [5, 6, 7] and req.max_tokens == 4
    assert req.end_id == 2 and req.pad_id is None
    assert (req.sampling.top_k, req.sampling.top_p, req.sampling.seed, req.sampling.min_tokens) == (3, 0.5, 9, 2)
    assert req.sampling.temperature == pytest.approx(0.7) and req.sampling.min_p == pytest.approx(0.25)
    assert req.stop_words == [[1, 2], [3]] and req.bad_words == []
    assert req.spec.method == "eagle3" and req.spec.depth == 4 and req.spec.prompt_lookup_tokens == 0
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
    req, _ = build_request("r", _getter(**{**BASE, "repetition_penalty": np.array([[0.0]], np.float32)}))
    with pytest.raises(InputError, match="repetition_penalty must be > 0"):
        req.validate(vocab_size=100, max_context=64, max_tokens_limit=8)
    with pytest.raises(InputError, match="temperature must be >= 0"):
        build_request("r", _getter(**{**BASE, "temperature": np.array([[-1.0]], np.float32)}))
    req, _ = build_request("r", _getter(**{**BASE, "min_p": np.array([[1.5]], np.float32)}))
    with pytest.raises(InputError, match="min_p must be in"):
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
    assert [first["num_output_tokens"].tolist(), last["num_output_tokens"].tolist()] == [[[2]], [[1]]]
    assert last["num_output_tokens"].dtype == np.uint32


def test_non_streaming_collects_everything_with_the_prompt():
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=False, exclude_input_in_output=False))
    assert b.add(_step([10])) is None
    out = b.add(_step([11], finished=True))
    assert out["output_ids"].tolist() == [[[1, 2, 10, 11]]] and out["sequence_length"].tolist() == [[4]]
    assert out["num_output_tokens"].tolist() == [[2]]  # generated tokens: the prompt never counts
    assert out["context_ids"].shape == (1, 1, 0) and out["is_final"][0, 0]


def test_cancelled_with_no_tokens_still_answers_final():
    b = ResponseBuilder([1], ResponseOptions(streaming=True, exclude_input_in_output=True))
    out = b.add(StepOutput("r", [], [], True, "cancelled"))
    assert out["is_final"][0, 0] and out["output_ids"].shape == (1, 1, 0)
    assert out["finish_reason"].tolist() == [["abort"]]


@pytest.mark.parametrize("reason,named", [("length", "length"), ("stop", "stop"), ("end_id", "stop"),
                                          ("cancelled", "abort")])
def test_finish_reason_and_prompt_length_as_vllms_backend_names_them(reason, named):
    b = ResponseBuilder([1, 2, 3], ResponseOptions(streaming=True, exclude_input_in_output=True))
    first, last = b.add(_step([10])), b.add(StepOutput("r", [11], [], True, reason))
    assert [first["finish_reason"].tolist(), last["finish_reason"].tolist()] == [[["None"]], [[named]]]
    assert first["finish_reason"].dtype == np.object_
    assert last["num_input_tokens"].tolist() == [[3]] and last["num_input_tokens"].dtype == np.uint32


def test_cumulative_logprob_is_the_answers_log_probability_so_far():
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=True, exclude_input_in_output=True))
    first = b.add(StepOutput("r", [10, 11], [-0.5, -0.25], False))
    last = b.add(StepOutput("r", [12], [-1.0], True, "length"))
    assert [first["cumulative_logprob"].tolist(), last["cumulative_logprob"].tolist()] == [[[-0.75]], [[-1.75]]]
    assert last["cumulative_logprob"].dtype == np.float32
    assert np.array_equal(last["cumulative_logprob"], last["cum_log_probs"])


def test_vllms_output_flags_are_accepted_and_return_logprobs_is_return_log_probs():
    flags = {name: np.array([[True]]) for name in ("return_finish_reason", "return_cumulative_logprob",
                                                   "return_num_input_tokens", "return_num_output_tokens")}
    req, _ = build_request("r", _getter(**BASE, **flags, return_logprobs=np.array([[True]])))
    assert req.return_log_probs
    for name in ("return_logprobs", "return_cumulative_logprob"):  # each asks for log-probs alone
        assert build_request("r", _getter(**BASE, **{name: np.array([[True]])}))[0].return_log_probs
        assert not build_request("r", _getter(**BASE, **{name: np.array([[False]])}))[0].return_log_probs
    with pytest.raises(InputError, match="return_finish_reason"):
        build_request("r", _getter(**BASE, return_finish_reason=np.array([[b"yes"]], object)))


# -- TensorRT-LLM's conventions ---------------------------------------------------------------
# inflight_batcher_llm_client.py's request for one prompt, as it sends it by default
# (its --top-k 1, --top-p 0.0, --temperature 1.0, --beam-width 1; pad_id 50256 without a tokenizer).
INFLIGHT_CLIENT = dict(
    input_ids=np.array([[5, 6, 7]], np.int32), input_lengths=np.array([[3]], np.int32),
    request_output_len=np.array([[16]], np.int32), beam_width=np.array([[1]], np.int32),
    temperature=np.array([[1.0]], np.float32), streaming=np.array([[True]]),
    end_id=np.array([[-1]], np.int32), pad_id=np.array([[50256]], np.int32),
    runtime_top_k=np.array([[1]], np.int32), runtime_top_p=np.array([[0.0]], np.float32))


@pytest.mark.parametrize("temperature,top_k,top_p,expected", [
    (None, None, None, (0.0, 0, 1.0)),  # nothing sent: greedy, as TensorRT-LLM
    (1.0, 1, 0.0, (0.0, 0, 1.0)),  # the inflight client's defaults: top_k 1 is greedy
    (0.8, None, None, (0.0, 0, 1.0)),  # top_k 0 and top_p 0 (unset) are greedy whatever the temperature
    (0.8, 0, 0.0, (0.0, 0, 1.0)),
    (0.8, 0, -0.5, (0.0, 0, 1.0)),  # top_p <= 0 is unset
    (0.8, 1, 0.9, (0.0, 0, 1.0)),
    (0.8, 40, 0.0, (0.8, 40, 1.0)),  # top-k sampling: TensorRT-LLM sets top_p to 1
    (0.8, 40, None, (0.8, 40, 1.0)),
    (0.8, 0, 0.9, (0.8, 0, 0.9)),  # top-p sampling
    (None, 0, 0.9, (1.0, 0, 0.9)),  # temperature unset is 1
    (0.8, 40, 0.9, (0.8, 40, 0.9)),
    (0.0, 40, 0.9, (0.0, 0, 1.0)),  # temperature 0 is greedy
    (0.8, -1, 0.9, (0.8, 0, 0.9)),  # vLLM's top_k -1: no top-k
    (0.8, -1, None, (0.0, 0, 1.0)),
])
def test_sampling_follows_tensorrt_llm(temperature, top_k, top_p, expected):
    assert trtllm_sampling(temperature, top_k, top_p) == pytest.approx(expected)


@pytest.mark.parametrize("temperature,top_k,top_p,expected", [
    (0.8, None, None, (0.8, 0, 1.0)),  # min-p alone samples
    (0.8, 40, None, (0.8, 40, 1.0)),
    (0.8, 1, None, (0.0, 0, 1.0)),  # top_k 1 and temperature 0 stay greedy
    (0.0, None, 0.9, (0.0, 0, 1.0)),
])
def test_a_min_p_asks_for_sampling_as_top_k_and_top_p_do(temperature, top_k, top_p, expected):
    assert trtllm_sampling(temperature, top_k, top_p, min_p=0.1) == pytest.approx(expected)


@pytest.mark.parametrize("args,match", [((None, -2, None), "top_k must be >= 0"),
                                        ((None, None, 1.5), r"top_p must be in \(0, 1\] \(0 or less means unset"),
                                        ((-0.1, 1, None), "temperature must be >= 0")])
def test_values_tensorrt_llm_refuses_are_refused(args, match):
    with pytest.raises(InputError, match=match):
        trtllm_sampling(*args)


def test_the_inflight_clients_default_request_is_greedy_and_accepted():
    req, opts = build_request("r", _getter(**INFLIGHT_CLIENT))
    req.validate(vocab_size=49152, max_context=64, max_tokens_limit=16)  # pad_id 50256: unused, accepted
    assert req.sampling.greedy and req.end_id is None and opts.streaming


@pytest.mark.parametrize("extra,match", [
    (dict(beam_width=np.array([[4]], np.int32)), "beam search is not supported"),
    (dict(return_context_logits=np.array([[True]])), "return_context_logits is not supported"),
    (dict(return_generation_logits=np.array([[True]])), "return_generation_logits is not supported"),
])
def test_what_the_engine_cannot_do_is_refused_with_the_reason(extra, match):
    with pytest.raises(InputError, match=match):
        build_request("r", _getter(**{**INFLIGHT_CLIENT, **extra}))


def test_their_defaults_are_accepted():
    build_request("r", _getter(**INFLIGHT_CLIENT, num_return_sequences=np.array([[1]], np.int32),
                               return_context_logits=np.array([[False]]),
                               return_generation_logits=np.array([[False]]),
                               return_log_probs=np.array([[True]]), return_perf_metrics=np.array([[True]])))


def test_stop_requests_are_recognised():
    # prepare_stop_signals(): input_ids [1, 1] (uninitialised), input_lengths 0, request_output_len 0
    stop = dict(input_ids=np.empty((1, 1), np.int32), input_lengths=np.zeros((1, 1), np.int32),
                request_output_len=np.zeros((1, 1), np.int32), stop=np.array([[True]]))
    assert is_stop_request(_getter(**stop))
    assert not is_stop_request(_getter(**INFLIGHT_CLIENT))
    assert not is_stop_request(_getter(**{**INFLIGHT_CLIENT, "stop": np.array([[False]])}))


def test_a_batch_becomes_one_request_per_entry():
    batch = dict(input_ids=np.array([[5, 6, 7], [8, 9, 0]], np.int32), input_lengths=np.array([[3], [2]], np.int32),
                 request_output_len=np.array([[4], [5]], np.int32), streaming=np.array([[True], [True]]))
    rows = batch_rows(_getter(**batch))
    built = [build_request(f"r{b}", get, batch_index=b) for b, get in enumerate(rows)]
    assert [(r.input_ids, r.max_tokens, o.batch_index) for r, o in built] == [([5, 6, 7], 4, 0), ([8, 9], 5, 1)]
    with pytest.raises(InputError, match="every input needs one row per entry"):
        build_request("r", batch_rows(_getter(**{**batch, "temperature": np.array([[0.5]], np.float32)}))[1])
    for rows, answers in ((2, 2), (1, 3)):
        with pytest.raises(InputError, match="needs the model in decoupled mode"):
            refuse_batch(rows, answers, decoupled=False)
        refuse_batch(rows, answers, decoupled=True)
    refuse_batch(1, 1, decoupled=False)
    assert len(batch_rows(_getter(**BASE))) == 1


def test_each_return_sequence_draws_with_its_own_seed_and_says_which_it_is():
    get = _getter(**{**BASE, "num_return_sequences": np.array([[3]], np.int32),
                     "random_seed": np.array([[2 ** 64 - 2]], np.uint64)})
    assert return_sequences(get) == 3 and return_sequences(_getter(**BASE)) == 1
    built = [build_request(f"r{s}", get, sequence_index=s) for s in range(3)]
    assert [(r.sampling.seed, o.sequence_index) for r, o in built] == [(2 ** 64 - 2, 0), (2 ** 64 - 1, 1), (0, 2)]
    assert build_request("r", _getter(**BASE), sequence_index=2)[0].sampling.seed is None  # unseeded: drawn
    b = ResponseBuilder([1], built[2][1])
    assert b.add(StepOutput("r", [5], [], True, "length"))["sequence_index"].tolist() == [[2]]
    for n in (0, 129):
        with pytest.raises(InputError, match=r"num_return_sequences must be in \[1, 128\]"):
            return_sequences(_getter(**{**BASE, "num_return_sequences": np.array([[n]], np.int32)}))


SCALARS = {"sequence_length": np.int32, "cum_log_probs": np.float32, "batch_index": np.int32,
           "sequence_index": np.int32, "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
           "kv_cache_alloc_total_blocks": np.int32, "arrival_time_ns": np.int64,
           "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64, "last_token_time_ns": np.int64,
           "acceptance_rate": np.float32, "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}


def test_responses_have_tensorrt_llms_shapes_and_a_stream_never_repeats_the_prompt():
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=True, exclude_input_in_output=False, batch_index=3))
    first = b.add(StepOutput("r", [10, 11], [-1.0, -2.0], False, scheduled_ns=5))
    last = b.add(StepOutput("r", [12], [-0.5], True, "length", scheduled_ns=5))
    assert first["output_ids"].tolist() == [[[10, 11]]] and last["output_ids"].tolist() == [[[12]]]
    for arrays in (first, last):
        assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].shape[:2] == (1, 1)
        assert arrays["output_log_probs"].shape == (1, 1, arrays["sequence_length"][0, 0])
        for name, dtype in SCALARS.items():
            assert arrays[name].shape == (1, 1) and arrays[name].dtype == dtype, name
    assert last["batch_index"][0, 0] == 3 and last["sequence_index"][0, 0] == 0
    assert (last["first_scheduled_time_ns"][0, 0], last["kv_cache_alloc_new_blocks"][0, 0]) == (5, 1)
    assert first["arrival_time_ns"][0, 0] <= first["first_token_time_ns"][0, 0] <= last["last_token_time_ns"][0, 0]
    assert first["first_token_time_ns"][0, 0] == last["first_token_time_ns"][0, 0]


def test_top_alternatives_travel_per_token_and_are_empty_unless_asked():
    top = lambda t: [(t, -0.1), (t + 1, -3.0)]  # noqa: E731
    b = ResponseBuilder([1], ResponseOptions(streaming=False))
    assert b.add(StepOutput("r", [10, 11], [-0.1, -0.1], False, top_log_probs=[top(10), top(11)])) is None
    last = b.add(StepOutput("r", [12], [-0.1], True, "length", top_log_probs=[top(12)]))
    assert last["output_top_token_ids"].dtype == np.int32 and last["output_top_log_probs"].dtype == np.float32
    assert last["output_top_token_ids"].tolist() == [[[[10, 11], [11, 12], [12, 13]]]]
    assert np.allclose(last["output_top_log_probs"], [[[[-0.1, -3.0]] * 3]])
    plain = ResponseBuilder([1], ResponseOptions(streaming=True)).add(StepOutput("r", [10], [], True, "length"))
    assert plain["output_top_token_ids"].shape == (1, 1, 0, 0)
    request, _ = build_request("r", _getter(**INFLIGHT_CLIENT, top_log_probs=np.array([[5]], np.int32),
                                            return_prompt_log_probs=np.array([[True]])))
    assert request.top_log_probs == 5 and request.return_prompt_log_probs


def test_the_prompt_scores_go_out_once_with_the_first_response():
    b = ResponseBuilder([1, 2, 3], ResponseOptions(streaming=True))
    first = b.add(StepOutput("r", [10], [], False, prompt_log_probs=[-1.0, -2.0],
                             prompt_top_log_probs=[[(2, -1.0)], [(7, -0.5)]]))
    second = b.add(StepOutput("r", [11], [], True, "length"))
    assert first["prompt_log_probs"].tolist() == [[[-1.0, -2.0]]]
    assert first["prompt_top_token_ids"].tolist() == [[[[2], [7]]]]
    assert second["prompt_log_probs"].shape == (1, 1, 0) and second["prompt_top_token_ids"].shape == (1, 1, 0, 0)


def test_a_batch_answer_ends_with_its_last_entry():
    answer = BatchAnswer([ResponseBuilder([1], ResponseOptions(streaming=True, batch_index=b)) for b in range(2)])
    assert answer.add(1, StepOutput("r", [5], [], False))[1] is False
    assert answer.add(1, StepOutput("r", [6], [], True, "length"))[1] is False
    assert answer.add(0, StepOutput("r", [], [], False)) == (None, False)
    arrays, last = answer.add(0, StepOutput("r", [7], [], True, "length"))
    assert last and arrays["batch_index"][0, 0] == 0


@pytest.mark.parametrize("reason,generated", [("end_id", True), ("stop", True), ("cancelled", False)])
def test_an_answer_that_ends_before_any_token_is_sent_is_timed_if_it_generated_one(reason, generated):
    """An end token as the first token (or stop words cut away) was generated, though
    nothing is sent: its first and last token times are set; a request cancelled before
    generating has none (0)."""
    b = ResponseBuilder([1, 2], ResponseOptions(streaming=False, exclude_input_in_output=True))
    out = b.add(StepOutput("r", [], [], True, reason, scheduled_ns=5))
    assert out["output_ids"].shape == (1, 1, 0) and out["num_output_tokens"].tolist() == [[0]]
    first, last = out["first_token_time_ns"][0, 0], out["last_token_time_ns"][0, 0]
    if generated:
        assert out["arrival_time_ns"][0, 0] <= first == last
    else:
        assert first == last == 0
