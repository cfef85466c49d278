"""specdec.bls without Triton: the BLS wires its calls exactly as the ensemble wires its
steps, streams one response per response of speculative_decoding with the final flag
on the last, and a cancelled request stops the engine's request once (or never starts it)."""
from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

from specdec.bls import (GENERATE_MODEL, OUTPUTS, STEPS, BlsRequest, CancelWatch, ModelError, RequestIds,
                         step_inputs)

from conftest import ROOT

TEMPLATES = ROOT / "model_repository"


def _ensemble_steps(text: str) -> list[tuple[str, dict, dict]]:
    steps = []
    for block in re.split(r"\n\s*model_name: ", text.split("ensemble_scheduling", 1)[1])[1:]:
        model = re.match(r'"(\w+)"', block).group(1)
        maps = {kind: dict(re.findall(rf'{kind} {{ key: "(\w+)" value: "(\w+)" }}', block))
                for kind in ("input_map", "output_map")}
        steps.append((model, maps["input_map"], maps["output_map"]))
    return steps


def _io(text: str, kind: str) -> list[tuple[str, str, str]]:
    """(name, data_type, dims) of a config's `input [...]` or `output [...]` entries."""
    block = re.search(rf"^{kind} \[(.*?)^\]", text, re.S | re.M).group(1)
    return re.findall(r'name: "(\w+)" data_type: (\S+) dims: \[ ([^\]]*) \]', block)


def test_the_bls_calls_are_the_ensemble_steps():
    ensemble = _ensemble_steps((TEMPLATES / "ensemble" / "config.pbtxt").read_text())
    assert [(s.model, s.input_map, s.output_map) for s in STEPS] == ensemble
    assert STEPS[1].model == GENERATE_MODEL


def test_the_bls_model_has_the_ensemble_inputs_and_outputs():
    ensemble = (TEMPLATES / "ensemble" / "config.pbtxt").read_text()
    bls = (TEMPLATES / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    for kind in ("input", "output"):
        assert _io(bls, kind) == _io(ensemble, kind)
    assert sorted(OUTPUTS) == sorted(name for name, _, _ in _io(ensemble, "output"))
    assert 'model_transaction_policy { decoupled: ${decoupled_mode:true} }' in bls


class FakeModels:
    """preprocessing: `n` rows of token ids; speculative_decoding: `steps` responses per row
    and sequence (interleaved), each one token; postprocessing: the token as text."""

    def __init__(self, rows: int = 1, steps: int = 3, fail: str | None = None, block: threading.Event | None = None,
                 sequences: int = 1):
        self.rows, self.steps, self.fail, self.block, self.sequences = rows, steps, fail, block, sequences
        self.calls: list[tuple[str, dict]] = []
        self.stops: list[tuple[str, str]] = []
        self.streamed: list[str] = []

    def call(self, model, inputs):
        self.calls.append((model, inputs))
        if model == "preprocessing":
            if self.fail == "preprocessing":
                raise ModelError("text_input is required", "INVALID_ARG")
            n = self.rows
            return {"INPUT_ID": np.ones((n, 3), np.int32), "REQUEST_INPUT_LEN": np.full((n, 1), 3, np.int32),
                    "REQUEST_OUTPUT_LEN": np.full((n, 1), 4, np.int32), "OUT_END_ID": np.full((n, 1), 2, np.int32),
                    "OUT_PAD_ID": np.full((n, 1), 2, np.int32), "BAD_WORDS_IDS": np.zeros((n, 2, 1), np.int32),
                    "STOP_WORDS_IDS": np.zeros((n, 2, 1), np.int32)}
        assert model == "postprocessing"
        token = int(inputs["TOKENS_BATCH"][0, 0, 0])
        return {"OUTPUT": np.array([f"<{token}>".encode()], object),
                "OUT_BATCH_INDEX": inputs["BATCH_INDEX"], "OUT_CUM_LOG_PROBS": np.zeros((1, 1), np.float32)}

    def stream(self, model, inputs, request_id, decoupled):
        self.streamed.append(request_id)
        assert "runtime_top_k" in inputs and "top_k" not in inputs
        for step in range(self.steps):
            for row in range(self.rows * self.sequences):
                if self.block is not None:
                    self.block.wait(5)
                if self.fail == "generate":
                    raise ModelError("the request queue is full", "UNAVAILABLE")
                yield {"output_ids": np.array([[[10 * row + step]]], np.int32),
                       "sequence_length": np.ones((1, 1), np.int32), "context_ids": np.zeros((1, 1, 0), np.int32),
                       "is_final": np.array([[step == self.steps - 1]]), "batch_index": np.array([[row]], np.int32)}

    def stop(self, model, request_id):
        self.stops.append((model, request_id))


class FakeReply:
    def __init__(self):
        self.sent: list[tuple[dict, bool]] = []
        self.failed: list[tuple[str, str]] = []
        self.cancelled = False

    def send(self, outputs, final):
        self.sent.append((outputs, final))

    def fail(self, message, code):
        self.failed.append((message, code))

    def is_cancelled(self):
        return self.cancelled


INPUTS = {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[4]], np.int32),
          "top_k": np.array([[1]], np.int32), "stream": np.array([[True]])}


def test_streams_one_response_per_engine_response_final_on_the_last():
    models, reply = FakeModels(), FakeReply()
    BlsRequest(INPUTS, models, reply, "r#bls-1").run()
    assert [(out["text_output"].tolist(), final) for out, final in reply.sent] == [
        ([b"<0>"], False), ([b"<1>"], False), ([b"<2>"], True)]
    assert set(reply.sent[0][0]) == {"text_output", "batch_index", "cum_log_probs"} and not reply.failed
    assert models.streamed == ["r#bls-1"]
    pre = models.calls[0][1]
    assert set(pre) == {"QUERY", "REQUEST_OUTPUT_LEN"}  # absent optional inputs stay absent


def test_a_batch_ends_with_its_last_entry():
    models, reply = FakeModels(rows=2, steps=2), FakeReply()
    BlsRequest({**INPUTS, "top_k": np.array([[1], [1]], np.int32)}, models, reply, "r").run()
    assert [(out["batch_index"].item(), final) for out, final in reply.sent] == [
        (0, False), (1, False), (0, False), (1, True)]


@pytest.mark.parametrize("rows,asked,parameters", [
    (2, {"num_return_sequences": np.array([[3], [3]], np.int32)}, None),
    (1, {"sampling_parameters": np.array([[b'{"n": 3}']], object)}, None),
    (1, {}, '{"num_return_sequences": 3}')])
def test_several_sequences_end_with_the_last_of_every_entry(rows, asked, parameters):
    """num_return_sequences (an input, a setting of that name or vLLM's n) answers per
    entry: the final flag waits for every entry's every sequence."""
    models, reply = FakeModels(rows=rows, steps=2, sequences=3), FakeReply()
    top_k = np.ones((rows, 1), np.int32)
    BlsRequest({**INPUTS, "top_k": top_k, **asked}, models, reply, "r", parameters=parameters).run()
    assert [final for _, final in reply.sent] == [False] * (6 * rows - 1) + [True] and not reply.failed


@pytest.mark.parametrize("where,message,code", [("preprocessing", "text_input is required", "INVALID_ARG"),
                                                ("generate", "the request queue is full", "UNAVAILABLE")])
def test_a_called_models_error_reaches_the_client(where, message, code):
    reply = FakeReply()
    BlsRequest(INPUTS, FakeModels(fail=where), reply, "r").run()
    assert reply.failed == [(message, code)] and not reply.sent


def test_cancelled_before_generation_never_starts_it():
    models, reply = FakeModels(), FakeReply()
    request = BlsRequest(INPUTS, models, reply, "r")
    request.cancel()
    request.run()
    assert reply.failed == [("the request was cancelled", "CANCELLED")]
    assert models.streamed == [] and models.stops == []


def test_cancelled_while_generating_sends_one_stop_with_the_request_id():
    gate = threading.Event()
    models, reply = FakeModels(steps=5, block=gate), FakeReply()
    request = BlsRequest(INPUTS, models, reply, "client#bls-ab-3", generate_model="spec")
    worker = threading.Thread(target=request.run)
    worker.start()
    while not models.streamed:
        time.sleep(0.01)
    request.cancel()
    request.cancel()
    gate.set()
    worker.join(5)
    assert models.stops == [("spec", "client#bls-ab-3")]
    request.cancel()  # after the end: nothing to stop
    assert len(models.stops) == 1


def test_request_ids_are_unique_and_keep_the_clients_id():
    ids = RequestIds(prefix="cafe0123")
    assert ids.next("user-7") == "user-7#bls-cafe0123-0" and ids.next("user-7") == "user-7#bls-cafe0123-1"
    assert RequestIds().next() != RequestIds().next()  # instances draw their own prefix


def test_cancel_watch_cancels_what_its_client_cancelled():
    models = FakeModels(steps=50, block=threading.Event())
    requests = [BlsRequest(INPUTS, models, FakeReply(), f"r{i}") for i in range(3)]
    workers = [threading.Thread(target=r.run) for r in requests]
    for w in workers:
        w.start()
    while len(models.streamed) < 3:
        time.sleep(0.01)
    watch = CancelWatch(poll_s=0.01)
    for r in requests:
        watch.add(r)
    requests[1].reply.cancelled = True
    deadline = time.monotonic() + 5
    while not models.stops and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    models.block.set()
    for w in workers:
        w.join(5)
    assert models.stops == [(GENERATE_MODEL, "r1")]


def test_step_inputs_rename_as_the_ensemble():
    generate = STEPS[1]
    tensors = {"top_k": 1, "top_p": 2, "stream": 3, "length_penalty": 4, "_INPUT_ID": 5, "seed": 6}
    assert step_inputs(generate, tensors) == {"runtime_top_k": 1, "runtime_top_p": 2, "streaming": 3,
                                              "len_penalty": 4, "input_ids": 5, "seed": 6}


def test_a_stream_notices_its_cancellation_at_its_next_response():
    class CancelAfterTwo(FakeReply):
        def is_cancelled(self):
            return len(self.sent) >= 2

    models, reply = FakeModels(steps=5), CancelAfterTwo()
    BlsRequest(INPUTS, models, reply, "r").run()  # no watch
    assert models.stops == [(GENERATE_MODEL, "r")]


class RecordingModels(FakeModels):
    def stream(self, model, inputs, request_id, decoupled):
        self.calls.append((model, inputs))
        yield from super().stream(model, inputs, request_id, decoupled)


def test_request_parameters_reach_both_steps_merged_into_sampling_parameters():
    """A BLS call carries no request parameters, so the BLS hands its own on as vLLM's
    `sampling_parameters` JSON, whose keys win over the parameters of the same name."""
    models, reply = RecordingModels(), FakeReply()
    sent = np.array([[json.dumps({"temperature": 0.5, "seed": 3}).encode()]], object)
    BlsRequest({**INPUTS, "sampling_parameters": sent}, models, reply, "r",
               parameters=json.dumps({"temperature": 0.9, "max_tokens": 7})).run()
    assert not reply.failed and reply.sent[-1][1]
    (_, pre), (_, generate) = models.calls[0], models.calls[1]
    expected = {"temperature": 0.5, "max_tokens": 7, "seed": 3}
    assert json.loads(pre["SAMPLING_PARAMETERS"].item()) == expected
    assert json.loads(generate["sampling_parameters"].item()) == expected


@pytest.mark.parametrize("parameters,field", [("[1, 2]", "request parameters"), ("{not json", "request parameters")])
def test_parameters_that_are_not_a_json_object_are_a_400_before_any_call(parameters, field):
    models, reply = RecordingModels(), FakeReply()
    BlsRequest(INPUTS, models, reply, "r", parameters=parameters).run()
    assert not models.calls and not reply.sent
    assert len(reply.failed) == 1 and field in reply.failed[0][0] and reply.failed[0][1] == "INVALID_ARG"
