"""Sampling through the engine: lossless, reproducible, and private to each request.

The statistical test compares the distribution of the second generated token, which
speculative steps decide by rejection sampling, with its exact marginal under the
target model, sum over t1 of p(t1) p(t2 | t1), computed from the target's own
forwards. A chi-square test at a 1e-3 false-alarm rate; an implementation that
skipped renormalising the residual, or accepted drafts without testing them, shifts
this marginal far beyond what it tolerates (the op-level tests show such variants fail).
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import specdec.engine as engine_module
import specdec.sampling as sampling_module
from engine_helpers import code_prompts, make_engine, request, run_batch
from specdec.drafters.lookup import graft
from specdec.kv_cache import AttentionBatch
from specdec.models.layers import causal_mask
from specdec.sampling import (LogitsRow, SamplingTensors, _truncated as truncated, greedy_tokens, probabilities,
                              process_logits, sampling_tensors)

TEMPERATURE, TOP_P, MIN_P = 0.9, 0.95, 0.05
TRIALS = 1500
# Trees of depth 2, which decides the second token: each tree node costs a top-p sort
# of the 49152-token vocabulary, so the default trees (16 to 64 nodes) would spend
# minutes here without testing anything more about that token.
SMALL_TREES = {"eagle2": dict(depth=2, tree_top_k=3, total_tokens=6), "draft_model": dict(num_draft_tokens=2),
               "medusa": dict(choices="[[0],[1],[2],[0,0],[0,1],[1,0]]")}


@pytest.fixture(scope="module")
def engine():
    return make_engine(max_batch_size=16, max_queue_size=4096)


@pytest.fixture(scope="module")
def vocab_engine(tmp_path_factory):
    """The draft model drafting over half of the tiny family's active tokens: its
    distributions are zero outside them, so accepting needs the residual there."""
    from test_draft_vocab import drafter_dir_with, half_of_the_active_tokens

    folder = drafter_dir_with(tmp_path_factory.mktemp("vocab"), "draft", half_of_the_active_tokens())
    return make_engine(max_batch_size=16, max_queue_size=4096, draft_model_dir=str(folder))


def _next_probs(engine, ids: list[int], req) -> torch.Tensor:
    """The target's processed next-token distribution after `ids` [V] (exact, float32)."""
    T = len(ids)
    cache = engine.target.new_cache(1, T)
    batch = AttentionBatch.build(torch.tensor([0]), torch.tensor([0]), causal_mask(1, T, "cpu"))
    with torch.inference_mode():
        hidden, _ = engine.target(torch.tensor([ids]), torch.arange(T)[None], cache, batch)
        logits = engine.target.logits(hidden[:, -1:])
    row = LogitsRow(req, ids, T - len(req.input_ids))
    processed = process_logits(logits, [row], torch.zeros(1, 1, dtype=torch.long))
    return probabilities(processed, sampling_tensors([row], "cpu"))[0, 0]


@pytest.fixture
def engine_named(request):  # pytest's `request` here, not engine_helpers.request
    """The module's engine fixture of a given name, built on first use."""
    return request.getfixturevalue


@pytest.mark.parametrize("method", ["eagle2", "draft_model", "medusa", "draft_model over a drafting vocabulary",
                                    "eagle2 with prompt lookup", "eagle2 with min-p"])
def test_second_token_follows_the_target_distribution(engine_named, method, monkeypatch):
    engine = engine_named("vocab_engine" if method.endswith("vocabulary") else "engine")
    lookup = method.endswith("prompt lookup")
    # min-p instead of top-p: the target's distribution cut relative to its likeliest token
    cut = dict(min_p=MIN_P) if method.endswith("min-p") else dict(top_p=TOP_P)
    method = method.split()[0]
    prompt = code_prompts(1, max_tokens=24)[0]
    tree = dict(SMALL_TREES[method])
    grafted = []
    if lookup:
        # A prompt whose last token z came before each likely first token earlier in it
        # (... z c1 z c2 z c3 z c4 z): whichever first token c is drawn, "z c" occurred,
        # and what followed it is the branch grafted onto the tree that decides the second.
        head = prompt[:12]
        likely = _next_probs(engine, head, request(head, 3, method, temperature=TEMPERATURE, **cut))
        prompt = head + [t for c in likely.topk(4).indices.tolist() for t in (c, head[-1])]
        tree["prompt_lookup_tokens"] = 4

        def counted(draft, *args):
            out = graft(draft, *args)
            grafted.append(not torch.equal(out.tokens, draft.tokens))
            return out
        monkeypatch.setattr(engine_module, "graft", counted)
    proto = request(prompt, 3, method, temperature=TEMPERATURE, **cut)
    p1 = _next_probs(engine, prompt, proto)
    marginal = torch.zeros_like(p1, dtype=torch.float64)
    for t1 in (p1 > 1e-7).nonzero().flatten().tolist():
        marginal += p1[t1].double() * _next_probs(engine, prompt + [t1], proto).double()
    reqs = [request(prompt, 3, method, rid=f"s{i}", temperature=TEMPERATURE, seed=i, **cut, **tree)
            for i in range(TRIALS)]
    outs = run_batch(engine, reqs)
    counts = torch.bincount(torch.tensor([outs[f"s{i}"][1] for i in range(TRIALS)]), minlength=len(p1)).double()
    expected = marginal * TRIALS
    # Pool every bin expected below 5 into one, as the chi-square approximation needs.
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    stat, pvalue = chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp[keep].sum().item())
    assert pvalue > 1e-3, f"{method}: chi-square p={pvalue:.2e} (stat {stat:.1f}, {int(keep.sum())} bins)"
    assert int(big.sum()) >= 3, "the test needs a distribution with several likely tokens"
    if lookup:  # the branch was in the trees that decided the second token, not only beside them
        assert sum(grafted) >= TRIALS // 20, f"{sum(grafted)} of {len(grafted)} trees took a branch"


@pytest.mark.parametrize("method", ["none", "eagle2", "eagle3", "draft_model", "medusa"])
def test_seeded_requests_repeat_and_seeds_differ(engine, method):
    prompt = code_prompts(2, max_tokens=40)[1]
    a = engine.generate(request(prompt, 40, method, temperature=1.0, seed=7))[0]
    b = engine.generate(request(prompt, 40, method, temperature=1.0, seed=7))[0]
    c = engine.generate(request(prompt, 40, method, temperature=1.0, seed=8))[0]
    assert a == b
    assert a != c


def test_requests_do_not_share_random_state(engine):
    """A seeded request gives the same tokens alone and batched with others."""
    prompts = code_prompts(4, max_tokens=40)
    alone = engine.generate(request(prompts[0], 32, "eagle2", rid="x", temperature=1.0, seed=123))[0]
    reqs = [request(prompts[0], 32, "eagle2", rid="x", temperature=1.0, seed=123)]
    reqs += [request(p, 32, m, rid=f"o{i}", temperature=1.0, seed=i)
             for i, (p, m) in enumerate(zip(prompts[1:], ["eagle2", "draft_model", "none"]))]
    assert run_batch(engine, reqs)["x"] == alone


def nucleus_reference(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
                      ) -> torch.Tensor:
    """One row's sampling distribution [V], computed the plain way: every token ranked."""
    x = row.double() / temperature
    order = x.argsort(descending=True)[: top_k or len(x)]
    probs = torch.softmax(x[order], -1)
    keep = order[(probs.cumsum(-1) - probs < top_p) & (probs >= min_p * probs[0])]
    out = torch.zeros_like(x)
    out[keep] = torch.softmax(x[keep], -1)
    return out.float()


@pytest.mark.parametrize("seed", range(3))
def test_top_k_top_p_min_p_equal_transformers_warpers(seed):
    """Temperature, top-k, top-p and min-p equal `transformers`' warpers applied in its
    order (min-p last, as SGLang too), row by row, over a whole vocabulary."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    gen = torch.Generator().manual_seed(seed)
    V = 2000
    settings = [(0.7, 0, 1.0, 0.1), (1.0, 50, 0.9, 0.05), (1.3, 0, 0.8, 0.2), (0.5, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.01)]
    logits = torch.randn(len(settings), 1, V, generator=gen) * torch.tensor([1.0, 3.0, 0.5, 2.0, 1.5])[:, None, None]
    params = SamplingTensors(torch.tensor([t for t, _, _, _ in settings]), torch.tensor([k for _, k, _, _ in settings]),
                             torch.tensor([p for _, _, p, _ in settings]), truncate=True,
                             min_p=torch.tensor([m for _, _, _, m in settings]))
    probs = probabilities(logits, params)
    for b, (t, k, p, m) in enumerate(settings):
        warped = TemperatureLogitsWarper(t)(None, logits[b, :, :].clone())
        warpers = ([TopKLogitsWarper(k)] if k else []) + [TopPLogitsWarper(p)] + ([MinPLogitsWarper(m)] if m else [])
        for warper in warpers:
            warped = warper(None, warped)
        torch.testing.assert_close(probs[b, 0], torch.softmax(warped, -1)[0], atol=1e-6, rtol=1e-5)
        assert (probs[b, 0] > 0).sum() == torch.isfinite(warped).sum()


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_rank_only_what_they_can_keep_and_equal_ranking_everything(seed, monkeypatch):
    """On the CPU top-p and min-p rank a few candidates and rank the whole vocabulary again
    only for the rows whose kept tokens reach past them; top-k alone ranks its k. Rows
    peaked and flat (nuclei of a few tokens and of most of the vocabulary), with every mix
    of settings, in one batch: each row equals the plain computation."""
    monkeypatch.setattr(sampling_module, "TOP_P_CANDIDATES", 16)
    gen = torch.Generator().manual_seed(seed)
    B, N, V = 6, 3, 500
    sharpness = torch.tensor([8.0, 0.05, 3.0, 0.3, 1.0, 6.0])[torch.randperm(B, generator=gen)]
    logits = torch.randn(B, N, V, generator=gen) * sharpness[:, None, None]
    temperature = torch.rand(B, generator=gen) + 0.5
    settings = [(0, 0.9, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.05), (40, 0.7, 0.0), (3, 0.5, 0.0), (0, 0.99, 0.2)]
    settings = [settings[i] for i in torch.randperm(B, generator=gen).tolist()]
    rankings, in_full = [], []  # the candidates ranked per call; the rows ranked in full again
    monkeypatch.setattr(sampling_module, "_truncated", lambda scaled, cut, ranked: (
        rankings.append(ranked), ranked == V and in_full.append(scaled.shape[0]), truncated(scaled, cut, ranked))[2])
    ranked = {}
    cuts_nothing = (0, 1.0, 0.0)
    for name, rows in (("mixed", settings), ("top-k everywhere", [(k or 7, p, m) for k, p, m in settings]),
                       ("top-p alone", [(0, 0.9, 0.0)] * B), ("min-p alone", [(0, 1.0, 0.5)] * B),
                       ("one row cuts", [(0, 0.5, 0.0)] + [cuts_nothing] * (B - 1))):
        params = SamplingTensors(temperature, torch.tensor([k for k, _, _ in rows]),
                                 torch.tensor([p for _, p, _ in rows]), truncate=True,
                                 top_k_bound=max(k for k, _, _ in rows) if all(k for k, _, _ in rows) else 0,
                                 min_p=torch.tensor([m for _, _, m in rows]))
        rankings.clear()
        in_full.clear()
        probs = probabilities(logits, params)
        for b, (k, p, m) in enumerate(rows):
            for n in range(N):
                expected = nucleus_reference(logits[b, n], temperature[b].item(), k, p, m)
                torch.testing.assert_close(probs[b, n], expected, atol=1e-6, rtol=1e-5)
        ranked[name] = list(rankings)
    # the largest top-k first (more than the 16 candidates), then the flat rows again in full;
    # where every row has a top-k, only its largest; top-p or min-p alone: the candidates,
    # then in full (the flattest row keeps most of the vocabulary, at either setting)
    assert {name: r for name, r in ranked.items() if name != "one row cuts"} == {
        "mixed": [40, V], "top-k everywhere": [40], "top-p alone": [16, V], "min-p alone": [16, V]}
    # rows that cut nothing take the plain softmax, beside a row that cuts: at most its N nodes again
    assert ranked["one row cuts"][0] == 16 and sum(in_full) <= N, in_full
    # min-p alone over peaked rows: nothing kept past the candidates, nothing ranked again
    rankings.clear()
    peaked = SamplingTensors(temperature, torch.zeros(B, dtype=torch.long), torch.ones(B), truncate=True,
                             min_p=torch.full((B,), 0.1))
    probs = probabilities(torch.randn(B, N, V, generator=gen) * 8, peaked)
    assert rankings == [16] and probs.count_nonzero(-1).max() <= 16


def test_top_k_top_p_over_a_tree_equal_each_node_alone():
    """probabilities() on [B, N, V] with N > 1 (a tree's nodes): every node filtered as if alone."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    params = SamplingTensors(torch.tensor([1.0, 0.7, 1.3]), torch.tensor([0, 4, 2]), torch.tensor([0.8, 1.0, 0.5]),
                             truncate=True)
    probs = probabilities(logits, params)
    for b in range(3):
        for n in range(5):
            alone = probabilities(logits[b:b + 1, n:n + 1], params.rows(b, b + 1))
            torch.testing.assert_close(probs[b, n], alone[0, 0])


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8, "top_k": 5}, {"logit_bias": {3: 2.0}},
                                      {"bad_words": [[4]]}, {"repetition_penalty": 1.3},
                                      {"min_tokens": 2, "end_id": 1}])
def test_process_logits_copies_only_what_it_changes(settings):
    """A batch without bias, bad words, min_tokens or penalties keeps the tree's logits
    as they are (no copy of [B, N, V] per step); one with any gets a processed copy and
    the input stays untouched."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8)
    before = logits.clone()
    rows = [LogitsRow(request([5, 6], 4, rid="plain"), [5, 6], 0),
            LogitsRow(request([5, 6], 4, rid="set", **settings), [5, 6, 4], 1)]
    out = process_logits(logits, rows, torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(logits, before)
    changes = any(k in settings for k in ("logit_bias", "bad_words", "repetition_penalty", "min_tokens"))
    assert (out is logits) == (not changes)
    assert torch.equal(out[0], before[0])
    assert torch.equal(out[1], before[1]) == (not changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_tokens_are_argmax_first_maximum_on_ties(dtype):
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        rows, vocab = int(torch.randint(1, 17, (1,), generator=gen)), int(torch.randint(1, 60000, (1,), generator=gen))
        logits = torch.randint(-3, 4, (1, rows, vocab), generator=gen).to(dtype)  # values repeat: ties everywhere
        if trial % 5 == 0:
            logits[0, 0, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")  # argmax takes a NaN
        got = greedy_tokens(logits)
        assert got.shape == (1, rows) and got.dtype == torch.long
        assert torch.equal(got, logits.argmax(-1))
