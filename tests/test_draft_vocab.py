"""Drafting over a drafting vocabulary (`draft_vocab.safetensors` in the drafter's
folder, FR-Spec) for EAGLE-1/2, Medusa and the draft model: drafts come from it alone,
output stays exact, and a bad file is a clear load error naming the config parameter."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine_helpers import FAMILY, code_prompts, make_engine, request
from specdec.drafters.loader import DRAFT_VOCAB_FILE
from specdec.errors import ConfigError
from tiny_family import active_tokens

NEW_TOKENS = 48
# method -> (the family's folder, the config parameter naming it)
FOLDERS = {"eagle2": ("eagle", "eagle_dir"), "eagle": ("eagle", "eagle_dir"),
           "medusa": ("medusa", "medusa_dir"), "draft_model": ("draft", "draft_model_dir")}


def drafter_dir_with(tmp_path, folder: str, token_ids: torch.Tensor):
    """A copy of the tiny family's `folder` with a drafting vocabulary of `token_ids`."""
    out = tmp_path / folder
    shutil.copytree(FAMILY / folder, out)
    save_file({"token_ids": token_ids}, str(out / DRAFT_VOCAB_FILE))
    return out


def half_of_the_active_tokens() -> torch.Tensor:
    """Every other token the tiny family's text uses (ascending ids)."""
    return active_tokens(FAMILY / "base")[::2].sort().values


def drafted_tokens(engine, method: str, prompts: list[list[int]], monkeypatch) -> tuple[set[int], list[list[int]]]:
    """Every token the method's drafter proposed (roots excluded), and the outputs."""
    drafter = engine.drafters[method]
    seen: set[int] = set()
    propose = drafter.propose

    def recording(states, settings):
        trees = propose(states, settings)
        for tree in trees:
            seen.update(tree.tokens[1:].tolist())
        return trees
    monkeypatch.setattr(drafter, "propose", recording)
    outputs = [engine.generate(request(p, NEW_TOKENS, method=method))[0] for p in prompts]
    monkeypatch.setattr(drafter, "propose", propose)
    return seen, outputs


@pytest.mark.parametrize("method", ["eagle2", "eagle", "medusa", "draft_model"])
def test_drafts_come_from_the_drafting_vocabulary_and_output_stays_exact(tmp_path, monkeypatch, method):
    """Half of the tokens the tiny family's text uses make the vocabulary: with the full
    LM head the drafter proposes tokens of the other half, with the file never; greedy
    output equals plain decoding's either way."""
    folder, parameter = FOLDERS[method]
    vocab = half_of_the_active_tokens()
    prompts = code_prompts(3)
    full = make_engine(dtype="float64")
    plain = [full.generate(request(p, NEW_TOKENS))[0] for p in prompts]
    seen_full, out_full = drafted_tokens(full, method, prompts, monkeypatch)
    assert seen_full - set(vocab.tolist()), "the test's vocabulary must exclude tokens the drafter proposes"
    reduced = make_engine(dtype="float64", **{parameter: str(drafter_dir_with(tmp_path, folder, vocab))})
    seen, out = drafted_tokens(reduced, method, prompts, monkeypatch)
    assert seen and seen <= set(vocab.tolist())
    assert out == plain and out_full == plain


@pytest.mark.parametrize("folder, parameter", sorted(set(FOLDERS.values())))
@pytest.mark.parametrize("token_ids, message", [
    (torch.tensor([3, 1 << 20]), "below the vocabulary size"),
    (torch.tensor([-1, 3]), "below the vocabulary size"),
    (torch.tensor([5, 5, 7]), "distinct"),
    (torch.tensor([[1, 2]]), "1-D integer"),
    (torch.tensor([1.0, 2.0]), "1-D integer"),
])
def test_a_bad_drafting_vocabulary_is_a_load_error_naming_the_file(tmp_path, folder, parameter, token_ids, message):
    with pytest.raises(ConfigError, match=f"{parameter}: {DRAFT_VOCAB_FILE}.*{message}"):
        make_engine(**{parameter: str(drafter_dir_with(tmp_path, folder, token_ids))})


def test_medusa_keeps_only_the_drafting_vocabularys_rows(tmp_path):
    """With the file, each Medusa head's projection holds the vocabulary's K rows alone
    (the full ones are freed at load), and its logits are the full head's at those ids."""
    vocab = half_of_the_active_tokens()
    full = make_engine(dtype="float64").drafters["medusa"].heads
    kept = make_engine(dtype="float64", medusa_dir=str(drafter_dir_with(tmp_path, "medusa", vocab)))
    heads = kept.drafters["medusa"].heads
    assert [tuple(head[-1].weight.shape) for head in heads] == [(len(vocab), full[0][-1].in_features)] * len(full)
    hidden = torch.randn(5, full[0][-1].in_features, dtype=torch.float64)  # [B, H]
    torch.testing.assert_close(heads(hidden), full(hidden)[..., vocab], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["eagle2", "draft_model"])
def test_the_drafting_vocabularys_projection_is_routed_like_every_linear_on_cpu_float32(tmp_path, method):
    """EAGLE-1/2's and the draft model's projection onto the vocabulary's rows is a
    module the engine routes on the CPU in float32 (oneDNN or an MKL pack where that
    measures faster, `models/cpu_linear.py`), not a bare matmul left to MKL's sgemm, and
    it scores each token as the target's LM head row does."""
    from specdec.models.cpu_linear import PackedCpuLinear, onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    folder, parameter = FOLDERS[method]
    vocab = half_of_the_active_tokens()
    engine = make_engine(dtype="float32", **{parameter: str(drafter_dir_with(tmp_path, folder, vocab))})
    drafter = engine.drafters[method]
    assert isinstance(drafter.vocab_head, PackedCpuLinear)
    lm_head = (engine.target if method == "eagle2" else drafter.model).lm_head.weight  # [V, H]
    hidden = torch.randn(3, lm_head.shape[1])  # [B, H]
    with torch.inference_mode():
        got = drafter.vocab_head(hidden)  # [B, K]
    torch.testing.assert_close(got, hidden @ lm_head[vocab.long()].T, rtol=1e-5, atol=1e-5)
