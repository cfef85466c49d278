"""Which tree each request gets: from the config, the request, and measured costs.

- `resolve` (at submit): the request's method and tree, from its overrides or the
  config; unknown methods, methods whose weights are not loaded and bad choices are
  the caller's error (InputError).
- `calibrate` (at load): times the target forward for 1..max tokens (the cost model
  of every later decision) and, when `eagle_total_tokens` is 0, chooses the EAGLE-2/3
  tree size by timing generation with each candidate size (EAGLE-2's
  `total_token=-1`, measured end to end with the drafter).
- `plan` (every step): adaptive speculation. The batch's speculating requests get
  their full trees, halves, quarters, or none (plain decoding), whichever maximises
  the step's expected tokens per second under the measured cost of the one verify
  forward (which grows with batch size x largest tree) plus batched drafting.
  Expected accepted tokens come from each request's running acceptance, so requests
  whose drafts stop matching, and large batches, speculate less. A request whose
  speculation is off probes it again every `PROBE_EVERY` steps. Requests that pinned
  their tree size, and configs with `adaptive_speculation: false`, are left alone.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch

from .config import EngineConfig
from .errors import validate_that
from .kv_cache import AttentionBatch
from .models.layers import causal_mask
from .request import GenerationRequest, SamplingParams, SpecParams
from .spec.base import TreeSettings
from .spec.choices import static_tree

MAX_DEPTH = 12
MAX_TOP_K = 16
MAX_TREE = 128
CALIBRATION_SIZES = (4, 8, 12, 16, 24, 32, 48, 64)
PROBE_EVERY = 8  # steps between re-tries of a request whose speculation is off
PRIOR_ACCEPT = 1.5  # accepted drafts per step assumed before a request has history
EMA = 0.3  # weight of the newest observation in the running acceptance


@dataclasses.dataclass
class AdaptiveState:
    """Per-request running statistics (kept on the RequestState)."""

    accept: float = PRIOR_ACCEPT  # EMA of accepted drafts per speculative step
    nodes: int = 0  # node budget the EMA was measured at
    off_steps: int = 0  # consecutive steps without speculation


class SpeculationPolicy:
    def __init__(self, config: EngineConfig, drafters: dict, trees: dict, medusa_heads: int):
        self.config = config
        self.trees = trees  # method -> default StaticTree (medusa, eagle)
        self.medusa_heads = medusa_heads
        self.available: set[str] = {"none"} | set(drafters)
        self.total_tokens = config.eagle_total_tokens or 16
        self.calibration: dict[int, float] = {}  # EAGLE-2/3 tree size -> seconds per token
        self.forward_cost: list[tuple[int, float]] = []  # (tokens in one forward, seconds)
        self.draft_cost: dict[str, float] = {}  # method -> seconds of drafting per request-step (measured at load)
        self.prior_accept: dict[str, float] = {}  # method -> accepted drafts per step (measured at load)
        self._recording: Optional[list[float]] = None

    # -- at submit -----------------------------------------------------------------------
    def resolve(self, req: GenerationRequest) -> TreeSettings:
        spec = req.spec
        method = spec.method or self.config.speculative_method
        validate_that(method in self.available,
                      f"speculative_method {method!r} is not available on this model "
                      f"(loaded: {', '.join(sorted(self.available))})")
        choices = None
        if method in ("eagle", "medusa"):
            if spec.choices:
                max_depth = self.medusa_heads if method == "medusa" else MAX_DEPTH
                choices = static_tree(spec.choices, top_k=MAX_TOP_K, max_depth=max_depth)
                validate_that(len(choices.parents) <= MAX_TREE,
                              f"speculative_choices has {len(choices.parents)} nodes; at most {MAX_TREE}")
            else:
                choices = self.trees[method]
        depth = spec.depth or self.config.eagle_depth
        top_k = spec.top_k or self.config.eagle_top_k
        validate_that(depth <= MAX_DEPTH, f"eagle_depth must be <= {MAX_DEPTH}, got {depth}")
        validate_that(top_k <= MAX_TOP_K, f"eagle_top_k must be <= {MAX_TOP_K}, got {top_k}")
        total = spec.total_tokens or self.total_tokens
        validate_that(total <= MAX_TREE, f"eagle_total_tokens must be <= {MAX_TREE}, got {total}")
        n_draft = spec.num_draft_tokens if spec.num_draft_tokens is not None else self.config.num_draft_tokens
        validate_that(n_draft <= MAX_DEPTH * 2, f"num_draft_tokens must be <= {MAX_DEPTH * 2}, got {n_draft}")
        # A seeded sampled request keeps one tree for its lifetime: which uniforms decide
        # which token depends on the tree, so only a fixed tree repeats its output exactly.
        # (Greedy output never depends on the tree.)
        seeded = req.sampling.seed is not None and not req.sampling.greedy
        pinned = (spec.total_tokens is not None or spec.choices is not None or spec.num_draft_tokens is not None
                  or seeded or not self.config.adaptive_speculation)
        return TreeSettings(method=method, choices=choices, depth=depth, top_k=top_k, total_tokens=total,
                            num_draft_tokens=n_draft, pinned=pinned)

    @staticmethod
    def group_key(st: TreeSettings) -> tuple:
        return (st.method, st.depth, st.top_k, id(st.choices), st.num_draft_tokens)

    # -- every step ----------------------------------------------------------------------
    @staticmethod
    def full_nodes(st: TreeSettings) -> int:
        """Nodes (root included) of the request's full tree."""
        if st.method == "none":
            return 1
        if st.method in ("eagle", "medusa"):
            return len(st.choices.parents)
        if st.method == "draft_model":
            return st.num_draft_tokens + 1
        return st.total_tokens

    def plan(self, states: list) -> list[TreeSettings]:
        """This step's settings per request (node budgets applied)."""
        budgets = [self.full_nodes(s.settings) for s in states]
        adaptive = [i for i, s in enumerate(states)
                    if s.settings.method != "none" and not s.settings.pinned and self.forward_cost]
        for i in adaptive:
            stats = self._stats(states[i])
            if stats.off_steps and stats.off_steps % PROBE_EVERY != 0:
                budgets[i] = 1  # stays off until its next probe
        # The verify forward pads every tree to the largest, so what matters is the
        # batch's tree size: try the full trees, halves, quarters and none, keep the one
        # with the most expected tokens per second.
        active = [i for i in adaptive if budgets[i] > 1]
        if active:
            full = {i: budgets[i] for i in active}
            best, best_rate = 1.0, -1.0
            for factor in (1.0, 0.5, 0.25, 0.0):
                for i in active:
                    budgets[i] = 1 if factor == 0 else max(2, int(full[i] * factor))
                rate = self._rate(states, budgets)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = factor, rate
            for i in active:
                budgets[i] = 1 if best == 0 else max(2, int(full[i] * best))
        out = []
        for s, n in zip(states, budgets):
            st = s.settings
            stats = self._stats(s)
            stats.off_steps = stats.off_steps + 1 if (n <= 1 and st.method != "none") else 0
            if n <= 1 and st.method != "none":
                out.append(dataclasses.replace(st, method="none"))
            elif n < self.full_nodes(st):
                out.append(self._shrunk(st, n))
            else:
                out.append(st)
        return out

    def _shrunk(self, st: TreeSettings, n: int) -> TreeSettings:
        if st.method == "draft_model":
            return dataclasses.replace(st, num_draft_tokens=n - 1)
        if st.method in ("eagle2", "eagle3"):
            return dataclasses.replace(st, total_tokens=n)
        return dataclasses.replace(st, budget=n)  # static trees: verified prefix of n nodes

    def _expected_accept(self, state, nodes: int) -> float:
        """Expected accepted drafts with a `nodes` budget, scaled from the running
        acceptance by log(nodes) (deeper levels of a tree add less and less)."""
        if nodes <= 1:
            return 0.0
        stats = self._stats(state)
        ref = stats.nodes or self.full_nodes(state.settings)
        return stats.accept * math.log2(nodes) / max(1e-9, math.log2(max(ref, 2)))

    def _rate(self, states: list, budgets: list[int]) -> float:
        tokens = sum(1 + self._expected_accept(s, n) for s, n in zip(states, budgets))
        # The verify forward pads every request's tree to the largest one.
        cost = self.forward_seconds(len(budgets) * max(budgets))
        # Drafting runs batched, one call per method: charged once per method in use.
        cost += sum(self.draft_cost.get(m, 0.0) for m in {s.settings.method for s, n in zip(states, budgets) if n > 1})
        return tokens / cost

    def _stats(self, state) -> AdaptiveState:
        if state.adaptive is None:
            state.adaptive = AdaptiveState(accept=self.prior_accept.get(state.settings.method, PRIOR_ACCEPT))
        return state.adaptive

    def observe(self, state, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        stats = self._stats(state)
        stats.accept = (1 - EMA) * stats.accept + EMA * accepted
        stats.nodes = drafted + 1

    def record_draft_time(self, method: str, seconds: float, requests: int) -> None:
        if self._recording is not None:  # only while calibrating (see _time_drafters)
            self._recording.append(seconds / max(1, requests))

    def forward_seconds(self, tokens: int) -> float:
        """Measured target forward time for `tokens` tokens in one step (interpolated)."""
        pts = self.forward_cost
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (tokens - n1) / (n1 - n0)

    # -- at load -------------------------------------------------------------------------
    def calibrate(self, engine) -> None:
        if self.config.adaptive_speculation and len(self.available) > 1:
            self._time_forwards(engine)
        self._choose_total_tokens(engine)
        if self.forward_cost:
            self._time_drafters(engine)

    def _time_drafters(self, engine) -> None:
        """Each drafter's cost per step and its acceptance, measured once at load on the
        model's own greedy continuation of a BOS: the draft cost of the cost model (kept
        fixed while serving: a step's drafting time also depends on how much the drafter
        must catch up, which says nothing about the next step) and each method's prior."""
        bos = [1]
        n = max(1, min(32, self.config.max_tokens_limit, (engine.max_context - MAX_TREE) // 2))
        seed_text = engine.generate(GenerationRequest("calibrate-text", bos, n, spec=SpecParams(method="none")))[0]
        prompt = bos + seed_text[:24]
        for method in sorted(self.available - {"none"}):
            req = GenerationRequest(f"calibrate-{method}", prompt, n, spec=SpecParams(method=method))
            self._recording = []
            _, _, last = engine.generate(req)
            times = self._recording[1:] or self._recording  # the first step also catches up the prompt
            self._recording = None
            if times:
                self.draft_cost[method] = sorted(times)[len(times) // 2]
            st = last.stats
            if st.target_forwards:
                self.prior_accept[method] = st.total_accepted_draft_tokens / st.target_forwards

    def _time_forwards(self, engine) -> None:
        """Target forward time per token count: the cost model of `plan`."""
        target, dev = engine.target, engine.device
        limit = min(engine.max_context - 1, self.config.max_batch_size * MAX_TREE // 2, 512)
        sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= limit]
        slot = torch.tensor([0], device=dev)
        with torch.inference_mode():
            for n in sizes:
                ids = torch.zeros(1, n, dtype=torch.long, device=dev)
                batch = AttentionBatch.build(slot, torch.zeros(1, dtype=torch.long, device=dev),
                                             causal_mask(1, n, dev))
                pos = torch.arange(n, device=dev)[None]
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    hidden, _ = target(ids, pos, engine.cache, batch)
                    target.logits(hidden).sum().item()  # sync: the timing must include the work
                    best = min(best, time.perf_counter() - t0)
                self.forward_cost.append((n, best))

    def _choose_total_tokens(self, engine) -> None:
        """Chooses the EAGLE-2/3 tree size by timing generation, when not configured."""
        method = self.config.speculative_method
        if self.config.eagle_total_tokens or method not in ("eagle2", "eagle3"):
            return
        prompt = [1] + list(range(3, 3 + 24))[: max(0, engine.max_context // 4 - 1)]  # any ids: the model continues them
        new_tokens = max(1, min(48, self.config.max_tokens_limit, engine.max_context - len(prompt) - MAX_TREE))
        best, best_t = self.total_tokens, float("inf")
        for size in CALIBRATION_SIZES:
            req = GenerationRequest(request_id=f"calibrate-{size}", input_ids=prompt, max_tokens=new_tokens,
                                    sampling=SamplingParams(), spec=SpecParams(method=method, total_tokens=size))
            engine.generate(req)  # warm-up
            t0 = time.perf_counter()
            tokens, _, _ = engine.generate(dataclasses.replace(req, request_id=f"calibrate-{size}-timed"))
            per_token = (time.perf_counter() - t0) / max(1, len(tokens))
            self.calibration[size] = per_token
            if per_token < best_t:
                best, best_t = size, per_token
        self.total_tokens = best


def describe(policy: SpeculationPolicy) -> Optional[str]:
    """One line for the load log: the chosen tree size and the measured costs."""
    if not policy.forward_cost and not policy.calibration:
        return None
    fwd = ", ".join(f"{n}:{t * 1e3:.1f}ms" for n, t in policy.forward_cost)
    cal = ", ".join(f"{n}:{t * 1e3:.1f}ms/tok" for n, t in policy.calibration.items())
    return f"forward cost [{fwd}]; eagle total_tokens {policy.total_tokens} [{cal}]"
