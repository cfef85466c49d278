"""CUDA graphs for decode steps (`cuda_graph_mode`, graphs.py).

On CPU the graph path runs emulated: the same padded static buffers (batch, tree
width and key length rounded up to buckets, padding rows writing into spare positions)
without capture. These tests prove the padding changes nothing: outputs and every
request's KV entries equal the eager forward's. On a GPU the last test captures real
graphs and compares them with eager decoding.
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import code_prompts, make_engine, request, run_batch
from specdec.graphs import MIN_KEYS, batch_bucket, keys_bucket, width_bucket
from specdec.kv_cache import AttentionBatch
from specdec.ops.tree_mask import build_tree


def test_buckets_cover_and_are_few():
    for n in range(1, 129):
        assert n <= batch_bucket(n) and batch_bucket(n) <= max(8, n + 15)
        assert n <= width_bucket(n) < 2 * n
        for limit in (200, 4097):
            k = keys_bucket(n, limit)
            assert min(n, limit) <= k <= limit and (k == limit or k >= MIN_KEYS)
    assert len({batch_bucket(n) for n in range(1, 65)}) == 10  # 1 2 4 8 12 16 24 32 48 64
    assert all(batch_bucket(a) <= batch_bucket(b) for a in range(1, 64) for b in range(a, 65))


@pytest.fixture(scope="module")
def engines():
    return make_engine(dtype="float64"), make_engine(dtype="float64", cuda_graph_mode=True,
                                                      cuda_graph_max_batch_size=4)


def _step(engine, slots, prefix, num, parents, ids):
    tb = build_tree(parents, num, prefix)
    batch = AttentionBatch.build(slots, prefix, tb.tree_mask, host_slots=slots.tolist())
    with torch.inference_mode():
        return engine.target_step(ids, tb.positions, batch, aux=True)


def _random_tree(gen: torch.Generator, B: int, nodes: int, width: int, vocab: int):
    """B random trees, the first of `nodes` nodes, the others of 1..nodes, padded to `width`."""
    num = torch.randint(1, nodes + 1, (B,), generator=gen)
    num[0] = nodes
    parents = torch.full((B, width), -1, dtype=torch.long)
    for b in range(B):
        for i in range(1, int(num[b])):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    ids = torch.zeros(B, width, dtype=torch.long)
    ids[:, :nodes] = torch.randint(0, vocab, (B, nodes), generator=gen)
    return num, parents, ids


@pytest.mark.parametrize("B,nodes", [(1, 1), (3, 1), (2, 5), (3, 16), (1, 64), (4, 3)])
def test_graph_forward_equals_eager_and_writes_only_its_own_entries(engines, B, nodes):
    """A graphed step after a larger one in the same bucket (more rows, longer keys: the
    buffers hold its stale inputs) equals the eager forward on every real node, and
    changes no KV entry a request owns except the step's own."""
    eager, graphed = engines
    gen = torch.Generator().manual_seed(B * 100 + nodes)
    width = graphed.graphs.width(nodes)
    slots = torch.randperm(graphed.num_slots, generator=gen)[:B].sort().values
    prefix = torch.randint(0, 200, (B,), generator=gen)
    num, parents, ids = _random_tree(gen, B, nodes, width, graphed.vocab_size)
    keys = keys_bucket(int(prefix.max()) + width, graphed.cache.max_len)
    rows = min(batch_bucket(B), graphed.graphs.max_batch)
    warm = _random_tree(gen, rows, width, width, graphed.vocab_size)
    _step(graphed, torch.arange(rows), torch.full((rows,), keys - width), *warm)
    graphed.cache.kv.copy_(torch.randn(graphed.cache.kv.shape, generator=gen, dtype=torch.float64))
    eager.cache.kv.copy_(graphed.cache.kv)
    h0, a0 = _step(eager, slots, prefix, num, parents[:, :nodes], ids[:, :nodes])
    h1, a1 = _step(graphed, slots, prefix, num, parents, ids)
    assert sum(k.batch == rows and k.width == width and k.keys == keys for k in graphed.graphs.graphs) == 1
    own = torch.arange(nodes)[None] < num[:, None]  # [B, nodes] each request's real nodes
    torch.testing.assert_close(h1[:, :nodes][own], h0[own], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a1[:, :nodes][own], a0[own], rtol=1e-12, atol=1e-12)
    context = graphed.max_context + 1  # positions a request can own; past them: spare
    kv0, kv1 = eager.cache.kv, graphed.cache.kv
    for s in range(graphed.num_slots):
        mine = [b for b in range(B) if int(slots[b]) == s]
        # A step's own slot: its new entries as computed (a padded matmul may round the
        # last bit differently), nothing else before or after them but its tree's padding.
        n = int(prefix[mine[0]]) if mine else context
        assert torch.equal(kv1[:, :, s, :, :n], kv0[:, :, s, :, :n]), s
        if mine:
            new = slice(n, n + int(num[mine[0]]))
            torch.testing.assert_close(kv1[:, :, s, :, new], kv0[:, :, s, :, new], rtol=1e-12, atol=1e-12)
            after = slice(n + width, context)
            assert torch.equal(kv1[:, :, s, :, after], kv0[:, :, s, :, after]), s


def _run_with_stats(engine, requests) -> dict[str, tuple[list[int], tuple[int, int, int]]]:
    """Each request's tokens and (drafted, accepted, target forwards) at its end."""
    outs = {r.request_id: [] for r in requests}
    stats = {}

    def emitter(rid):
        def emit(o):
            outs[rid].extend(o.token_ids)
            if o.finished:
                assert o.finish_reason != "error", o.error
                stats[rid] = (o.stats.total_draft_tokens, o.stats.total_accepted_draft_tokens, o.stats.target_forwards)
        return emit

    for r in requests:
        engine.submit(r, emitter(r.request_id))
    while len(stats) < len(requests):
        engine.step()
    return {rid: (outs[rid], stats[rid]) for rid in outs}


def test_graphed_engine_generates_and_drafts_what_eager_does():
    """Greedy and seeded sampled requests of mixed methods, more than the graphs cover
    at once (batch 6 > 4 runs eagerly, smaller batches through the graphs, batch 3 with
    a padding row), give the eager engine's tokens exactly. Greedy tokens would match
    whatever the drafts were, so the drafts are checked too: every request drafts and
    accepts as many tokens as eagerly, which a wrong head or draft-model graph would
    change."""
    prompts = code_prompts(5, max_tokens=96)
    methods = ["eagle2", "none", "medusa", "eagle3", "draft_model"]

    def batch():
        reqs = [request(p, 40 - 6 * i, m, rid=f"{m}-g") for i, (p, m) in enumerate(zip(prompts, methods))]
        reqs += [request(prompts[0], 30, "eagle2", rid="sampled", temperature=0.8, top_p=0.9, seed=7)]
        return reqs

    eager = _run_with_stats(make_engine(dtype="float64", max_batch_size=6), batch())
    engine = make_engine(dtype="float64", max_batch_size=6, cuda_graph_mode=True, cuda_graph_max_batch_size=4)
    assert _run_with_stats(engine, batch()) == eager
    assert any(k.batch == 4 for k in engine.graphs.graphs), "no step padded to a bucket"
    for method in ("eagle2", "eagle3"):
        keys = engine.drafters[method].graphs.graphs
        assert any(k.width > 1 and k.features for k in keys), f"{method}: no graphed catch-up"
        assert engine.drafters[method].loop_graphs.keys, f"{method}: no graphed drafting loop"
    assert any(k.width == 1 for k in engine.drafters["draft_model"].graphs.graphs), "draft model chain not graphed"
    buckets = len(engine.graphs.graphs) + sum(len(engine.drafters[m].graphs.graphs) + len(engine.drafters[m].loop_graphs.keys)
                                              for m in ("eagle2", "eagle3")) + len(engine.drafters["draft_model"].graphs.graphs)
    assert engine.graph_captures() == (buckets, 0.0)  # every bucket once (EAGLE-1/2's shared head once)
    assert "emulated on CPU" in engine.load_note


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures real graphs)")
def test_captured_graphs_decode_like_eager_on_gpu():
    """Real captures on a GPU, for the target and every drafter: the same tokens as
    eager decoding, and every bucket is a captured graph (none failed over to eager).
    float64, as on CPU: a graph's padded shapes may pick other GEMM kernels, and in
    float32 a near-tie between two logits could then break the other way."""
    prompts = code_prompts(4, max_tokens=96)
    methods = ["eagle2", "draft_model", "eagle3", "medusa"]

    def reqs():
        return [request(p, 48, m, rid=m) for p, m in zip(prompts, methods)]

    eager = run_batch(make_engine(device="cuda", dtype="float64"), reqs())
    engine = make_engine(device="cuda", dtype="float64", cuda_graph_mode=True, cuda_graph_max_batch_size=4)
    assert engine.graphs is not None and engine.graphs.capture
    assert run_batch(engine, reqs()) == eager
    components = [engine.graphs] + [engine.drafters[m].graphs for m in ("eagle2", "eagle3", "draft_model")]
    for graphs in components:
        assert not graphs.disabled, f"{graphs.name}: a capture failed (see the warning in the log)"
        assert graphs.graphs and all(g.graph is not None for g in graphs.graphs.values()), graphs.name
    for loop in (engine.drafters[m].loop_graphs for m in ("eagle2", "eagle3")):
        assert not loop.disabled and loop.keys, f"{loop.name}: a capture failed (see the warning in the log)"
        assert all(entry.graph is not None for entry in loop.keys.values()), loop.name


def test_long_forwards_of_a_power_of_two_width_run_eagerly():
    """A prompt's catch-up of exactly 32 or 64 tokens has a graph's width, but wider than
    the drafters' spare positions (16): it runs eagerly, as every wider forward does, and
    the requests generate what an eager engine generates."""
    prompt = code_prompts(1, max_tokens=200)[0] * 2
    reqs = lambda: [request(prompt[:n], 12, m, rid=f"{m}{n}")  # noqa: E731
                    for n in (31, 32, 63, 64) for m in ("eagle2", "eagle3", "draft_model")]
    engine = make_engine(dtype="float64", max_batch_size=12, cuda_graph_mode=True, cuda_graph_max_batch_size=16)
    assert run_batch(engine, reqs()) == run_batch(make_engine(dtype="float64", max_batch_size=12), reqs())
    for graphs in (engine.drafters[m].graphs for m in ("eagle2", "eagle3", "draft_model")):
        assert graphs.graphs and max(k.width for k in graphs.graphs) <= graphs.max_width


def test_static_attention_batch_sees_what_build_sees():
    """`AttentionBatch.build_static` (a graph's fixed key length, nothing read on the
    host) gives every real row `build`'s mask and write positions, padded with hidden
    keys; a padding row (prefix at the spare positions) sees every key and writes past."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        B, T = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        offset = int(torch.randint(0, 20, (1,), generator=gen))
        W = offset + T
        prefix = torch.randint(0, 60, (B,), generator=gen)
        local = torch.rand(B, T, W, generator=gen) < 0.5
        keys = int(prefix.max()) + W + int(torch.randint(0, 30, (1,), generator=gen))
        built = AttentionBatch.build(torch.arange(B), prefix, local, write_offset=offset)
        static = AttentionBatch.build_static(torch.arange(B), prefix, local, offset, keys)
        assert static.static and static.key_len == keys and torch.equal(static.write_pos, built.write_pos)
        assert torch.equal(static.mask[..., : built.key_len], built.mask), trial
        assert not static.mask[..., built.key_len:].any(), trial
    pad = AttentionBatch.build_static(torch.zeros(1, dtype=torch.long), torch.tensor([700]), local[:1], offset, 64)
    assert pad.mask.all() and int(pad.write_pos.min()) == 700 + offset


def _fake_states(slots: list[int], head_lens: list[int]) -> list:
    from types import SimpleNamespace
    from specdec.drafters.eagle import EagleState
    return [SimpleNamespace(slot=s, draft=EagleState(head_len=h)) for s, h in zip(slots, head_lens)]


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_graphed_drafting_loop_equals_eager_and_its_padding_writes_only_spare_positions(method):
    """The EAGLE-2/3 drafting loop as `loop_graphs` runs it (rows padded to the batch
    bucket, one key length for every depth, `build_static` masks) proposes the eager
    loop's trees, requests keeping different tree sizes, and leaves the head's KV cache
    as the eager loop does everywhere but the spare positions of row 0's slot, where
    the padding rows grew their dropped trees."""
    from specdec.drafters.base import TreeSettings
    engine = make_engine(dtype="float64", max_batch_size=8, cuda_graph_mode=True, cuda_graph_max_batch_size=8)
    drafter = engine.drafters[method]
    gen = torch.Generator().manual_seed(11)
    drafter.cache.kv.copy_(torch.randn(drafter.cache.kv.shape, generator=gen, dtype=torch.float64))
    H = engine.target.shape.hidden_size
    for slots, head_lens, sizes in [([5], [40], [16]), ([1, 2, 6], [3, 120, 77], [16, 5, 9]),
                                    ([0, 3, 4, 7, 2], [260, 9, 31, 64, 128], [8, 16, 2, 16, 12])]:
        states = _fake_states(slots, head_lens)
        settings = [TreeSettings(method=method, depth=5, top_k=4, total_tokens=n) for n in sizes]
        last = torch.randn(len(slots), H, generator=gen, dtype=torch.float64)
        before = drafter.cache.kv.clone()
        with torch.inference_mode():
            graphed = drafter._dynamic(states, last, settings)
            after_graphed = drafter.cache.kv.clone()
            drafter.cache.kv.copy_(before)
            loop_graphs, drafter.loop_graphs = drafter.loop_graphs, None
            eager = drafter._dynamic(states, last, settings)
            drafter.loop_graphs = loop_graphs
        for g, e, n in zip(graphed, eager, sizes):
            assert g.num_nodes == n and torch.equal(g.tokens, e.tokens) and torch.equal(g.parents, e.parents)
        spare = drafter._spare_start
        torch.testing.assert_close(after_graphed[..., :spare, :], drafter.cache.kv[..., :spare, :],
                                   rtol=1e-12, atol=1e-12)
        changed = (after_graphed[..., spare:, :] != drafter.cache.kv[..., spare:, :]).flatten(2).any(-1)  # [L, 2, S]
        assert set(torch.nonzero(changed.any(0).any(0)).flatten().tolist()) <= {slots[0]}
        rows = max(k[0] for k in loop_graphs.keys)
        assert rows == batch_bucket(len(slots)) and (rows > len(slots)) == changed.any()


def test_steps_that_capture_a_graph_teach_the_policy_no_costs(monkeypatch):
    """A bucket's first use captures its graph in the middle of a step (tens of ms on a
    GPU, once): that step's drafting and verify times are not given to the adaptive
    policy, which would otherwise price trees by their captures. Every other step's are."""
    engine = make_engine(dtype="float32", cuda_graph_mode=True, cuda_graph_max_batch_size=4)
    recorded = []
    monkeypatch.setattr(engine.policy, "record_draft_time", lambda *a: recorded.append("draft"))
    monkeypatch.setattr(engine.policy, "record_verify_time", lambda *a: recorded.append("verify"))
    for i, p in enumerate(code_prompts(2, max_tokens=40)):
        engine.submit(request(p, 40, "eagle2", rid=str(i)), lambda out: None)
    engine.step()  # admission and prefill
    capturing, steady = 0, 0
    while engine._running:
        before, n = engine.graph_captures()[0], len(recorded)
        engine.step()
        captured = engine.graph_captures()[0] > before
        if engine._running or not captured:
            assert (recorded[n:] == []) == captured, (captured, recorded[n:])
        capturing += captured
        steady += not captured
    assert capturing >= 1 and steady >= 3, (capturing, steady)
