"""The engine on a GPU: what the CPU tests prove, checked where the CUDA kernels run.

One batch mixes every method (trees with a prompt-lookup branch grafted on, the
default), a logit bias, log-probs with alternatives and a queue longer than the
batch. In float64 a GPU decodes exactly what the CPU decodes, and every speculative
request returns what plain decoding returns for its prompt, alternatives included.
Log-probs agree to float32's rounding only: the engine casts logits to float32 for
every dtype (`LlamaModel.logits`), and a float32 log-softmax over SmolLM2's 49152
ids is off float64's by up to ~1e-5, by another amount where the sum runs in
another order (a GPU's).
Seeded sampling repeats on the GPU. Skips without a CUDA GPU
(tools/bench/gpu_session.sh runs it on a lent one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine_helpers import code_prompts, make_engine, request, run_outputs
from specdec.engine import Engine
from specdec.request import GenerationRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

METHODS = ["eagle", "eagle2", "eagle3", "medusa", "draft_model"]
TOKENS = 40
TOP = 3  # alternatives per token
LOG_PROB_ATOL = 5e-5  # float32 log-softmax over 49152 ids, summed in any order


@dataclass
class Decoded:
    """Everything one request streamed."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def decode(engine: Engine, requests: list[GenerationRequest]) -> dict[str, Decoded]:
    """Submits every request at once and steps until all have finished."""
    return {rid: Decoded(tokens=[t for o in outs for t in o.token_ids],
                         log_probs=[lp for o in outs for lp in o.log_probs],
                         top=[alts for o in outs for alts in o.top_log_probs])
            for rid, outs in run_outputs(engine, requests).items()}


def greedy_requests(prompts: list[list[int]], bias: dict[int, float]) -> list[GenerationRequest]:
    """Per prompt `i`: plain decoding, and the method METHODS[i] with and without `bias`;
    plain decoding of prompt 0 with `bias` too. 3 prompts' worth is more than the batch."""
    extra = dict(return_log_probs=True, top_log_probs=TOP)
    reqs = [request(prompts[0], TOKENS, "none", rid="none-0-bias", logit_bias=bias, **extra)]
    for i, method in enumerate(METHODS):
        p = prompts[i % len(prompts)]
        reqs += [request(p, TOKENS, "none", rid=f"none-{i}", **extra),
                 request(p, TOKENS, method, rid=f"{method}-{i}", **extra),
                 request(p, TOKENS, method, rid=f"{method}-{i}-bias", logit_bias=bias if i == 0 else {}, **extra)]
    return reqs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return code_prompts(len(METHODS), max_tokens=96)


@pytest.fixture(scope="module")
def bias(prompts) -> dict[int, float]:
    """Forbids (nearly) the first token plain decoding gives prompt 0, favours another."""
    first = decode(make_engine(dtype="float64"), [request(prompts[0], 1, "none")])["r"].tokens[0]
    return {first: -100.0, (first + 1) % 1000: 1.5}


def test_the_gpu_decodes_what_the_cpu_decodes(prompts, bias):
    """float64 weights, so no near-tie can break differently: the same tokens, the same
    alternatives, log-probs within float32's rounding, for every method and option at once."""
    reqs = greedy_requests(prompts, bias)
    cpu = decode(make_engine(dtype="float64", max_batch_size=8), reqs)
    gpu = decode(make_engine(device="cuda", dtype="float64", max_batch_size=8), greedy_requests(prompts, bias))
    for rid, want in cpu.items():
        got = gpu[rid]
        assert got.tokens == want.tokens, rid
        assert len(want.tokens) == TOKENS and len(got.log_probs) == TOKENS and len(got.top) == TOKENS, rid
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs),
                                   rtol=0, atol=LOG_PROB_ATOL)
        assert [[t for t, _ in alts] for alts in got.top] == [[t for t, _ in alts] for alts in want.top], rid


def test_on_the_gpu_speculation_returns_plain_decoding(prompts, bias):
    """Token for token, with the same log-probs and alternatives; the bias takes effect
    (its forbidden token never comes first) and speculation keeps it."""
    out = decode(make_engine(device="cuda", dtype="float64", max_batch_size=8), greedy_requests(prompts, bias))
    for i, method in enumerate(METHODS):
        plain = out[f"none-{i}"]
        for rid in (f"{method}-{i}", f"{method}-{i}-bias"):
            want = out["none-0-bias"] if rid == "eagle-0-bias" else plain
            got = out[rid]
            assert got.tokens == want.tokens, rid
            torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs),
                                       rtol=0, atol=LOG_PROB_ATOL)
            assert [[t for t, _ in alts] for alts in got.top] == [[t for t, _ in alts] for alts in want.top], rid
    forbidden = min(bias, key=bias.get)
    assert out["none-0"].tokens[0] == forbidden and out["none-0-bias"].tokens[0] != forbidden


def test_on_the_gpu_seeded_sampling_repeats(prompts):
    """Two engines, the same seeded requests (tree and chain methods, top-p, top-k):
    the same tokens; another seed, other tokens."""
    def reqs(seed: int) -> list[GenerationRequest]:
        return [request(p, TOKENS, m, rid=m, temperature=0.9, top_p=0.95, top_k=40, seed=seed)
                for p, m in zip(prompts, METHODS)]

    first = decode(make_engine(device="cuda", dtype="float32"), reqs(7))
    again = decode(make_engine(device="cuda", dtype="float32"), reqs(7))
    other = decode(make_engine(device="cuda", dtype="float32"), reqs(8))
    assert {k: v.tokens for k, v in first.items()} == {k: v.tokens for k, v in again.items()}
    assert {k: v.tokens for k, v in first.items()} != {k: v.tokens for k, v in other.items()}


def test_on_the_gpu_tree_forwards_plan_no_cudnn_attention(prompts):
    """In bfloat16, a tree's verify forward and EAGLE's drafting depths are multi-token
    masked attentions, which torch sent to cuDNN, whose plan for each new key length
    cost ~50 ms of host time (`attention_without_per_shape_plans`): an engine on a GPU
    runs none of it."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(device="cuda", dtype="bfloat16")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(engine, [request(prompts[0], TOKENS, m, rid=m) for m in ("eagle2", "eagle3")])
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not [n for n in names if "cudnn_attention" in n], sorted(names)
    assert "without cuDNN" in engine.load_note
