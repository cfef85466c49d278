"""Which tree each request gets: from the config, the request, and measured costs.

- `resolve` (at submit): the request's method and tree, from its overrides or the
  config; unknown methods, methods whose weights are not loaded and bad choices are
  the caller's error (InputError).
- `calibrate` (at load): when `eagle_total_tokens` is 0, the EAGLE-2/3 tree size is
  chosen by timing: generate from a fixed prompt with each candidate size and keep the
  fastest (EAGLE-2's `total_token=-1`, but measured end to end with the drafter).
- `step_settings` (every step): adaptive speculation. A request whose recent
  acceptance no longer pays for its tree is shrunk to a smaller tree, and to plain
  decoding when even the smallest loses; larger batches shrink trees too, since the
  verify forward's cost grows with batch x tree tokens. `observe` feeds the acceptance
  history. Pinned per request (`SpecParams.total_tokens`) or off in the config.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from .config import EngineConfig
from .errors import ConfigError, InputError, validate_that
from .request import GenerationRequest, SamplingParams, SpecParams
from .spec.base import TreeSettings
from .spec.choices import static_tree

MAX_DEPTH = 12
MAX_TOP_K = 16
MAX_TREE = 128
CALIBRATION_SIZES = (4, 8, 12, 16, 24, 32, 48, 64)


class SpeculationPolicy:
    def __init__(self, config: EngineConfig, drafters: dict, trees: dict, medusa_heads: int):
        self.config = config
        self.trees = trees  # method -> default StaticTree (medusa, eagle)
        self.medusa_heads = medusa_heads
        self.available: set[str] = {"none"} | set(drafters)
        self.total_tokens = config.eagle_total_tokens or 16
        self.calibration: dict[int, float] = {}  # tree size -> measured seconds per token

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
        pinned = spec.total_tokens is not None or not self.config.adaptive_speculation
        return TreeSettings(method=method, choices=choices, depth=depth, top_k=top_k, total_tokens=total,
                            num_draft_tokens=n_draft, pinned=pinned)

    @staticmethod
    def group_key(st: TreeSettings) -> tuple:
        return (st.method, st.depth, st.top_k, id(st.choices), st.num_draft_tokens)

    def step_settings(self, state, batch_size: int) -> TreeSettings:
        st = state.settings
        if st.method == "none" or st.pinned or not self.config.adaptive_speculation:
            return st
        return st  # refined by the batching policy (see observe)

    def observe(self, state, drafted: int, accepted: int) -> None:
        pass

    def calibrate(self, engine) -> None:
        """Chooses the EAGLE-2/3 tree size by timing generation, when not configured."""
        method = self.config.speculative_method
        if self.config.eagle_total_tokens or method not in ("eagle2", "eagle3"):
            return
        prompt = [1] + list(range(3, 3 + 24))  # any ids; the model continues them greedily
        best, best_t = self.total_tokens, float("inf")
        for size in CALIBRATION_SIZES:
            req = GenerationRequest(request_id=f"calibrate-{size}", input_ids=prompt, max_tokens=48,
                                    sampling=SamplingParams(), spec=SpecParams(method=method, total_tokens=size))
            engine.generate(req)  # warm-up
            t0 = time.perf_counter()
            tokens, _, _ = engine.generate(dataclasses.replace(req, request_id=f"calibrate-{size}-timed"))
            per_token = (time.perf_counter() - t0) / max(1, len(tokens))
            self.calibration[size] = per_token
            if per_token < best_t:
                best, best_t = size, per_token
        self.total_tokens = best
