"""The tiny family (tests/tiny_family.py) keeps what the engine tests rely on: each
member in its upstream layout, greedy text that does not settle into a short loop, and
drafters of every kind that the base accepts often but not always."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from engine_helpers import code_prompts, make_engine, request
from tiny_family import VOCAB, tiny_family

NEW_TOKENS = 48
# τ of the default trees and chains (float32, three HumanEval prompts); measured
# 2.4 (medusa) to 3.9 (eagle) when written.
TAU_RANGE = (1.8, 4.6)


def _keys(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_each_member_has_its_upstream_layout():
    family = tiny_family()
    for name in ("base", "draft"):
        cfg = json.loads((family / name / "config.json").read_text())
        assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (VOCAB, 1, 2)
        assert (family / name / "tokenizer.json").is_file() and (family / name / "model.safetensors").is_file()
    eagle = _keys(family / "eagle" / "model.safetensors")
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= eagle and "embed_tokens.weight" not in eagle
    assert "layers.0.input_layernorm.weight" not in eagle  # EAGLE-1's first layer has none
    eagle3 = _keys(family / "eagle3" / "model.safetensors")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight", "d2t", "t2d"} <= eagle3
    assert json.loads((family / "eagle3" / "config.json").read_text())["draft_vocab_size"] < VOCAB
    medusa = _keys(family / "medusa" / "medusa_lm_head.safetensors")
    assert {"0.0.linear.weight", "0.1.weight", "3.1.weight"} <= medusa


@pytest.fixture(scope="module")
def engine():
    family = tiny_family()
    return make_engine(base_model_dir=str(family / "base"), eagle_dir=str(family / "eagle"),
                       eagle3_dir=str(family / "eagle3"), medusa_dir=str(family / "medusa"),
                       draft_model_dir=str(family / "draft"), dtype="float32",
                       prompt_lookup_tokens=0)  # the drafters' own acceptance: no branch copied from the text


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(3)


def test_greedy_text_does_not_settle_into_a_short_loop(engine, prompts):
    for ids in prompts:
        out = engine.generate(request(ids, NEW_TOKENS))[0]
        assert len(set(out)) >= 15, out
        tail = out[NEW_TOKENS // 2:]
        assert all(tail[p:] != tail[:-p] for p in range(1, 9)), out


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle3", "medusa", "draft_model"])
def test_drafts_are_accepted_often_but_not_always(engine, prompts, method):
    taus, drafted, accepted = [], 0, 0
    for ids in prompts:
        _, _, last = engine.generate(request(ids, NEW_TOKENS, method))
        taus.append(last.stats.tau)
        drafted += last.stats.total_draft_tokens
        accepted += last.stats.total_accepted_draft_tokens
    tau = sum(taus) / len(taus)
    assert TAU_RANGE[0] < tau < TAU_RANGE[1], (method, taus)
    assert accepted < 0.9 * drafted, (method, accepted, drafted)
