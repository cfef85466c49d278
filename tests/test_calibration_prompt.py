"""What load-time calibration continues (specdec/calibration_prompt.py): a fixed chat
request in the model's own template where the tokenizer has one and the request fits the
context; the model's continuation of a BOS otherwise; and the calibration cache tells
the two apart."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

from engine_helpers import FAMILY, tokenizer
from specdec.calibration_prompt import CALIBRATION_REQUEST, chat_prompt_ids
from specdec.config import EngineConfig
from specdec.policy import SpeculationPolicy
import overlap


def test_the_request_in_the_models_chat_template():
    ids = chat_prompt_ids(str(FAMILY / "base"))
    want = tokenizer().apply_chat_template([{"role": "user", "content": CALIBRATION_REQUEST}],
                                           add_generation_prompt=True, tokenize=False)
    assert tokenizer().decode(ids) == want
    assert want.rstrip().endswith("assistant")  # generation starts the assistant's answer


def test_no_tokenizer_or_no_chat_template_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert chat_prompt_ids(str(tmp_path)) is None
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (FAMILY / "base" / name).is_file():
            shutil.copy(FAMILY / "base" / name, tmp_path / name)
    config = json.loads((FAMILY / "base" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_prompt_ids(str(tmp_path)) is None


def test_the_request_is_no_benchmark_question():
    assert not overlap.ngrams(CALIBRATION_REQUEST) & overlap.evaluation_ngrams()


def policy_on(max_context: int, prompt) -> tuple[SpeculationPolicy, SimpleNamespace]:
    policy = SpeculationPolicy(EngineConfig(base_model_dir="unused", adaptive_speculation=True), {}, {}, 0)
    policy.calibration_prompt = prompt
    generated = []

    def generate(req):
        generated.append(req)
        return list(range(100, 100 + req.max_tokens)), None, None
    return policy, SimpleNamespace(max_context=max_context, generate=generate, generated=generated)


def test_the_chat_request_where_it_fits_else_a_bos_continuation():
    chat = list(range(10, 63))  # 53 ids, as SmolLM2's template makes of the request
    room = 64  # the largest tree the generations run
    policy, engine = policy_on(len(chat) + 32 + room, chat)
    assert policy._measuring_prompt(engine, 32, room) == chat and not engine.generated
    assert "a chat request" in policy._calibrated_on
    policy, engine = policy_on(len(chat) + 32 + room - 1, chat)  # one position short
    bos_text = policy._measuring_prompt(engine, 32, room)
    assert bos_text == [1] + list(range(100, 124)) and "BOS" in policy._calibrated_on
    assert policy._measuring_prompt(engine, 32, room) == bos_text and len(engine.generated) == 1  # generated once
    policy, engine = policy_on(4096, None)  # no chat template
    assert policy._measuring_prompt(engine, 32, room)[0] == 1
