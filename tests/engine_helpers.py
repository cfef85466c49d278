"""Shared helpers of the engine tests: the model family, prompts, engines.

The family is the tiny one `tiny_family.py` writes once per test process (SmolLM2's
tokenizer, drafters that the base accepts often but not always), unless
`SPECDEC_TEST_FAMILY` names another (base/, eagle/, eagle3/, medusa/, draft/).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

from dataset_converter import question_set_path
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.kv_cache import AttentionBatch
from specdec.models.layers import causal_mask
from specdec.request import GenerationRequest, SamplingParams, SpecParams, StepOutput
from tiny_family import tiny_family

FAMILY = Path(os.environ["SPECDEC_TEST_FAMILY"]) if os.environ.get("SPECDEC_TEST_FAMILY") else tiny_family()
HUMANEVAL = question_set_path("humaneval")  # $SPECDEC_DATA_DIR, else ../shared/data


def family_paths() -> dict:
    return dict(base_model_dir=str(FAMILY / "base"), eagle_dir=str(FAMILY / "eagle"),
                eagle3_dir=str(FAMILY / "eagle3"), medusa_dir=str(FAMILY / "medusa"),
                draft_model_dir=str(FAMILY / "draft"))


def make_engine(**overrides) -> Engine:
    # Fixed trees unless a test asks for adaptive speculation (tests/test_policy.py):
    # what a test asserts about a tree must not depend on this machine's timings.
    kw = dict(family_paths(), speculative_method="eagle2", eagle_total_tokens=16, max_seq_len=512,
              max_batch_size=4, adaptive_speculation=False)
    kw.update(overrides)
    return Engine(EngineConfig(**kw))


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(FAMILY / "base"), local_files_only=True)


def code_prompts(n: int, max_tokens: int = 160) -> list[list[int]]:
    """The first `n` HumanEval prompts (code), tokenized, cut to `max_tokens` ids."""
    out = []
    for line in HUMANEVAL.read_text().splitlines()[:n]:
        text = json.loads(line)["turns"][0]
        text = text.split("\n", 2)[-1] if text.startswith("Complete the code") else text
        out.append(tokenizer()(text).input_ids[:max_tokens])
    return out


def request(ids: list[int], max_tokens: int, method: str = "none", rid: str = "r", **kw) -> GenerationRequest:
    """`top_k` is the sampling top-k; the EAGLE-2/3 tree's top-k is `tree_top_k`."""
    spec_keys = {"choices", "depth", "tree_top_k", "total_tokens", "num_draft_tokens", "prompt_lookup_tokens"}
    spec = SpecParams(method=method, **{"top_k" if k == "tree_top_k" else k: v for k, v in kw.items() if k in spec_keys})
    sampling_keys = {f for f in SamplingParams.__dataclass_fields__}
    sampling = SamplingParams(**{k: v for k, v in kw.items() if k in sampling_keys})
    rest = {k: v for k, v in kw.items() if k not in spec_keys | sampling_keys}
    return GenerationRequest(request_id=rid, input_ids=ids, max_tokens=max_tokens, sampling=sampling,
                             spec=spec, **rest)


def run_outputs(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[StepOutput]]:
    """Submits all requests at once (in-flight batching) and steps until done: every
    output each request streamed, in order."""
    outs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    done: set[str] = set()

    def emitter(rid):
        def emit(o):
            outs[rid].append(o)
            if o.finished:
                assert o.finish_reason != "error", o.error
                done.add(rid)
        return emit

    for r in requests:
        engine.submit(r, emitter(r.request_id))
    while len(done) < len(requests):
        engine.step()
    return outs


def run_batch(engine: Engine, requests: list[GenerationRequest],
              finals: Optional[dict] = None) -> dict[str, list[int]]:
    """`run_outputs`' tokens per request; each request's last output (its stats) goes
    into `finals` when given."""
    streamed = run_outputs(engine, requests)
    if finals is not None:
        finals.update({rid: outs[-1] for rid, outs in streamed.items()})
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in streamed.items()}


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A loaded `LlamaModel`'s logits [1, T, V] of ids [1, T], run as the engine's
    prefill runs it (a cache slot, a causal mask)."""
    T = ids.shape[1]
    cache = model.new_cache(1, T)
    batch = AttentionBatch.build(torch.tensor([0]), torch.tensor([0]), causal_mask(1, T, "cpu"))
    with torch.no_grad():
        hidden, _ = model(ids, torch.arange(T)[None], cache, batch)
    return model.logits(hidden)
