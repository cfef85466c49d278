"""The drafters' training scripts (`tools/train/`) on the tiny family: a short run of
each writes checkpoints the engine's own loaders read, a rerun resumes from the saved
state instead of training again, and a state left by another run (other data or
settings) is refused with a message instead of being resumed into this one."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import model_family

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "train"))
sys.path.insert(0, str(ROOT / "tools"))
import setup_model  # noqa: E402
import train_draft  # noqa: E402
import train_heads  # noqa: E402
from data import HOLDOUT_EVERY  # noqa: E402
from engine_helpers import request, run_batch  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.drafters.loader import DRAFT_VOCAB_FILE  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402


def _conversations(path: Path, count: int, seed: int = 0) -> Path:
    """JSONL in self_distill.py's shape: token ids only (no text shared with the question sets)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            prompt = [1] + [rng.randrange(300, 2000) for _ in range(rng.randrange(4, 10))]
            answer = [rng.randrange(300, 2000) for _ in range(rng.randrange(12, 40))]
            f.write(json.dumps({"index": i, "kind": "magpie", "user": "", "answer": "", "input_ids": prompt + answer,
                                "prompt_len": len(prompt)}) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    family = model_family()
    data = _conversations(tmp / "data.jsonl", 24)
    common = ["--base", str(family / "base"), "--data", str(data), "--work", str(tmp / "work"), "--seed", "0"]
    heads = common + ["--out", str(tmp / "out"), "--epochs", "1", "--batch-tokens", "256", "--snapshots", "100"]
    draft = common + ["--out", str(tmp / "out" / "draft"), "--layers", "1", "--batch-tokens", "256"]
    return tmp, family, heads, draft


def test_heads_and_draft_train_into_layouts_that_setup_completes_and_the_engine_serves(run, monkeypatch):
    tmp, family, heads, draft = run
    train_heads.main(heads)
    train_draft.main(draft)
    out = tmp / "out"
    meta = json.loads((out / "eagle3" / "training.json").read_text())
    assert meta["answer_tokens_seen"] > 0 and meta["steps"] > 1
    assert (tmp / "work" / "snapshots" / "100" / "eagle3" / "config.json").is_file()
    # What setup does with the committed parts: Medusa's projections and the draft
    # model's embeddings and tokenizer come from the target.
    monkeypatch.setattr(setup_model, "BASE_DIR", family / "base")
    for name, complete in (("medusa", setup_model.complete_medusa), ("draft", setup_model.complete_draft)):
        (tmp / "served" / name).mkdir(parents=True)
        complete(out / name, tmp / "served" / name)
    engine = Engine(EngineConfig(base_model_dir=str(family / "base"), eagle_dir=str(out / "eagle"),
                                 eagle3_dir=str(out / "eagle3"), medusa_dir=str(tmp / "served" / "medusa"),
                                 draft_model_dir=str(tmp / "served" / "draft"), dtype="float64",
                                 max_seq_len=256, max_batch_size=5, adaptive_speculation=False))
    prompt = [1, 534, 292, 668, 292, 1200]
    methods = ("none", "eagle", "eagle2", "eagle3", "medusa", "draft_model")
    outs = run_batch(engine, [request(prompt, 12, method=m, rid=m) for m in methods])
    for m in methods[1:]:
        assert outs[m] == outs["none"], m  # greedy speculation with the trained drafters is lossless
    # EAGLE-1/2, Medusa and the draft model draft over the tokens training ranked over
    # (the same data, so the same tokens), and --draft-vocab-only writes the same ones for
    # heads saved before training wrote them
    assert engine.drafters["eagle2"].vocab_d2t is not None
    written = load_file(str(out / "eagle" / DRAFT_VOCAB_FILE))["token_ids"]
    assert written.dtype == torch.int32  # half of int64's bytes in the committed folders
    for method, folder in (("medusa", "medusa"), ("draft_model", "draft")):
        assert torch.equal(load_file(str(tmp / "served" / folder / DRAFT_VOCAB_FILE))["token_ids"], written)
        assert torch.equal(engine.drafters[method].vocab_ids, written)
    train_heads.main(heads[:heads.index("--out")] + ["--out", str(tmp / "vocab_only"), "--draft-vocab-only"])
    assert torch.equal(load_file(str(tmp / "vocab_only" / "eagle" / DRAFT_VOCAB_FILE))["token_ids"], written)


def test_a_rerun_resumes_and_another_runs_state_is_refused(run, capsys):
    tmp, _, heads, draft = run
    capsys.readouterr()
    train_heads.main(heads)
    train_draft.main(draft)
    out = capsys.readouterr().out
    assert out.count("resumed at step") == 2
    with pytest.raises(SystemExit, match="another training run"):
        train_heads.main(heads[:-4] + ["--lr", "0.002"] + heads[-4:])
    more = _conversations(tmp / "more.jsonl", 30, seed=1)
    with pytest.raises(SystemExit, match="another training run"):
        train_draft.main([str(more) if a == str(tmp / "data.jsonl") else a for a in draft])


def test_without_medusa_only_the_eagle_heads_are_written(run):
    tmp, family, heads, _ = run
    out = tmp / "eagle_only"
    args = [str(out) if a == str(tmp / "out") else a for a in heads]
    args = [str(tmp / "work_eagle_only") if a == str(tmp / "work") else a for a in args]
    train_heads.main(args + ["--medusa-heads", "0"])
    assert sorted(p.name for p in out.iterdir()) == ["eagle", "eagle3"]
    assert json.loads((out / "eagle" / "training.json").read_text())["steps"] > 1


def test_medusa_only_trains_and_writes_the_medusa_heads_alone(run):
    """--medusa-only goes on from --init's Medusa heads (its EAGLE heads are not read) and
    writes medusa/ alone, scored per head."""
    tmp, family, heads, _ = run
    out = tmp / "medusa_only"
    train_heads.main(heads)  # the heads it goes on from (already there when the first test ran)
    data = _conversations(tmp / "medusa_only.jsonl", 60, seed=4)  # 60: one is held out
    args = ["--base", str(family / "base"), "--data", str(data), "--work", str(tmp / "work_medusa_only"),
            "--seed", "0", "--out", str(out), "--epochs", "1", "--batch-tokens", "256"]
    train_heads.main(args + ["--medusa-only", "--init", str(tmp / "out")])
    assert sorted(p.name for p in out.iterdir()) == ["medusa"]
    meta = json.loads((out / "medusa" / "training.json").read_text())
    before = json.loads((tmp / "out" / "medusa" / "training.json").read_text())
    assert meta["answer_tokens_seen"] == before["answer_tokens_seen"] + meta["answer_tokens_this_run"]
    assert meta["holdout_top1_before"] != meta["holdout_top1_after"]
    scores = meta["holdout_top1_after"]["all"]
    assert sorted(scores) == ["answer_tokens", "medusa_per_head"] and len(scores["medusa_per_head"]) == 4
    new, old = (load_file(str(d / "medusa" / "medusa_resblocks.safetensors")) for d in (out, tmp / "out"))
    assert new.keys() == old.keys() and any(not torch.equal(new[k], old[k]) for k in new)
    assert (out / "medusa" / DRAFT_VOCAB_FILE).is_file()
    with pytest.raises(SystemExit):
        train_heads.main(args + ["--medusa-only", "--medusa-heads", "0"])


COMMITTED_DATA = ROOT / "checkpoints" / "smollm2-135m-instruct" / "training_data" / "self_distill.jsonl.xz"


@pytest.mark.skipif(not (setup_model.FAMILY_DIR / "base" / "tokenizer.json").is_file(),
                    reason="no SmolLM2 tokenizer (run bash tools/setup_env.sh)")
def test_the_committed_self_distilled_data_leaves_nothing_to_write(tmp_path, capsys):
    """train_family.sh unpacks the committed conversations; self_distill.py must then see
    every one of its default 1,488 as written, in the records the training reads."""
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import packed_conversations
    import self_distill
    from data import load_dataset
    from transformers import AutoTokenizer
    out = tmp_path / "self_distill.jsonl"
    packed_conversations.unpack(COMMITTED_DATA, out, AutoTokenizer.from_pretrained(setup_model.FAMILY_DIR / "base"))
    assert self_distill.main(["--model", str(setup_model.FAMILY_DIR / "base"), "--out", str(out)]
                             + ["--conversations", "1488", "--seed", "0"]) == 0
    assert "1488 conversations already in" in capsys.readouterr().out
    ds = load_dataset([out], max_len=1024)
    # 1,400 answered (88 user turns were too long); the overlap check drops one, whose answer
    # says "takes a string as an argument and returns" as a HumanEval prompt does
    assert (len(ds.conversations), ds.overlap.dropped) == (1399, [1407])


@pytest.mark.skipif(not (setup_model.FAMILY_DIR / "base" / "tokenizer.json").is_file(),
                    reason="no SmolLM2 tokenizer (run bash tools/setup_env.sh)")
def test_committed_conversations_unpack_to_what_packs_to_them_again(tmp_path):
    """The committed files drop each answer's text and unpacking decodes it again: packing
    the unpacked file gives the committed bytes back, every answered record has its text,
    and a record whose text is not its ids' decoding is refused instead of lost."""
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import packed_conversations
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(setup_model.FAMILY_DIR / "base")
    unpacked, again = tmp_path / "first.jsonl", tmp_path / "first.jsonl.xz"
    packed_conversations.unpack(COMMITTED_DATA, unpacked, tokenizer)
    records = [json.loads(line) for line in unpacked.read_text().splitlines()]
    answered = [r for r in records if "input_ids" in r]
    assert len(records) == 1488 and len(answered) == 1400
    assert all(list(r)[:4] == ["index", "kind", "user", "answer"] and r["answer"] for r in answered)
    packed_conversations.pack(unpacked, again, tokenizer)
    assert again.read_bytes() == COMMITTED_DATA.read_bytes()
    # every prompt is the chat template around its user text, so none of their ids are committed
    import lzma
    committed = [json.loads(line) for line in lzma.decompress(COMMITTED_DATA.read_bytes()).splitlines()]
    assert sum("answer_ids" in r for r in committed) == 1400 and not any("input_ids" in r for r in committed)
    # a prompt the template does not rebuild keeps its ids, and unpacks as it was
    odd = dict(answered[0], input_ids=[answered[0]["input_ids"][1]] + answered[0]["input_ids"][1:])
    packed = packed_conversations.pack_lines([json.dumps(odd)], tokenizer)
    assert "input_ids" in json.loads(packed[0])
    assert packed_conversations.unpack_lines(packed, tokenizer) == [json.dumps(odd)]
    answered[0]["answer"] += " (edited)"
    with pytest.raises(ValueError, match="line 1: the answer text is not"):
        packed_conversations.pack_lines([json.dumps(answered[0])], tokenizer)


def test_each_later_rounds_committed_data_follows_the_earlier_indexes():
    """Each later round's committed conversations follow the earlier ones' indexes without
    reusing one: round 5's 2,320 of indexes 1,488-3,907 (the writing was stopped with its
    last batch in flight), as train_family.sh's comment and the model card say; round 6's,
    round 9's and those of rounds 10 to 13 after them."""
    import lzma
    first = {json.loads(line)["index"] for line in lzma.decompress(COMMITTED_DATA.read_bytes()).splitlines()}
    round5_file = COMMITTED_DATA.with_name("self_distill_round5.jsonl.xz")
    round5 = [json.loads(line)["index"] for line in lzma.decompress(round5_file.read_bytes()).splitlines()]
    assert first == set(range(1488))
    assert len(round5) == len(set(round5)) == 2320
    assert (min(round5), max(round5)) == (1488, 3907)
    # Round 6's conversations, which round 7 (the shipped heads, MODEL_CARD.md) added:
    # indexes from 3,908 on, none of the earlier ones again.
    round6 = [json.loads(line)["index"] for line in
              lzma.decompress(COMMITTED_DATA.with_name("self_distill_round6.jsonl.xz").read_bytes()).splitlines()]
    assert len(round6) == len(set(round6)) == 2027
    assert (min(round6), max(round6)) == (3908, 6043)
    # Round 9's steered conversations (the shipped EAGLE heads): indexes from 6,044 on, each one
    # once (the writing was stopped with 32 in flight), steered or code requests.
    round9 = [json.loads(line) for line in
              lzma.decompress(COMMITTED_DATA.with_name("self_distill_round9.jsonl.xz").read_bytes()).splitlines()]
    indexes = [r["index"] for r in round9]
    assert len(indexes) == len(set(indexes)) == 1968
    assert (min(indexes), max(indexes)) == (6044, 8043)
    assert {r["kind"] for r in round9} == {"steered", "code"}
    # Rounds 10 to 13 (the shipped EAGLE-1/2 head is 12's, the EAGLE-3 head 13's): 1,600 more
    # steered or code requests each, indexes 8,044-9,643, 9,644-11,243, 11,244-12,843 and
    # 12,844-14,443, none missing.
    for name, first_index in (("self_distill_round10.jsonl.xz", 8044), ("self_distill_round11.jsonl.xz", 9644),
                              ("self_distill_round12.jsonl.xz", 11244), ("self_distill_round13.jsonl.xz", 12844)):
        later = [json.loads(line) for line in lzma.decompress(COMMITTED_DATA.with_name(name).read_bytes()).splitlines()]
        assert sorted(r["index"] for r in later) == list(range(first_index, first_index + 1600))
        assert {r["kind"] for r in later} == {"steered", "code"}


@pytest.mark.skipif(not (setup_model.FAMILY_DIR / "base" / "tokenizer.json").is_file(),
                    reason="no SmolLM2 tokenizer (run bash tools/setup_env.sh)")
def test_a_later_rounds_conversations_start_at_first(tmp_path, capsys, monkeypatch):
    """A later round writes conversations --first .. --conversations - 1 to a file of its
    own (the earlier round's file stays what its heads saw): none of the earlier indexes
    are written again."""
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import self_distill

    class NoEngine(Exception):
        pass

    def no_engine(*args, **kwargs):
        raise NoEngine

    monkeypatch.setattr(self_distill, "Engine", no_engine)
    out = tmp_path / "round5.jsonl"
    out.write_text(json.dumps({"index": 1489, "kind": "magpie", "skipped": "user turn length"}) + "\n")
    with pytest.raises(NoEngine):
        self_distill.main(["--model", str(setup_model.FAMILY_DIR / "base"), "--out", str(out),
                           "--first", "1488", "--conversations", "1492"])
    assert f"1 conversations already in {out}; 3 to write" in capsys.readouterr().out


@pytest.mark.skipif(not (setup_model.FAMILY_DIR / "base" / "tokenizer.json").is_file(),
                    reason="no SmolLM2 tokenizer (run bash tools/setup_env.sh)")
def test_a_steered_user_turn_goes_on_from_its_opener(tmp_path, monkeypatch):
    """--steered: the model writes each chat request from an opener of OPENERS appended to
    the Magpie prompt, and the recorded user turn is the opener and what the model wrote
    after it; the answer's prompt is that whole request in the chat template. Code
    requests stay as they were."""
    from transformers import AutoTokenizer
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import self_distill
    from specdec.request import StepOutput
    tokenizer = AutoTokenizer.from_pretrained(setup_model.FAMILY_DIR / "base")
    written = tokenizer.encode(" the tides, in three lines.", add_special_tokens=False)
    answer = tokenizer.encode("Sure.", add_special_tokens=False)
    submitted = []

    class ScriptedEngine:
        """Ends every request at once: a user turn with `written`, an answer with `answer`."""
        def __init__(self, config):
            self.waiting = []

        def submit(self, req, emit):
            submitted.append(req)
            self.waiting.append((req, emit))

        def step(self):
            waiting, self.waiting = self.waiting, []
            for req, emit in waiting:
                ids = written if req.request_id.endswith("/user") else answer
                emit(StepOutput(req.request_id, list(ids), [], True, "end_id"))

    monkeypatch.setattr(self_distill, "Engine", ScriptedEngine)
    out = tmp_path / "steered.jsonl"
    assert self_distill.main(["--model", str(setup_model.FAMILY_DIR / "base"), "--out", str(out),
                              "--first", "100", "--conversations", "108", "--steered", "--batch-size", "4"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    magpie_prompt, answer_prompt = self_distill.template_parts(tokenizer)
    openers = set()
    for r in records:
        assert r["index"] in range(100, 108)
        if r["index"] % 4 == 3:
            assert r["kind"] == "code" and not r["user"].endswith("three lines.")
            continue
        assert r["kind"] == "steered"
        opener = r["user"][: -len(" the tides, in three lines.")]
        assert opener in self_distill.OPENERS and r["user"] == opener + " the tides, in three lines."
        asked = next(q for q in submitted if q.request_id == f"{r['index']}/user")
        assert asked.input_ids == magpie_prompt + tokenizer.encode(opener, add_special_tokens=False)
        assert r["input_ids"] == answer_prompt(r["user"]) + answer and r["prompt_len"] == len(answer_prompt(r["user"]))
        openers.add(opener)
    assert len(records) == 8 and len(openers) > 1  # seeded per conversation, not one opener for all


def test_the_feature_cache_reuses_rows_by_content_wherever_the_conversations_moved(tmp_path, capsys):
    """New conversations sorted in between the cached ones, and some cached ones dropped:
    the rows of every conversation still present are copied from the cache (found by
    content, not position) and only the new ones are computed; each conversation's rows
    then match a cache computed from nothing. A cache without digests computes all."""
    import numpy as np
    import features
    rng = random.Random(5)
    convs = [[1] + [rng.randrange(300, 2000) for _ in range(rng.randrange(8, 40))] for _ in range(25)]
    old, new = convs[:20], convs[20:]
    base = model_family() / "base"
    cache, fresh = tmp_path / "cache", tmp_path / "fresh"
    first = features.build_features(old, [3] * len(old), base, cache)
    first_rows = {tuple(c): np.array(first.hidden[first.conversation(i)]) for i, c in enumerate(old)}
    moved = new[:2] + old[5:] + new[2:]  # old[:5] dropped, two new ones first
    capsys.readouterr()
    second = features.build_features(moved, [3] * len(moved), base, cache)
    out = capsys.readouterr().out
    assert "reusing the rows of 15 of 20 conversations from the cache of 20" in out
    assert "features: 20/20 conversations" in out and "features: 15/20" not in out  # the 5 new ones only
    reference = features.build_features(moved, [3] * len(moved), base, fresh)
    for i, c in enumerate(moved):
        rows = np.asarray(second.hidden[second.conversation(i)], dtype=np.float32)
        if tuple(c) in first_rows:
            assert np.array_equal(rows, first_rows[tuple(c)])  # copied, not computed
        expected = np.asarray(reference.hidden[reference.conversation(i)], dtype=np.float32)
        assert np.allclose(rows, expected, atol=0.05, rtol=0.02), i  # the same conversation's features
        assert np.allclose(second.aux[second.conversation(i)].astype(np.float32),
                           reference.aux[reference.conversation(i)].astype(np.float32), atol=0.05, rtol=0.02)
    (cache / "digests.npy").unlink()  # as a cache written before digests were kept
    capsys.readouterr()
    features.build_features(old, [3] * len(old), base, cache)
    out = capsys.readouterr().out
    assert "reusing" not in out and "features: 20/20 conversations" in out


def test_a_later_round_extends_the_feature_cache_and_goes_on_from_the_earlier_heads(run, capsys):
    """Round n + 1 appends conversations after round n's: the cached features of the old
    ones are kept (not recomputed), training starts from round n's heads (their holdout
    score is the new run's starting score) and counts answer tokens on from theirs."""
    tmp, family, heads, _ = run
    first = tmp / "round1"
    features = tmp / "shared_features"
    common = ["--base", str(family / "base"), "--seed", "0", "--epochs", "1", "--batch-tokens", "256",
              "--features", str(features)]
    data = _conversations(tmp / "round1.jsonl", 60, seed=2)  # 60: one is held out
    train_heads.main(common + ["--data", str(data), "--out", str(first), "--work", str(tmp / "w1")])
    saved = json.loads((first / "eagle" / "training.json").read_text())
    more = tmp / "appended.jsonl"
    with more.open("w") as f:  # indexes after the first round's, so its conversations come first
        for line in _conversations(tmp / "fresh.jsonl", 12, seed=3).read_text().splitlines():
            record = json.loads(line)
            f.write(json.dumps({**record, "index": 1000 + record["index"]}) + "\n")
    cached = features / "hidden.npy"
    import numpy as np
    old_rows = np.load(cached, mmap_mode="r").copy()
    capsys.readouterr()
    second = tmp / "round2"
    train_heads.main(common + ["--data", str(data), str(more), "--out", str(second), "--work", str(tmp / "w2"),
                               "--init", str(first), "--snapshots", "1"])
    out = capsys.readouterr().out
    assert "extending the cache of 60 conversations to 72" in out
    assert "features: 72/72" in out and "features: 60/72" not in out  # only the 12 new ones computed
    new_rows = np.load(cached, mmap_mode="r")
    assert np.array_equal(new_rows[: len(old_rows)], old_rows)
    meta = json.loads((second / "eagle" / "training.json").read_text())
    assert saved["holdout_top1_after"]["all"]["answer_tokens"] > 0
    assert meta["holdout_top1_before"] == saved["holdout_top1_after"]  # the same heads, scored alike
    assert meta["answer_tokens_seen"] == saved["answer_tokens_seen"] + meta["answer_tokens_this_run"]
    assert meta["answer_tokens_this_run"] > 0
    assert (tmp / "w2" / "snapshots" / str(saved["answer_tokens_seen"]) / "eagle3" / "config.json").is_file()
    # --keep-train-vocab: the first round's ranked tokens, not the (64) most frequent of this data
    vocab = lambda d: load_file(str(d / "eagle" / DRAFT_VOCAB_FILE))["token_ids"]  # noqa: E731
    train_heads.main(common + ["--data", str(data), str(more), "--out", str(tmp / "kept"), "--work", str(tmp / "w3"),
                               "--init", str(first), "--keep-train-vocab", "--train-vocab", "64", "--epochs", "0.2"])
    assert len(vocab(first)) > 64 and torch.equal(vocab(tmp / "kept"), vocab(first))
    # the first round, run again, reads its rows of the extended cache instead of recomputing them all
    capsys.readouterr()
    train_heads.main(common + ["--data", str(data), "--out", str(first), "--work", str(tmp / "w1")])
    out = capsys.readouterr().out
    assert "the first 60 conversations of a later round's cache" in out and "features: 60/60" not in out
    assert json.loads((first / "eagle" / "training.json").read_text())["holdout_top1_after"] == \
        saved["holdout_top1_after"]
    # --score-only: the saved heads' holdout scores on the second round's data, nothing trained or written
    capsys.readouterr()
    train_heads.main(common + ["--data", str(data), str(more), "--out", str(tmp / "unused"), "--work", str(tmp / "w2"),
                               "--init", str(second), "--score-only"])
    assert "holdout top-1 before training: {'all': {" in capsys.readouterr().out and not (tmp / "unused").exists()


@pytest.mark.skipif(not (setup_model.FAMILY_DIR / "base" / "tokenizer.json").is_file(),
                    reason="no SmolLM2 tokenizer (run bash tools/setup_env.sh)")
def test_standard_library_code_conversations_are_seeded_python_and_clear_of_the_question_sets(tmp_path):
    """local_code.py: the same file from the same seed; every answer is a fenced block of
    Python that parses, tokenised as the answer text plus the end of turn, after a prompt
    in the chat template; nothing shares an 8-word run with the evaluation sets."""
    import ast
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import local_code
    from overlap import filter_conversations, read_records
    from transformers import AutoTokenizer
    base = setup_model.FAMILY_DIR / "base"
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for out in outs:
        assert local_code.main(["--tokenizer", str(base), "--out", str(out), "--max-tokens", "20000"]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    records = read_records(outs[0])
    assert [r["index"] for r in records] == list(range(local_code.FIRST_INDEX, local_code.FIRST_INDEX + len(records)))
    tok = AutoTokenizer.from_pretrained(base)
    for r in records:
        assert r["kind"] == "fixed" and r["answer"].startswith("```python\n") and r["answer"].endswith("\n```")
        ast.parse(r["answer"][len("```python\n"): -len("\n```")])
        answer_ids = r["input_ids"][r["prompt_len"]:]
        assert answer_ids[-1] == tok.eos_token_id and len(answer_ids) <= 384
        assert tok.decode(answer_ids[:-1]) == r["answer"]
        assert tok.decode(r["input_ids"][: r["prompt_len"]]).endswith("<|im_start|>assistant\n")
    kept, report = filter_conversations(records)
    assert len(kept) == len(records) > 100 and report.dropped == []


def test_the_draft_models_holdout_scores_are_recorded_and_score_only_repeats_them(run):
    """Training records the draft's top-1 agreement on held-out conversations, before (the
    target's first layers) and after (as saved); --score-only reads the saved model and
    writes the same scores again."""
    tmp, family, _, draft = run
    data = _conversations(tmp / "draft_scored.jsonl", 60, seed=5)  # 60: one is held out
    out = tmp / "draft_scored"
    args = ["--base", str(family / "base"), "--data", str(data), "--work", str(tmp / "work_draft_scored"),
            "--seed", "0", "--out", str(out), "--layers", "1", "--batch-tokens", "256"]
    train_draft.main(args)
    meta = json.loads((out / "training.json").read_text())
    held_out = len(_answers(data)[HOLDOUT_EVERY - 1])
    for when in ("holdout_top1_before", "holdout_top1_after"):
        scores = meta[when]["all"]
        assert scores["answer_tokens"] == held_out  # the held-out conversation's every answer token
        assert 0 <= scores["full_vocabulary"] <= 1 and 0 <= scores["drafting_vocabulary"] <= 1
    (out / "training.json").write_text(json.dumps({"steps": meta["steps"]}))
    train_draft.main(args + ["--score-only"])
    again = json.loads((out / "training.json").read_text())
    assert again == {"steps": meta["steps"], "holdout_top1_before": meta["holdout_top1_before"],
                     "holdout_top1_after": meta["holdout_top1_after"]}


def test_the_holdout_score_of_the_target_as_its_own_draft_is_one(run):
    """The score compares argmaxes: the target drafting for itself agrees everywhere over
    the full vocabulary, and over a drafting vocabulary exactly where its argmax is in it."""
    tmp, family, _, _ = run
    ds = train_draft.load_dataset([_conversations(tmp / "self_scored.jsonl", 150, seed=6)], 1024)
    target = LlamaModel.from_pretrained(family / "base")
    V = target.shape.vocab_size
    reference = train_draft.holdout_reference(target, ds, 256)
    scores = train_draft.holdout_top1(target, reference, torch.arange(V))["all"]
    assert scores["full_vocabulary"] == scores["drafting_vocabulary"] == 1.0
    ids, answer = train_draft.conversation_batch(ds, ds.holdout)
    argmax = target.logits(train_draft.hidden_states(target, ids)[answer]).argmax(-1)
    most = int(argmax.mode().values)  # the vocabulary without the target's most frequent argmax
    scores = train_draft.holdout_top1(target, reference, torch.tensor([t for t in range(V) if t != most]))["all"]
    assert scores["full_vocabulary"] == 1.0
    assert scores["drafting_vocabulary"] == round(float((argmax != most).float().mean()), 4) < 1.0


def _answers(path: Path) -> list[list[int]]:
    """Each conversation's answer tokens, in file order."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["input_ids"][r["prompt_len"]:] for r in rows]


def test_the_heads_record_what_share_of_held_out_answers_each_vocabulary_holds(run):
    """A drafter cannot propose a token outside its vocabulary, so training records the share
    of held-out answer tokens in EAGLE-1's training vocabulary and in EAGLE-3's draft
    vocabulary: the shares recounted here from the data and the saved files."""
    tmp, family, _, _ = run
    data = _conversations(tmp / "covered.jsonl", 60, seed=7)  # 60: one is held out
    out = tmp / "covered"
    train_heads.main(["--base", str(family / "base"), "--data", str(data), "--work", str(tmp / "work_covered"),
                      "--seed", "0", "--out", str(out), "--epochs", "0.2", "--batch-tokens", "256",
                      "--medusa-heads", "0", "--draft-vocab", "64", "--train-vocab", "256"])
    meta = json.loads((out / "eagle3" / "training.json").read_text())
    held_out = _answers(data)[HOLDOUT_EVERY - 1]
    d2t = load_file(str(out / "eagle3" / "model.safetensors"))["d2t"].long()
    draft_vocab = set((d2t + torch.arange(len(d2t))).tolist())
    train_vocab = set(load_file(str(out / "eagle" / DRAFT_VOCAB_FILE))["token_ids"].tolist())
    share = lambda vocab: round(sum(t in vocab for t in held_out) / len(held_out), 4)  # noqa: E731
    covered = meta["holdout_vocabulary_coverage"]
    assert covered == {"train_vocab": share(train_vocab), "draft_vocab": share(draft_vocab),
                       "draft_vocab_self_distilled": share(draft_vocab)}
    assert 0 < covered["draft_vocab"] < covered["train_vocab"] < 1  # the smaller vocabulary holds fewer


def test_the_held_out_code_requests_are_what_the_script_writes_and_outside_training(tmp_path):
    """docs/bench/heldout_code_questions.jsonl is heldout_code.py's output (same packages
    installed), and none of its functions is one of the standard library's, every
    training source's code (`local_code.py` and `self_distill.py` read only those)."""
    sys.path.insert(0, str(ROOT / "tools" / "data"))
    import heldout_code
    import local_code
    import self_distill
    committed = ROOT / "docs" / "bench" / "heldout_code_questions.jsonl"
    out = tmp_path / "code.jsonl"
    assert heldout_code.main(["--out", str(out)]) == 0
    assert out.read_text() == committed.read_text()
    requests = [json.loads(line)["turns"][0] for line in committed.read_text().splitlines()]
    stdlib = {fn["name"] + fn["args"] for fn in self_distill.documented_functions(local_code.stdlib_sources(), 10_000)}
    asked = {turn.split("`")[1] if turn.startswith("Write") else turn.split("def ")[1].split(":\n")[0]
             for turn in requests}
    assert len(asked) == len(requests) and not asked & stdlib


def test_a_widened_eagle3_head_keeps_its_trained_rows_and_maps_the_new_ones():
    """widen_eagle3: the head's own tokens keep their LM-head rows; a new token's row is
    the least-squares map of embeddings onto the kept rows, applied to its embedding (so
    a head whose rows are a linear map of the embeddings gets exactly that map's rows);
    d2t/t2d describe the wider vocabulary, and one that lacks a head's token is refused."""
    gen = torch.Generator().manual_seed(0)
    V, H = 300, 16
    embed = torch.randn(V, H, generator=gen)
    mapping = torch.randn(H, H, generator=gen)
    own = torch.tensor(sorted(random.Random(0).sample(range(V), 40)))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[own] = True
    state = {"lm_head.weight": (embed[own] @ mapping).half(), "d2t": own - torch.arange(40), "t2d": t2d,
             "fc.weight": torch.ones(H, 3 * H).half()}
    wider = torch.tensor(sorted(set(own.tolist()) | set(random.Random(1).sample(range(V), 60))))
    out = train_heads.widen_eagle3(state, wider, embed)
    rows = out["lm_head.weight"]
    assert rows.shape == (len(wider), H) and rows.dtype == torch.float16
    assert torch.equal(out["d2t"] + torch.arange(len(wider)), wider)
    assert torch.equal(out["t2d"].nonzero().flatten(), wider)
    assert torch.equal(rows[torch.searchsorted(wider, own)], state["lm_head.weight"])  # kept as trained
    assert torch.allclose(rows.float(), embed[wider] @ mapping, atol=2e-2, rtol=1e-2)
    assert torch.equal(out["fc.weight"], state["fc.weight"])
    with pytest.raises(SystemExit, match="not a part"):
        train_heads.widen_eagle3(state, wider[wider != own[3]], embed)


def test_widen_draft_vocab_grows_the_init_heads_vocabulary_and_serves_losslessly_from_its_packed_form(run):
    """--widen-draft-vocab N: the EAGLE-3 head goes on from --init's with N draft tokens,
    --init's all among them and the rest the data's most frequent answer tokens it lacked;
    training.json records N. Packed for the commit (int8 rows) and unpacked by
    setup, the head serves, and greedy speculation with it equals plain decoding."""
    import packed_rows
    from data import load_dataset, tokens_by_frequency

    tmp, family, heads, _ = run
    data = _conversations(tmp / "widen.jsonl", 60, seed=5)
    common = ["--base", str(family / "base"), "--data", str(data), "--seed", "0", "--epochs", "1",
              "--batch-tokens", "256", "--medusa-heads", "0", "--features", str(tmp / "widen_features")]
    narrow, wide = tmp / "narrow", tmp / "wide"
    train_heads.main(common + ["--out", str(narrow), "--work", str(tmp / "wn"), "--draft-vocab", "48"])
    train_heads.main(common + ["--out", str(wide), "--work", str(tmp / "ww"), "--init", str(narrow),
                               "--widen-draft-vocab", "80"])
    before, after = train_heads.initial_draft_vocabulary(narrow), train_heads.initial_draft_vocabulary(wide)
    assert len(before) == 48 and len(after) == 80 and torch.isin(before, after).all()
    ds = load_dataset([data], 1024)
    ranked = tokens_by_frequency(ds, ds.train).tolist()
    added = [t for t in ranked if t not in set(before.tolist())][:32]
    assert sorted(set(after.tolist()) - set(before.tolist())) == sorted(added)
    assert json.loads((wide / "eagle3" / "training.json").read_text())["draft_vocab"] == 80
    assert json.loads((wide / "eagle3" / "config.json").read_text())["draft_vocab_size"] == 80
    committed, served = tmp / "committed_eagle3", tmp / "served_eagle3"
    packed_rows.pack(wide / "eagle3", committed)
    served.mkdir()
    packed_rows.unpack(committed, served)
    engine = Engine(EngineConfig(base_model_dir=str(family / "base"), eagle3_dir=str(served), dtype="float64",
                                 max_seq_len=256, max_batch_size=2, adaptive_speculation=False))
    prompt = [1, 534, 292, 668, 292, 1200]
    outs = run_batch(engine, [request(prompt, 12, method=m, rid=m) for m in ("none", "eagle3")])
    assert outs["eagle3"] == outs["none"]
    assert engine.drafters["eagle3"].head.lm_head.weight.shape[0] == 80
