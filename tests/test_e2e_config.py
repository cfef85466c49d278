"""End to end: a broken model config fails that model's load with one clear message
(the server keeps serving the rest), and the non-decoupled adapter, ensemble and BLS answer.
One server for the module, started with --exit-on-error=false."""
from __future__ import annotations

import re
import shutil
import threading

import pytest
import requests

from conftest import e2e_skip_reason, serve_repository

BROKEN = {  # model → (parameter edit, expected message)
    "preprocessing_no_tokenizer": ("preprocessing", "tokenizer_dir", "/no/such/tokenizer",
                                   "parameter 'tokenizer_dir': '/no/such/tokenizer' is not a directory"),
    "speculative_decoding_bad_dtype": ("speculative_decoding", "dtype", "float13",
                                       "parameter 'dtype' must be one of"),
    "speculative_decoding_leftover": ("speculative_decoding", "dtype", "${dtype}",
                                      "parameter 'dtype' still holds a template placeholder"),
    "preprocessing_bad_default": ("preprocessing", "default_max_tokens", "many",
                                  "parameter 'default_max_tokens' must be an integer >= 1 or empty"),
    "preprocessing_unbatched": ("preprocessing", None, None, "max_batch_size must be >= 1"),
}


def _copy_model(repo, source: str, name: str, edit=None):
    shutil.copytree(repo / source, repo / name)
    config = repo / name / "config.pbtxt"
    text = config.read_text().replace(f'name: "{source}"', f'name: "{name}"')
    if edit == (None, None):  # unbatched: vLLM's models are; these entries are not
        text, count = re.subn(r"(?m)^max_batch_size: \d+$", "max_batch_size: 0", text)
        text = re.sub(r"(?s)dynamic_batching \{.*?\n\}\n", "", text)
        assert count == 1
    elif edit:
        key, value = edit
        text, count = re.subn(rf'(key: "{key}" value: {{ string_value: ")[^"]*(")', rf"\g<1>{value}\g<2>", text)
        assert count == 1
    config.write_text(text)


def _edit(repo):
    for name, (source, key, value, _) in BROKEN.items():
        _copy_model(repo, source, name, (key, value))
    _copy_model(repo, "speculative_decoding", "speculative_decoding_sync")
    text = (repo / "speculative_decoding_sync" / "config.pbtxt").read_text()
    (repo / "speculative_decoding_sync" / "config.pbtxt").write_text(
        text.replace("decoupled: true", "decoupled: false"))
    shutil.copytree(repo / "ensemble", repo / "ensemble_sync")
    text = (repo / "ensemble_sync" / "config.pbtxt").read_text()
    (repo / "ensemble_sync" / "config.pbtxt").write_text(
        text.replace('name: "ensemble"', 'name: "ensemble_sync"').replace(
            'model_name: "speculative_decoding"', 'model_name: "speculative_decoding_sync"'))
    _copy_model(repo, "tensorrt_llm_bls", "tensorrt_llm_bls_sync", ("tensorrt_llm_model_name",
                                                                    "speculative_decoding_sync"))
    text = (repo / "tensorrt_llm_bls_sync" / "config.pbtxt").read_text()
    (repo / "tensorrt_llm_bls_sync" / "config.pbtxt").write_text(text.replace("decoupled: true", "decoupled: false"))
    for model in ("ensemble", "speculative_decoding", "tensorrt_llm_bls"):
        shutil.rmtree(repo / model)


@pytest.fixture(scope="module")
def server(tmp_path_factory, e2e_base):
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    with serve_repository(tmp_path_factory.mktemp("broken"), e2e_base, edit=_edit, require_ready=False,
                          extra_args=("--exit-on-error=false",)) as s:
        yield s


def test_broken_configs_fail_their_load_with_one_clear_message(server):
    index = requests.post(f"http://{server.http_url}/v2/repository/index", json={}, timeout=10).json()
    states = {m["name"]: m for m in index}
    log = server.log_path.read_text()
    for name, (_, _, _, message) in BROKEN.items():
        assert states[name]["state"] == "UNAVAILABLE", states[name]
        assert message in states[name]["reason"], states[name]
        assert message in log
    for name in ("speculative_decoding_sync", "ensemble_sync", "tensorrt_llm_bls_sync"):
        assert states[name]["state"] == "READY", states[name]


def test_non_decoupled_ensemble_generate(server):
    url = f"http://{server.http_url}/v2/models/ensemble_sync"
    body = {"text_input": "What is ML?", "max_tokens": 8, "bad_words": "", "stop_words": "", "pad_id": 2,
            "end_id": 2}
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text_output"].startswith("What is ML?"), r.text
    r = requests.post(f"{url}/generate", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 400 and "decoupled" in r.json()["error"]


def test_non_decoupled_bls_answers_as_the_ensemble(server):
    body = {"text_input": "What is ML?", "max_tokens": 8, "return_log_probs": True}
    answers = {}
    for model in ("ensemble_sync", "tensorrt_llm_bls_sync"):
        r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers[model] = r.json()
    for key in ("text_output", "cum_log_probs", "output_log_probs"):
        assert answers["tensorrt_llm_bls_sync"][key] == answers["ensemble_sync"][key], key
    r = requests.post(f"http://{server.http_url}/v2/models/tensorrt_llm_bls_sync/generate",
                      json={**body, "stream": True}, timeout=120)
    assert r.status_code == 400 and "decoupled" in r.json()["error"]


def _infer(server, ids, max_tokens, **extra):
    inputs = [{"name": "input_ids", "datatype": "INT32", "shape": [1, len(ids)], "data": ids},
              {"name": "input_lengths", "datatype": "INT32", "shape": [1, 1], "data": [len(ids)]},
              {"name": "request_output_len", "datatype": "INT32", "shape": [1, 1], "data": [max_tokens]}]
    for name, (datatype, value) in extra.items():
        inputs.append({"name": name, "datatype": datatype, "shape": [1, 1], "data": [value]})
    r = requests.post(f"http://{server.http_url}/v2/models/speculative_decoding_sync/infer",
                      json={"inputs": inputs}, timeout=120)
    return r.status_code, r.json()


def test_non_decoupled_adapter_answers_concurrent_requests(server):
    answers = {}

    def run(n):
        answers[n] = _infer(server, [1, 100 + n, 200], 5, exclude_input_in_output=("BOOL", True))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for status, out in answers.values():
        assert status == 200, out
        outputs = {o["name"]: o for o in out["outputs"]}
        assert outputs["sequence_length"]["data"][0] == len(outputs["output_ids"]["data"]) >= 1


def test_non_decoupled_adapter_errors(server):
    status, out = _infer(server, [1, 2], 4, beam_width=("INT32", 2))
    assert status == 400 and "beam_width" in out["error"]
    status, out = _infer(server, [1, 2], 4, streaming=("BOOL", True))
    assert status == 400 and "decoupled" in out["error"]
    status, out = _infer(server, [1, 2], 4)
    assert status == 200
