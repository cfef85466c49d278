"""Which tree each request gets: from the config, the request, and measured costs.

- `resolve` (at submit): the request's method and tree, from its overrides or the
  config; unknown methods, methods whose weights are not loaded and bad choices are
  the caller's error (InputError).
- `calibrate` (at load): when `eagle_total_tokens` is 0, chooses the EAGLE-2/3 tree
  size by timing generation with each candidate size, a size below DEFAULT_TREE drafted
  shallower and narrower as any such tree is (`tree_shape`; EAGLE-2's `total_token=-1`,
  measured end to end with the drafter); with adaptive speculation on, measures the
  step costs of `step_cost.StepCost` (verify forward by batch and tree size, drafting
  by method, tree size and batch) and each drafter's acceptance, with the share of it
  that each smaller tree the plan can pick keeps (on HumanEval a 2-node EAGLE-3 tree
  kept 40 % of a 16-node tree's accepted drafts, not the log scale's quarter). The
  results are saved and reused by the next load on the same setup
  (`calibration_cache.py`).
- `plan` (every step): adaptive speculation. The batch's speculating requests get
  trees of N nodes (their full trees, halves, quarters, ... down to 2, and 3 where
  verify forwards run eagerly; or none: plain decoding; a smaller EAGLE-2/3 tree is
  also drafted shallower and narrower), whichever N
  maximises the step's expected tokens per second under the measured cost of the one
  verify forward (B requests x N nodes) plus batched drafting, a tree only where it
  beats plain steps by `SPECULATE_MARGIN` (by `KEEP_MARGIN` where the batch's requests
  are drafting already); the costs follow what serving measures.
  Expected accepted tokens come from each request's recent acceptance at each tree
  size it drafted and at the smaller trees within each verified one (`AdaptiveState`;
  sizes above the last drafted one scaled by shares that served steps refit,
  tree_shares.py), starting from what served requests of its method
  accepted (`_served_estimate`: the prior measured at load, on other text, corrected
  by served steps and returning to the prior while nothing is drafted), so requests
  whose drafts stop matching, and large batches, speculate less. A request whose
  speculation is off is judged as new again after `FIRST_BACKOFF` steps, and if the
  plan still turns its tree down, probes with a 2-node tree where the model expects
  that to cost little (`PROBE_MAX_LOSS`): only a drafted tree measures the request's
  own text. It waits twice as long after each probe after which the plan still turned
  its tree down (at τ 1.25 most probes accept something, and resetting the wait after
  any acceptance kept such requests probing every few steps). Judging a due request at
  the prior instead, round 4's EAGLE-3 (2.0 accepted drafts per step at load, ~0.6 on
  MT-bench) made the plan of 4 requests an 8-node tree for all of them at every
  probe, which the CPU's verify prices at +53 %: 0.93x of plain decoding. A batch
  whose plan turned every tree down is planned again after `REPLAN_STEPS` steps, or
  as soon as it changes. A request whose tree is off but whose text has prompt
  lookup's copy on offer verifies the copy alone where that pays (`_copies_alone`).
  Requests that pinned their tree size, and configs with `adaptive_speculation:
  false`, are left alone.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Optional

import torch

from .calibration_cache import Calibration, CalibrationCache
from .calibration_prompt import chat_prompt_ids
from .config import EngineConfig
from .errors import validate_that
from .kv_cache import AttentionBatch
from .models.layers import causal_mask
from .request import GenerationRequest, SamplingParams, SpecParams
from .sampling import greedy_tokens
from .drafters.base import TreeSettings
from .drafters.choices import static_tree
from .drafters.lookup import GRAFTED_METHODS
from .step_cost import MAX_GRID_TOKENS, StepCost
from .tree_shares import ServedShares, accepted_within, depth_share, fitted_shares, share_curve

MAX_DEPTH = 12
MAX_TOP_K = 16
MAX_TREE = 128
DEFAULT_TREE = 16  # EAGLE-2/3 tree size before (or without) calibration
CALIBRATION_SIZES = (4, 8, 16, 32, 64)  # EAGLE-2/3 tree sizes timed when eagle_total_tokens is 0
WARM_UP_TOKENS = 8  # the untimed generation before each size's timed one
CALIBRATION_PREFIX = 128  # cached tokens before the tree in the verify timings
# Timed runs of each verify shape, in rounds over every shape (after one untimed run
# each): the plan's choice between 2, 3 and 4 nodes at batch 1 hinges on verify costs
# a few percent apart, and three runs of one shape in a row, on a VM whose speed
# drifts, put the 3-node forward at +8 % to +17 % of a plain one from load to load
# (docs/benchmarks.md 1.11)
TIMING_ROUNDS = 5
PRIOR_ACCEPT = 1.5  # accepted drafts per full-tree step when the method's was not measured
PRIOR_WEIGHT = 2.0  # a new request's prior acceptance counts as this many observed steps
# Each new observation keeps this much of the older ones' weight (~20-step memory). One
# step's acceptance is noisy (a 3-node EAGLE-3 tree on chat accepts 0 or 1-2 drafts); at
# 0.8 (~5 steps) a run of rejections turned a request's tree off where a fixed 3-node
# tree paid (docs/benchmarks.md 1.11: on held-out chat requests adaptive ran at 1.31x of
# plain decoding, a pinned 3-node tree at 1.41x)
DECAY = 0.95
STALE_AFTER = 32  # a request's mean at a tree size no longer counts this many observations after its last
SERVED_DECAY = 0.98  # the same for a method's acceptance over all served requests (~50 steps)
# ... whose weight also keeps this much of itself per plan made without an observation
# at its size, so that a served estimate that turned every tree down returns to the
# prior (half way after ~140 plans from the weight of one step of 4 requests): text that
# drafts well again is found by the plan, not only by 2-node probes, which 4 requests
# on the CPU cannot afford (+27 % verify). Simulated on round 4's calibration at 1-16
# requests: 0.98 re-tried trees often enough to cost 2 % where drafts accept a third of
# the prior, and without it a request's one unlucky step turned trees off for good
SERVED_FORGET = 0.995
# A tree must beat plain steps by this modelled margin: predictions are within ~10 % of
# measured steps, and the model leaves out what only speculating costs (a newcomer's
# drafter catching up on its prompt; probes after pauses). At 16 clients on the CPU
# a modelled +9 % for 2-node trees measured 0.88-0.95x of plain.
SPECULATE_MARGIN = 0.10
# ... and a batch whose adaptive requests all drafted in the last step keeps its trees
# past this smaller one: what the larger margin covers besides the model's error (a
# drafter catching up after a pause, the probes that follow one) a request that goes on
# drafting does not pay. With one margin, sampled chat requests whose acceptance
# hovered near break-even turned their trees off and waited out doubling pauses
# (docs/benchmarks.md 1.13).
KEEP_MARGIN = 0.03
PLAIN = TreeSettings(method="none")  # this step's settings of a request whose tree is off
FIRST_BACKOFF = 4  # steps a request stays off before it probes speculation again
MAX_BACKOFF = 64  # ... doubled after each probe the plan did not follow with a tree, up to this
# A probe the plan turns down at the served estimate is still made with the smallest
# tree (2 nodes) when that costs the step at most this share of its modelled rate,
# divided by the batch's requests (the probe is for one request; its cost, the padding
# of every row's verify, falls on all): the estimate comes from other requests' text
# (or, before any, from the prior measured at load), and only a drafted tree measures
# the request's own acceptance. Undivided, the 2-node probes of 16 requests cost 3-4 % of plain
# decoding's throughput on the CPU; at 0 (only where the model expects a gain) a
# single request's probes hung on noise in the modelled costs (EAGLE-3 on HumanEval
# 1.12x in one run, 1.01x in the next).
PROBE_MAX_LOSS = 0.15
# A batch whose plan turned every tree down keeps that plan this many steps, unless it
# changes (a request joins, leaves, or ends a pause): under full load, where no tree
# pays, re-planning every step was most of what adaptive speculation cost per step.
REPLAN_STEPS = 8
# Besides the halves of a full tree, the plan can pick a 3-node tree where verify
# forwards run eagerly. On a 2-core Xeon MKL's sgemm takes up to 3 rows for about a
# row's price and jumps at 4 (target forward 31 / 32 / 34 / 49 ms for 1-4 tokens,
# docs/DESIGN.md), and a 3-node EAGLE-3 tree (two drafted tokens, chained or side by
# side) accepted more than a 2-node one: τ 1.85 against 1.56 on HumanEval, 1.39x
# against 1.30x of plain decoding (docs/benchmarks.md, section 1.6). With CUDA
# graphs a 3-node verify runs padded to the 4-node graph, so 4 nodes cost no more.
ODD_TREE = 3


@dataclasses.dataclass
class AdaptiveState:
    """Per-request acceptance (kept on the RequestState): accepted drafts per step at each
    tree size it drafted, exponentially weighted; a size's mean goes stale STALE_AFTER
    observations after its last one. Sizes without a fresh mean are estimated from the
    size drafted last (`SpeculationPolicy._expected_accept`)."""

    prior: float  # the method's accepted drafts per full-tree step, measured at load
    at_size: dict = dataclasses.field(default_factory=dict)  # nodes -> [mean per step, weight, last observation's number]
    last_size: int = 0  # the tree size drafted last (0: none yet)
    observed: int = 0  # observations so far (also part of a held plan's key)
    off_steps: int = 0  # consecutive steps without speculation
    backoff: int = FIRST_BACKOFF  # off steps before the next probe
    probing: bool = False  # this step's speculation is a probe after being off
    drafted: bool = False  # the drafter ran for it once (caught up on the prompt)
    shrunk: dict = dataclasses.field(default_factory=dict)  # nodes -> the request's settings cut to them
    # Prompt lookup's copies (drafters/lookup.py) grafted onto its trees, as [taken, not]
    # token counts, each weighing DECAY of its weight per copy: their first tokens, and
    # the tokens after a taken one (a copy of text that loops goes on being right; on
    # chat a copy's first token is often right and the next ones seldom); and the length
    # of the copy on offer this step (`plan` sets it)
    copy_first: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    copy_next: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    copy_on_offer: int = 0

    @property
    def probe_due(self) -> bool:
        return self.off_steps >= self.backoff

    def fresh(self, nodes: int) -> Optional[float]:
        """The mean at `nodes` nodes, or None when never observed or stale."""
        entry = self.at_size.get(nodes)
        return entry[0] if entry is not None and self.observed - entry[2] < STALE_AFTER else None

    def observe(self, nodes: int, accepted: float, start: float) -> None:
        """One step of `nodes` nodes accepted `accepted` drafts. A size without a fresh
        mean starts over from `start` (the estimate it replaces) with PRIOR_WEIGHT.
        Older observations keep DECAY of their weight: the mean follows the last ~20
        steps, so a few bad steps among good ones do not switch speculation off, and
        drafts that stopped matching do."""
        self.observe_within(nodes, accepted, start)
        self.observed += 1
        self.at_size[nodes][2] = self.observed
        self.last_size = nodes

    def observe_within(self, nodes: int, accepted: float, start: float) -> None:
        """What the first `nodes` nodes of the tree just observed (`observe`) would have
        accepted on their own: weighs in at that size as a drafted tree of it would,
        without counting as another observation (the step was one)."""
        if self.fresh(nodes) is None:
            self.at_size[nodes] = [start, PRIOR_WEIGHT, self.observed]
        entry = self.at_size[nodes]
        _weigh_in(entry, accepted, DECAY)
        entry[2] = self.observed

    def observe_copy(self, offered: int, accepted: int) -> None:
        """A grafted copy of `offered` tokens whose first `accepted` the target took."""
        first = [1.0, 0.0] if accepted else [0.0, 1.0]
        later = [accepted - 1.0, 1.0 if accepted < offered else 0.0] if accepted else [0.0, 0.0]
        for counts, seen in ((self.copy_first, first), (self.copy_next, later)):
            counts[0] = DECAY * counts[0] + seen[0]
            counts[1] = DECAY * counts[1] + seen[1]

    @property
    def copies_taken(self) -> bool:
        return self.copy_first[0] > 0

    def copy_expected(self, offered: int) -> float:
        """Expected accepted tokens of a copy of `offered` tokens: its first taken with
        probability p, each next one after a taken one with probability q, until the
        first that is not; p and q are the taken counts over the counts, each with one
        not taken counted in advance (one lucky copy is not p = 1). 0 before any copied
        token was taken."""
        if offered <= 0 or not self.copies_taken:
            return 0.0
        p = self.copy_first[0] / (sum(self.copy_first) + 1.0)
        q = self.copy_next[0] / (sum(self.copy_next) + 1.0)
        return p * (1 - q ** offered) / (1 - q)

    def forget(self) -> None:
        """Drops the means of the steps before a pause: a probe judges the request as
        new, so its drafts weigh in against the served estimate, not against the run of
        rejections that turned its tree off (never stale while nothing is drafted)."""
        self.at_size.clear()
        self.last_size = 0


class SpeculationPolicy:
    def __init__(self, config: EngineConfig, drafters: dict, trees: dict, medusa_heads: int):
        self.config = config
        self.trees = trees  # method -> default StaticTree (medusa, eagle)
        self.medusa_heads = medusa_heads
        self.available: set[str] = {"none"} | set(drafters)
        self.total_tokens = config.eagle_total_tokens or DEFAULT_TREE
        self.calibration: dict[int, float] = {}  # EAGLE-2/3 tree size -> seconds per token
        self.cost = StepCost([1], [1])  # replaced by the measured one at load (adaptive speculation on)
        self.prior_accept: dict[str, float] = {}  # method -> accepted drafts per step (measured at load)
        # method -> {tree size: share of the full tree's accepted drafts}, measured at load
        # over the sizes the plan picks from (full tree, halves, ...); keys include the full tree
        self.accept_share: dict[str, dict[int, float]] = {}
        self.odd_tree = False  # the plan can pick ODD_TREE nodes (verify runs eagerly); set at load
        self._recording: Optional[list[tuple[int, float]]] = None  # (requests, seconds) while calibrating
        self.calibration_note: Optional[str] = None  # for the load log: measured or cached, and where
        self.calibration_prompt: Optional[list[int]] = None  # a chat request (calibration_prompt.py)
        self._calibrated_on = "nothing"  # what calibration's generations continued, for the note
        self._bos_text: Optional[list[int]] = None  # the BOS and the model's continuation of it
        self._step = 0  # plans made
        # After a plan that turned every tree down: (what it was planned from, its step, the
        # batch's states); holding the states keeps their ids, of which the key is made,
        # from passing to new requests
        self._denied: Optional[tuple[tuple, int, tuple]] = None
        self._held = False  # the last `_best_size` returned a held plan without trees
        # (method, full tree, nodes) -> [mean accepted drafts per step, weight, the plan of
        # the last observation] over every served request's steps (`_served_estimate`)
        self.served: dict[tuple[str, int, int], list[float]] = {}
        # (method, full tree) -> what served steps say of the shares of its smaller trees
        self.served_shares: dict[tuple[str, int], ServedShares] = {}
        self._calibrating = False

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
        total = spec.total_tokens or self.total_tokens
        validate_that(total <= MAX_TREE, f"eagle_total_tokens must be <= {MAX_TREE}, got {total}")
        depth, top_k = self.tree_shape(method, total)
        depth, top_k = spec.depth or depth, spec.top_k or top_k
        validate_that(depth <= MAX_DEPTH, f"eagle_depth must be <= {MAX_DEPTH}, got {depth}")
        validate_that(top_k <= MAX_TOP_K, f"eagle_top_k must be <= {MAX_TOP_K}, got {top_k}")
        n_draft = spec.num_draft_tokens if spec.num_draft_tokens is not None else self.config.num_draft_tokens
        validate_that(n_draft <= MAX_DEPTH * 2, f"num_draft_tokens must be <= {MAX_DEPTH * 2}, got {n_draft}")
        # the branch is cut to the tree's draft nodes, so any length is safe
        lookup = (spec.prompt_lookup_tokens if spec.prompt_lookup_tokens is not None
                  else self.config.prompt_lookup_tokens)
        # A seeded sampled request keeps one tree for its lifetime: which uniforms decide
        # which token depends on the tree, so only a fixed tree repeats its output exactly.
        # (Greedy output never depends on the tree.)
        seeded = req.sampling.seed is not None and not req.sampling.greedy
        pinned = (spec.total_tokens is not None or spec.choices is not None or spec.num_draft_tokens is not None
                  or seeded or not self.config.adaptive_speculation)
        return TreeSettings(method=method, choices=choices, depth=depth, top_k=top_k, total_tokens=total,
                            num_draft_tokens=n_draft, pinned=pinned,
                            lookup_tokens=lookup if method in GRAFTED_METHODS else 0)

    def tree_shape(self, method: str, total: int) -> tuple[int, int]:
        """(depth, top_k) of a request's EAGLE-2/3 tree of `total` nodes whose request
        names neither. `eagle_depth` and `eagle_top_k` shape the configured tree
        (`eagle_total_tokens`, or DEFAULT_TREE nodes where calibration chooses the size);
        a smaller tree, whether calibration chose it or the request named it, is drafted
        with `smaller_tree_shape`, as adaptive speculation drafts the trees it cuts. At
        load on the Xeon VM, the 8-node tree calibration chose drafted in 8.3 ms at the
        configured depth 5 / top-k 8, and an 8-node tree cut to depth 3 / top-k 4 in
        4.6 ms (docs/benchmarks.md 4.2 and 2.1)."""
        depth, top_k = self.config.eagle_depth, self.config.eagle_top_k
        if method in ("eagle2", "eagle3") and 2 <= total < (self.config.eagle_total_tokens or DEFAULT_TREE):
            return smaller_tree_shape(depth, top_k, total)
        return depth, top_k

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
        self._step += 1
        budgets = [self.full_nodes(s.settings) for s in states]
        adaptive = [i for i, s in enumerate(states) if s.settings.method != "none" and not s.settings.pinned
                    and self.cost.ready and self._recording is None]  # calibration times fixed trees
        for i in adaptive:
            stats = self._stats(states[i])
            if 0 < stats.off_steps < stats.backoff:
                budgets[i] = 1  # stays off until its next probe
            # the copy on offer: priced in a tree (`_planned_accept`) or alone (`_copies_alone`)
            stats.copy_on_offer = _copy_length(states[i]) if stats.copies_taken else 0
        # The verify forward pads every tree to the largest, so what matters is the
        # batch's tree size N: every adaptive request gets min(its full tree, N), for N
        # from the largest full tree halving down to 2, or no tree (N = 1); the N with
        # the most expected tokens per second under the measured costs wins.
        active = [i for i in adaptive if budgets[i] > 1]
        if active:
            full = {i: budgets[i] for i in active}
            for i in active:
                budgets[i] = 1
            best = self._best_size(states, budgets, full)
            for i in active:
                budgets[i] = min(full[i], best)
            if not self._held:
                self._probe_smallest(states, budgets, [i for i in active if budgets[i] <= 1])
        copies = self._copies_alone(states, budgets, adaptive)
        out = []
        for i, (s, n) in enumerate(zip(states, budgets)):
            st = s.settings
            stats = self._stats(s)
            if st.method != "none":
                if stats.probing:  # last step was a probe: did the plan take the tree back?
                    stats.backoff = FIRST_BACKOFF if n > 1 else min(MAX_BACKOFF, 2 * stats.backoff)
                stats.probing = n > 1 and stats.off_steps > 0
                if stats.probing:
                    stats.forget()
                stats.off_steps = stats.off_steps + 1 if n <= 1 else 0
            if n <= 1 and st.method != "none":
                out.append(copy_alone(copies[i]) if i in copies else PLAIN)
            elif n < self.full_nodes(st):
                if n not in stats.shrunk:  # one object per request and size, not one per step
                    stats.shrunk[n] = self._shrunk(st, n)
                out.append(stats.shrunk[n])
            else:
                out.append(st)
        return out

    @staticmethod
    def _estimate_key(stats: AdaptiveState) -> tuple[int, int]:
        """Changes whenever the request's estimates do: with each observation, and when a
        due probe switches them to the prior (the same estimates before any observation),
        and with the length of the copy prompt lookup has on offer."""
        return (0 if stats.probe_due else stats.observed), stats.copy_on_offer

    def _probe_smallest(self, states: list, budgets: list[int], turned_down: list[int]) -> None:
        """Requests in `turned_down` whose probe is due (their wait is over) get a 2-node
        tree when the step's modelled rate stays within PROBE_MAX_LOSS / requests of the
        plan's (where trees cost much, as under full load, it does not). Weighed when a
        plan is made, not while a plan without trees is held."""
        due = [i for i in turned_down if self._stats(states[i]).probe_due]
        if not due:
            return
        # (a probe's drafter first catches up on what the request emitted while it was off)
        rates = self._rates(states, budgets, {i: 2 for i in due}, [2], catching_up=True)  # 1: as planned; 2: with the probes
        if rates[2] >= (1 - PROBE_MAX_LOSS / len(states)) * rates[1]:
            for i in due:
                budgets[i] = 2

    def _best_size(self, states: list, budgets: list[int], full: dict[int, int]) -> int:
        """The batch's tree size N for the adaptive requests in `full` (1: no tree): the
        one with the most expected tokens per second, a tree only past the margin
        (KEEP_MARGIN where every one of them drafted last step and not as a probe, whose
        request is judged as new; else SPECULATE_MARGIN). A plan
        of N = 1 holds for REPLAN_STEPS steps while the batch, its adaptive requests and
        their estimates stay as they were (the estimates do not move while nothing is
        drafted); only the costs drift meanwhile, and slowly."""
        key = (tuple(id(s) for s in states), tuple(full.items()),
               tuple(self._estimate_key(self._stats(states[i])) for i in full))
        self._held = (self._denied is not None and self._denied[0] == key
                      and self._step - self._denied[1] < REPLAN_STEPS)
        if self._held:
            return 1
        sizes = self._ladder(max(full.values()))
        rates = self._rates(states, budgets, full, sizes)
        keeping = all(_drafting(self._stats(states[i])) for i in full)
        best, best_rate = 1, rates[1] * (1 + (KEEP_MARGIN if keeping else SPECULATE_MARGIN))
        for size in sizes:
            if rates[size] > best_rate * (1 + 1e-9):
                best, best_rate = size, rates[size]
        self._denied = (key, self._step, tuple(states)) if best == 1 else None
        return best

    def _copies_alone(self, states: list, budgets: list[int], adaptive: list[int]) -> dict[int, int]:
        """Adaptive requests whose tree is off this step (`budgets` 1) but whose text has
        prompt lookup's copy on offer, of a kind their earlier copies say the target
        takes: index -> tokens of the copy to verify alone, without drafting (the step's
        tree is the copy, a chain from the root). The verify pads every row to the
        batch's largest tree, so a copy within it costs nothing; copies of up to L tokens
        (one L for the batch, from 1 to the longest on offer) are taken for the L with the
        most expected tokens per second, and one that widens the verify only past
        SPECULATE_MARGIN of the step's rate. Where the drafter's tree does not pay, its
        drafting (EAGLE-3 on chat; any drafter under load) does not have to be paid for
        a copy."""
        offers = {i: self._stats(states[i]).copy_on_offer for i in adaptive
                  if budgets[i] <= 1 and self._stats(states[i]).copy_on_offer}
        if not offers:
            return {}
        tokens, cost = self._totals(states, budgets, {}, [])[1]
        B, N, key_len = len(states), max(budgets), max(s.cached_len for s in states)
        verify = self.cost.verify_seconds(B, N, key_len)
        plain_rate = tokens / max(cost, 1e-9)
        best, best_rate = {}, plain_rate
        for length in range(1, max(offers.values()) + 1):
            chains = {i: min(offer, length) for i, offer in offers.items()}
            width = max(N, 1 + max(chains.values()))
            gain = sum(self._stats(states[i]).copy_expected(k) for i, k in chains.items())
            rate = (tokens + gain) / max(cost - verify + self.cost.verify_seconds(B, width, key_len), 1e-9)
            needed = plain_rate * (1 + SPECULATE_MARGIN) if width > N else plain_rate
            if rate > needed and rate > best_rate * (1 + 1e-9):
                best, best_rate = chains, rate
        return best

    def _ladder(self, full: int) -> list[int]:
        return _ladder(full, self.odd_tree)

    def _shrunk(self, st: TreeSettings, n: int) -> TreeSettings:
        if st.method == "draft_model":
            return dataclasses.replace(st, num_draft_tokens=n - 1)
        if st.method in ("eagle2", "eagle3"):
            depth, top_k = smaller_tree_shape(st.depth, st.top_k, n)
            return dataclasses.replace(st, total_tokens=n, depth=depth, top_k=top_k)
        return dataclasses.replace(st, budget=n)  # static trees: verified prefix of n nodes

    def draft_nodes(self, st: TreeSettings, n: int) -> int:
        """The tree size that sets a drafting call's cost: a static tree is drafted whole
        and cut to its budget after; the others draft `n` nodes."""
        return self.full_nodes(st) if st.method in ("eagle", "medusa") else n

    def _share(self, method: str, nodes: int, full: int) -> float:
        """Share of a full tree's accepted drafts that `nodes` nodes keep: the curve that
        served steps of the method and full tree fit together with the load-time shares
        (tree_shares.py), or the load-time shares alone before any served step accepted
        a draft (`_load_share`)."""
        if nodes >= full:
            return 1.0
        served = self.served_shares.get((method, full))
        q = served.q if served else None
        return self._load_share(method, nodes, full) if q is None else share_curve(q, nodes, full)

    def _load_share(self, method: str, nodes: int, full: int) -> float:
        """`_share` as measured at load for the method's full tree (between measured
        sizes: interpolated over log2 of the size), else `depth_share`."""
        measured = self.accept_share.get(method)
        if not measured or full not in measured or nodes >= full:
            return depth_share(nodes, full)
        if nodes in measured:
            return measured[nodes]
        sizes = sorted(measured)
        below = [s for s in sizes if s < nodes]
        above = [s for s in sizes if s > nodes]
        if not below:  # smaller than any measured size: scaled from the smallest on the log scale
            return measured[sizes[0]] * depth_share(nodes, sizes[0])
        lo, hi = below[-1], above[0]
        w = (math.log2(nodes) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return measured[lo] + w * (measured[hi] - measured[lo])

    def _expected_accept(self, state, nodes: int) -> float:
        """Expected accepted drafts per step of a request with a `nodes` budget: its own
        fresh mean at that size, up to the size it drafted last (each step also updates
        the smaller sizes within its tree, `observe`); else its mean at the size it
        drafted last, scaled by the two sizes' shares of a full tree's acceptance. A
        larger size's own mean stops where the request last drafted it, and one unlucky
        run there kept a 4-request batch on 2-node trees until it went stale, where
        3-node ones paid more (tests/test_policy.py). Before it drafted, and once its
        probe is due (it is judged as new): `_served_estimate`."""
        if nodes <= 1:
            return 0.0
        stats = self._stats(state)
        method, full = state.settings.method, self.full_nodes(state.settings)
        if stats.last_size and not stats.probe_due:
            own = stats.fresh(nodes) if nodes <= stats.last_size else None
            if own is not None:
                return own
            last = stats.last_size
            return stats.at_size[last][0] * self._share(method, nodes, full) / self._share(method, last, full)
        return self._served_estimate(stats.prior, method, full, nodes)

    def _planned_accept(self, state, nodes: int) -> float:
        """What the plan expects a tree of `nodes` nodes to accept this step: the drafter's
        estimate (`_expected_accept`), or, when prompt lookup has a copy on offer and the
        request's copies have been taken, what a copy of as many tokens as the tree has
        room for is expected to accept, whichever is more. A tree's own estimate comes
        from the sizes it drafted, mostly small ones where copies are cut short: on text
        that repeats itself a 16-node tree accepted more than the plan expected
        (docs/benchmarks.md 1.11, GSM8K)."""
        drafted = self._expected_accept(state, nodes)
        stats = self._stats(state)
        if not stats.copy_on_offer:
            return drafted
        return max(drafted, stats.copy_expected(min(stats.copy_on_offer, nodes - 1)))

    def _served_estimate(self, prior: float, method: str, full: int, nodes: int) -> float:
        """Accepted drafts per step at `nodes` nodes for a new request of the method and
        full tree: the prior's guess (prior x the size's share) with PRIOR_WEIGHT,
        averaged with what served requests accepted at every size they drafted, each
        scaled to `nodes` by the two sizes' shares and weighted by its weight (so a size
        the plan never picked does not keep the prior where served text accepted a third
        of it at the others). A served weight forgets SERVED_FORGET of itself per plan
        since its last observation."""
        share = self._share(method, nodes, full)
        total, weight = PRIOR_WEIGHT * prior * share, PRIOR_WEIGHT
        for size in set(self._ladder(full)) | {nodes}:
            entry = self.served.get((method, full, size))
            if entry is not None:
                w = entry[1] * SERVED_FORGET ** (self._step - entry[2])
                total += w * entry[0] * share / self._share(method, size, full)
                weight += w
        return total / weight

    def _rate(self, states: list, budgets: list[int]) -> float:
        """Expected emitted tokens per second of a step with these node budgets: each
        request's 1 + expected accepted drafts, over the verify forward of the batch's
        largest tree plus its drafting calls (`_rates` without adaptive requests: every
        request summed one by one)."""
        return self._rates(states, budgets, {}, [])[1]

    def _rates(self, states: list, budgets: list[int], full: dict[int, int], sizes: list[int],
               catching_up: bool = False) -> dict[int, float]:
        """The `_rate` of the batch for each size of `_totals`."""
        return {size: tokens / max(cost, 1e-9)
                for size, (tokens, cost) in self._totals(states, budgets, full, sizes, catching_up).items()}

    def _totals(self, states: list, budgets: list[int], full: dict[int, int], sizes: list[int],
                catching_up: bool = False) -> dict[int, tuple[float, float]]:
        """Expected emitted tokens and seconds of the step (`_rates` are their ratios)
        when every request in `full` (index -> its full tree) gets min(full tree, size)
        nodes and the others keep `budgets`, for size 1 (no tree) and each of `sizes`.
        One pass instead of one per size: the other requests' tokens and drafting are
        summed once, and the adaptive ones are grouped by (method, full tree), whose
        drafting cost and depth share they have in common. At 32 requests a pass per size
        was most of the policy's time per step, spent even when every tree is turned
        down. `catching_up`: the drafting of the requests in `full` is priced as calls
        that catch a drafter up (probes after a pause)."""
        key_len = max(s.cached_len for s in states)
        tokens_fixed, n_fixed, drafting_fixed = 0.0, 1, collections.Counter()
        for i, (s, n) in enumerate(zip(states, budgets)):
            if i not in full:
                tokens_fixed += 1 + self._expected_accept(s, n)
                n_fixed = max(n_fixed, n)
                if n > 1:
                    drafting_fixed[(s.settings.method, self.draft_nodes(s.settings, n), False)] += 1
        groups: dict[tuple[str, int], list] = {}  # (method, full tree) -> [its requests, settings]
        for i, f in full.items():
            st = states[i].settings
            groups.setdefault((st.method, f), [[], st])[0].append(states[i])
        totals = {}
        for size in [1] + sizes:
            tokens, N, drafting = tokens_fixed + len(full), n_fixed, collections.Counter(drafting_fixed)
            for (method, f), (members, st) in groups.items():
                n = min(f, size)
                N = max(N, n)
                if n > 1:
                    tokens += sum(self._planned_accept(s, n) for s in members)
                    drafting[(method, self.draft_nodes(st, n), catching_up)] += len(members)
            cost = self.cost.verify_seconds(len(states), N, key_len)
            cost += sum(self.cost.draft_seconds(m, k, nodes, c) for (m, nodes, c), k in drafting.items())
            totals[size] = tokens, cost
        return totals

    def _stats(self, state) -> AdaptiveState:
        if state.adaptive is None:
            prior = self.prior_accept.get(state.settings.method, PRIOR_ACCEPT)
            state.adaptive = AdaptiveState(prior=prior)
        return state.adaptive

    def observe(self, state, drafted: int, accepted: int, path: Optional[list[int]] = None, copied: int = 0
                ) -> None:
        """A verified step of the request: a tree of `drafted` draft nodes accepted
        `accepted`. `path`: the accepted nodes' numbers past the root, where known;
        `copied`: how many of the tree's last nodes prompt lookup's copy may have taken.
        With the path, what each smaller size of the plan's ladder within the drafter's
        own nodes would have accepted (`tree_shares.accepted_within`) updates the
        request's means at those sizes and, for served requests, the method's shares."""
        if drafted <= 0:
            return
        stats = self._stats(state)
        nodes = drafted + 1
        stats.observe(nodes, accepted, start=self._expected_accept(state, nodes))
        method, full = state.settings.method, self.full_nodes(state.settings)
        reference = nodes - copied  # the drafter's own first nodes
        smaller = [n for n in self._ladder(full) if n < reference] if path is not None else []
        for n in smaller:
            stats.observe_within(n, accepted_within(path, n), start=self._expected_accept(state, n))
        if self._calibrating:  # calibration's text is not what is served
            return
        if smaller:
            served = self.served_shares.setdefault((method, full), ServedShares())
            served.add(smaller, reference, path)
            served.refit(lambda n: self._load_share(method, n, full), self._ladder(full), full)
        entry = self.served.get((method, full, nodes))
        if entry is None:
            entry = self.served[(method, full, nodes)] = [0.0, 0.0, self._step]
        entry[1] *= SERVED_FORGET ** (self._step - entry[2])
        entry[2] = self._step
        _weigh_in(entry, accepted, SERVED_DECAY)

    def observe_copy(self, state, offered: list[int], accepted: list[int]) -> None:
        """A step that grafted prompt lookup's copy `offered` onto the request's tree and
        accepted the drafted tokens `accepted`: how far the copy was right."""
        if not offered or state.adaptive is None:
            return
        n = 0
        while n < min(len(offered), len(accepted)) and offered[n] == accepted[n]:
            n += 1
        state.adaptive.observe_copy(len(offered), n)

    def record_draft_time(self, settings: TreeSettings, seconds: float, states: list) -> None:
        """Every drafting call's wall time, with the call's (shared) settings: the engine
        reports them all. Calls that also caught a drafter up on a prompt or on the
        tokens of steps without drafting teach what such calls cost against steady ones
        (the price of a probe, `_probe_smallest`), not the steady cost: counting them
        there would make every pause look more expensive and the policy pause more."""
        if self._recording is not None:  # calibrating: collected by _time_drafters
            self._recording.append((len(states), seconds))
            return
        catching_up = any(s.adaptive is None or s.adaptive.probing or not s.adaptive.drafted for s in states)
        for s in states:
            if s.adaptive is not None:
                s.adaptive.drafted = True
        nodes = self.draft_nodes(settings, self.full_nodes(settings))
        self.cost.observe_draft(settings.method, len(states), nodes, seconds, catching_up)

    def record_verify_time(self, batch: int, nodes: int, key_len: int, seconds: float) -> None:
        """Every verify step's wall time, from its forward to its emitted tokens."""
        self.cost.observe_verify(batch, nodes, key_len, seconds)

    # -- at load -------------------------------------------------------------------------
    def calibrate(self, engine) -> None:
        """Measures what the config leaves to measurement, or reads it from the
        calibration cache when it was measured on the same setup, and saves what it
        measured there (a cache that cannot be written only costs the next load)."""
        choose = not self.config.eagle_total_tokens and self.config.speculative_method in ("eagle2", "eagle3")
        costs = self.config.adaptive_speculation and len(self.available) > 1
        if not (choose or costs):
            return
        self.odd_tree = engine.graphs is None  # (cuda_graph_mode is in the cache's fingerprint)
        self.calibration_prompt = chat_prompt_ids(self.config.base_model_dir)
        cache = CalibrationCache.for_engine(engine, self.trees, self.calibration_prompt)
        if cache is not None:
            saved, why = cache.load()
            if saved is not None:
                self._restore(saved)
                self.calibration_note = f"calibration from the cache {cache.path}"
                return
        t0 = time.perf_counter()
        self._calibrating = True
        try:
            if choose:
                self._choose_total_tokens(engine)
            if costs:
                self._time_verify(engine)
                self.cost.learning_speed = False  # these timings define speed 1 (step_cost.py)
                self._time_drafters(engine)
        finally:
            self._calibrating = False
            self.cost.learning_speed = True
        self.calibration_note = f"calibrated in {time.perf_counter() - t0:.0f} s on {self._calibrated_on}"
        if cache is None:
            self.calibration_note += " (no calibration cache)"
            return
        failed = cache.save(Calibration(total_tokens=self.total_tokens, seconds_per_token=dict(self.calibration),
                                        prior_accept=dict(self.prior_accept),
                                        accept_share={m: dict(s) for m, s in self.accept_share.items()},
                                        cost=self.cost if self.cost.ready else None))
        self.calibration_note += (f" ({why}), saved to {cache.path}" if failed is None
                                  else f" ({why}); could not save it to {cache.path}: {failed}")

    def _restore(self, saved: Calibration) -> None:
        self.total_tokens = saved.total_tokens
        self.calibration = dict(saved.seconds_per_token)
        self.prior_accept = dict(saved.prior_accept)
        self.accept_share = {m: dict(s) for m, s in saved.accept_share.items()}
        if saved.cost is not None:
            self.cost = saved.cost

    def _largest_tree(self) -> int:
        sizes = [self.total_tokens, self.config.num_draft_tokens + 1]
        sizes += [len(tree.parents) for tree in self.trees.values() if tree is not None]
        return min(MAX_TREE, max(sizes))

    def _time_verify(self, engine) -> None:
        """The verify forward's time on the (batch, tree size) grid of the cost model, in
        the engine's batched layout: B slots over a cached prefix, one tree mask each,
        logits for every node (as `Engine._verify` computes them); then one shape over a
        4x longer prefix for the attention slope."""
        max_tree = min(self._largest_tree(), engine.max_context // 2)
        batch_sizes, tree_sizes = self.verify_grid(engine.num_slots, max_tree)
        prefix_len = min(CALIBRATION_PREFIX, engine.max_context - max_tree - 1)
        self.cost = StepCost(batch_sizes, tree_sizes, prefix_len)
        shapes = [(B, N, prefix_len) for B in batch_sizes for N in tree_sizes if B * N <= MAX_GRID_TOKENS or N == 1]
        long_prefix = min(4 * prefix_len, engine.max_context - max_tree - 1)
        B = batch_sizes[min(2, len(batch_sizes) - 1)]
        N = max(n for b, n, _ in shapes if b == B)
        if long_prefix > prefix_len:
            shapes.append((B, N, long_prefix))
        seconds = dict(zip(shapes, _time_forwards(engine, shapes)))
        for (b, n, prefix), t in seconds.items():
            if prefix == prefix_len:
                self.cost.set_verify(b, n, t)
        if long_prefix > prefix_len:
            extra = seconds[(B, N, long_prefix)] - seconds[(B, N, prefix_len)]
            self.cost.attn_slope = max(0.0, extra / (B * N * (long_prefix - prefix_len)))

    def verify_grid(self, max_batch: int, max_tree: int) -> tuple[list[int], list[int]]:
        """The (batch sizes, tree sizes) whose verify forward is timed at load: powers of
        two up to each limit and the limit, with ODD_TREE where the plan can pick it (not
        every size of `_ladder`: the halves of a 26-node static tree would add 13 and 6)."""
        return StepCost.grid(max_batch, max_tree, [ODD_TREE] if self.odd_tree else [])

    def _time_drafters(self, engine) -> None:
        """Each drafter's acceptance (the prior of a new request's running acceptance)
        and its drafting time per call, from real generations of the model's own greedy
        continuation of a BOS: one request per method and tree size the plan can pick
        (the full tree; for drafters whose cost shrinks with the tree, its halves too),
        and for the configured method also batches of 4 and 16 requests (the others
        extrapolate proportionally to the batch, a pessimistic guess that serving
        corrects)."""
        room = self._largest_tree()  # the largest tree these generations run
        n = max(1, min(32, self.config.max_tokens_limit, (engine.max_context - room) // 2))
        prompt = self._measuring_prompt(engine, n, room)
        for method in sorted(self.available - {"none"}):
            full = self.resolve(GenerationRequest("calibrate", prompt, n, spec=SpecParams(method=method)))
            batches = [1] + [b for b in (4, 16) if b <= engine.num_slots and method == self.config.speculative_method]
            sizes = [self.full_nodes(full)]
            if method in ("eagle2", "eagle3", "draft_model"):
                sizes = self._ladder(sizes[0])
            accepted: dict[int, float] = {}  # tree size -> accepted drafts per step (B = 1)
            for size in sizes:
                st = full if size == sizes[0] else self._shrunk(full, size)
                spec = SpecParams(method=method, depth=st.depth, top_k=st.top_k, total_tokens=st.total_tokens,
                                  num_draft_tokens=st.num_draft_tokens)
                points: dict[int, float] = {}
                for B in batches:
                    reqs = [GenerationRequest(f"calibrate-{method}-{size}-{B}-{j}", prompt, n, spec=spec)
                            for j in range(B)]
                    self._recording = []
                    last = _run_together(engine, reqs)
                    times = [t for b, t in self._recording[1:] if b == B]  # the first call also catches up the prompt
                    self._recording = None
                    if times:
                        points[B] = sorted(times)[len(times) // 2]
                    if B == 1 and last.stats.target_forwards:
                        accepted[size] = last.stats.total_accepted_draft_tokens / last.stats.target_forwards
                self.cost.draft[(method, self.draft_nodes(st, size))] = points
            self.cost.cap_drafts_by_larger_trees(method)
            if sizes[0] in accepted:
                self.prior_accept[method] = accepted[sizes[0]]
            shares = fitted_shares(accepted, sizes[0])
            if shares:
                self.accept_share[method] = shares

    def _measuring_prompt(self, engine, new_tokens: int, room: int) -> list[int]:
        """What calibration's generations continue: the chat request of
        `calibration_prompt.py` where the model has a chat template and the request fits
        the context with `new_tokens` more and `room` for the largest tree they run (so
        that no tree is cut short at the context's end); else the model's own greedy
        continuation of a BOS (24 tokens of it)."""
        chat = self.calibration_prompt
        if chat and len(chat) + new_tokens + room <= engine.max_context:
            self._calibrated_on = f"a chat request ({len(chat)} prompt tokens)"
            return list(chat)
        self._calibrated_on = "the model's continuation of a BOS"
        if self._bos_text is None:
            bos = [1]
            self._bos_text = bos + engine.generate(GenerationRequest("calibrate-text", bos, 24,
                                                                     spec=SpecParams(method="none")))[0]
        return list(self._bos_text)

    def _choose_total_tokens(self, engine) -> None:
        """Chooses the EAGLE-2/3 tree size (eagle_total_tokens 0) by timing one generation
        per candidate size, drafted in the shape a request of that size gets
        (`tree_shape`), each after a short warm-up generation of its own: a size's first
        steps pay first-use costs (new shapes; on a GPU, allocations and library
        heuristics) that a timing of one generation would charge to that size alone. On
        an H100, with only the first size warmed, 8-node trees timed at 2.9x the per-token
        cost of 4-node ones and 1.4x that of 64-node ones
        (docs/bench/gpu_session_tests_family_latency.log)."""
        method = self.config.speculative_method
        room = max(CALIBRATION_SIZES)
        new_tokens = max(1, min(48, self.config.max_tokens_limit, (engine.max_context - room) // 2))
        prompt = self._measuring_prompt(engine, new_tokens, room)
        best, best_t = self.total_tokens, float("inf")
        for size in CALIBRATION_SIZES:
            req = GenerationRequest(request_id=f"calibrate-{size}", input_ids=prompt, max_tokens=new_tokens,
                                    sampling=SamplingParams(), spec=SpecParams(method=method, total_tokens=size))
            engine.generate(dataclasses.replace(req, request_id=f"calibrate-warm-up-{size}",
                                                max_tokens=min(new_tokens, WARM_UP_TOKENS)))
            t0 = time.perf_counter()
            tokens, _, _ = engine.generate(req)
            per_token = (time.perf_counter() - t0) / max(1, len(tokens))
            self.calibration[size] = per_token
            if per_token < best_t:
                best, best_t = size, per_token
        self.total_tokens = best


def _time_forwards(engine, shapes: list[tuple[int, int, int]]) -> list[float]:
    """Median seconds of each verify-shaped target forward (B slots, N tree tokens each
    after `prefix_len` cached ones, logits of every node, one host sync) in `shapes`:
    one untimed run of each, then TIMING_ROUNDS rounds that time every shape once, so
    that a drift of the machine's speed falls on every shape alike. A shape that comes
    right after a larger forward (`_smaller_than`) runs once untimed before it is timed,
    as it would after steps like itself when serving: on the 2-core Xeon a one-row
    forward took 36 ms after one of 8 x 64 rows and 29 ms after another small one, and
    the load note's one-token verify had read slower than its two-token one."""
    runs = [_forward_run(engine, *shape) for shape in shapes]  # warm-up: first use of each shape
    times = [[] for _ in shapes]
    last = shapes[-1]  # what the warm-up ran last
    for _ in range(TIMING_ROUNDS):
        for i, run in enumerate(runs):
            if _smaller_than(shapes[i], last):
                run()
            times[i].append(run())
            last = shapes[i]
    return [sorted(t)[len(t) // 2] for t in times]


def _smaller_than(shape: tuple[int, int, int], other: tuple[int, int, int]) -> bool:
    """`shape` (B, N, prefix_len) has fewer rows than `other`, or a shorter prefix."""
    return shape[0] * shape[1] < other[0] * other[1] or shape[2] < other[2]


def _forward_run(engine, B: int, N: int, prefix_len: int):
    """Runs one verify-shaped forward now (untimed) and returns a function that runs it
    again and returns its seconds."""
    target, dev = engine.target, engine.device
    if engine.graphs is not None:
        N = engine.graphs.padded_width(B, N)  # served padded to the graph's width: time that
    slots = torch.arange(B, device=dev)
    prefix = torch.full((B,), prefix_len, dtype=torch.long, device=dev)
    ids = torch.zeros(B, N, dtype=torch.long, device=dev)
    pos = prefix[:, None] + torch.arange(N, device=dev)[None]

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            batch = AttentionBatch.build(slots, prefix, causal_mask(B, N, dev), host_slots=range(B),
                                         max_prefix=prefix_len)
            hidden, _ = engine.target_step(ids, pos, batch, aux=False)
            greedy_tokens(target.logits(hidden)).tolist()
            return time.perf_counter() - t0

    run()
    return run


@functools.lru_cache(maxsize=None)
def copy_alone(tokens: int) -> TreeSettings:
    """The step's settings of a request whose tree is off and that verifies prompt
    lookup's copy of up to `tokens` tokens alone (`_copies_alone`): no drafter runs."""
    return dataclasses.replace(PLAIN, lookup_tokens=tokens)


def _drafting(stats: AdaptiveState) -> bool:
    """The request drafted in the last step, and not as a probe after a pause."""
    return stats.off_steps == 0 and stats.last_size > 0 and not stats.probing


def _copy_length(state) -> int:
    """Tokens prompt lookup would copy for the request now (0: none, or lookup is off for
    it, or its drafter has not caught up yet): as many as a large tree has room for."""
    tokens, ngrams = state.settings.lookup_tokens, getattr(state, "ngrams", None)
    if not tokens or ngrams is None:
        return 0
    return len(ngrams.continuation(state.tokens, tokens))


def smaller_tree_shape(depth: int, top_k: int, nodes: int) -> tuple[int, int]:
    """(depth, top_k) of an EAGLE-2/3 tree of `nodes` nodes cut from one drafted with
    `depth` and `top_k`. A smaller tree is drafted shallower and narrower: drafting costs
    one head forward per depth over top_k nodes per request, and the n best nodes rarely
    lie deeper than ~log2(n) (rounded up: 2 for 4 nodes, 3 for 8, 4 for 16) or more than
    n / 2 to a parent (a 3-node tree picks its 2 drafts from 2 candidates a depth).
    Keeping depth 5 / top-k 8 for a 2-node tree made drafting cost as much as for 16.
    One depth more (log2(n) + 1, until engine 0e93edf) gave EAGLE-3's 4-, 8- and 16-node
    trees 1.0-3.8 % more τ on the held-out chat and code requests, -0.5 to +0.4 % on the
    steered ones (docs/bench/heldout_*), and cost a head forward a step: on the 2-core Xeon VM, paired
    in one process over 17 of those requests, the trees one depth shallower ran 2.6 %,
    4.8 % and 3.8 % faster (docs/benchmarks.md 1.33)."""
    return (min(depth, nodes - 1, math.ceil(math.log2(nodes))),
            min(top_k, max(1, (nodes + 1) // 2)))


def _ladder(full: int, odd_tree: bool = False) -> list[int]:
    """The tree sizes the plan chooses among for a full tree, largest first: full, its
    halves, ... >= 2, and with `odd_tree` also ODD_TREE nodes where the full tree is
    larger."""
    sizes = []
    while full >= 2:
        sizes.append(full)
        full //= 2
    if odd_tree and sizes and sizes[0] > ODD_TREE and ODD_TREE not in sizes:
        sizes = sorted(sizes + [ODD_TREE], reverse=True)
    return sizes


def _weigh_in(entry: list, value: float, decay: float) -> None:
    """An exponentially weighted mean, `entry` = [mean, weight, ...]: the weight behind
    the mean keeps `decay` of itself and `value` adds 1."""
    entry[1] = decay * entry[1] + 1.0
    entry[0] += (value - entry[0]) / entry[1]


def _run_together(engine, requests: list[GenerationRequest]):
    """Submits the requests at once and steps the engine until all finished (load time:
    the engine's loop is not running yet). Returns the first request's last output."""
    last: dict[str, object] = {}

    def emit_for(rid):
        def emit(out):
            if out.finished:
                last[rid] = out
        return emit

    for r in requests:
        engine.submit(r, emit_for(r.request_id))
    while len(last) < len(requests):
        engine.step()
    return last[requests[0].request_id]


def describe(policy: SpeculationPolicy) -> Optional[str]:
    """One line for the load log: the chosen tree size, the measured costs and each
    drafter's acceptance at load (with the costs, what decides whether its trees pay
    from a request's first step: on the H200 a drafter that never drafted could not be
    told apart from one whose trees were priced out, docs/benchmarks.md 3.7)."""
    parts = [policy.calibration_note] if policy.calibration_note else []
    if policy.calibration:
        cal = ", ".join(f"{n}:{t * 1e3:.1f}ms/tok" for n, t in policy.calibration.items())
        depth, top_k = policy.tree_shape(policy.config.speculative_method, policy.total_tokens)
        parts.append(f"eagle total_tokens {policy.total_tokens} (depth {depth}, top-k {top_k}) [{cal}]")
    if policy.cost.ready:
        parts.append(policy.cost.describe())
    if policy.prior_accept:
        accepted = "; ".join(f"{m}: {a:.2f}" for m, a in sorted(policy.prior_accept.items()))
        parts.append(f"accepted drafts per full-tree step at load [{accepted}]")
    return "; ".join(parts) or None
