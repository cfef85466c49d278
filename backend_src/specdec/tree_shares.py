"""How a tree's accepted drafts divide among the smaller trees within it.

Adaptive speculation (policy.py) estimates what a request's tree of n nodes would
accept from what its trees of other sizes accepted, scaled by the two sizes' shares of a
full tree's accepted drafts. The shares come from, in order of preference:
- served steps (`ServedShares`). A tree's nodes are numbered so that its first m are the
  tree a budget of m keeps (drafters/base.DraftTree), and the accepted path's node
  numbers increase, so every verified step also says what each smaller tree within it
  would have accepted of the same text: the path's nodes numbered below m
  (`accepted_within`; exact for greedy verification of static trees and chains, near for
  EAGLE-2/3, whose smaller trees are drafted narrower). Compared on the same steps, no
  choice of the plan biases the ratio;
- the load-time measurement (`fitted_shares`): one short generation per size on one chat
  prompt. On MT-bench at 4 requests, served 4-node EAGLE-2 trees accepted 1.63x what
  2-node ones did where the load-time shares said 2.47x, and the plan, scaling a 2-node
  mean up, expected 11-14 % more of 4-node steps than they gave (docs/benchmarks.md 2.1);
- the log scale (`depth_share`) where neither measured the size.
Served evidence and the load-time shares are combined in one curve
(`share_curve`, one parameter q), the load-time shares counting as SHARE_PRIOR_WEIGHT
accepted drafts of evidence.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

SHARE_DECAYS = [i / 100 for i in range(1, 100)]  # the q that the fits choose from
# The load-time shares weigh as much as this many accepted drafts at the reference sizes of
# served steps: ~10 steps of 4-node trees on chat outweigh them
SHARE_PRIOR_WEIGHT = 16.0
# Each served observation keeps this much of the older ones' weight (~500 observations):
# a drafter's shares on a server's traffic change more slowly than its acceptance
SHARE_DECAY = 0.998
REFIT_EVERY = 16  # observations between fits of q (a fit tries every q of SHARE_DECAYS)


def share_curve(q: float, nodes: int, full: int) -> float:
    """Share of a `full`-node tree's accepted drafts that its first `nodes` nodes keep
    when each further drafted node adds q times what the one before added (exactly so
    for a chain whose drafts are each accepted with probability q; about so for a tree
    grown best first): (1 - q ** (nodes - 1)) / (1 - q ** (full - 1))."""
    if nodes >= full:
        return 1.0
    return (1.0 - q ** (max(nodes, 1) - 1)) / (1.0 - q ** (full - 1))


def depth_share(nodes: int, full: int) -> float:
    """Share of a full tree's accepted drafts that an n-node tree keeps, when it was not
    measured (log scale: deeper levels of a tree add less and less)."""
    return math.log2(max(nodes, 1)) / max(1e-9, math.log2(max(full, 2)))


def fitted_shares(accepted: dict[int, float], full: int) -> dict[int, float]:
    """Each size's share of the full tree's accepted drafts per step (`accepted`: size ->
    per step at batch 1, sizes from `full` down), as one `share_curve` fitted to every
    measured size, q by least squares. Calibration's generations are short (32 tokens
    per size): taken size by size, one lucky generation (a traced load) priced a 4-node
    EAGLE-3 tree at 0.88 of a 16-node one against 0.61 for 3 nodes, and the plan drafted
    4 nodes, whose 4th row costs a verify +25 % on the 2-core CPU, where 3 accept almost
    as much. The benchmarks' trees kept 0.55-0.67 (3 nodes) and 0.85-0.89 (8 nodes) of a
    16-node tree's accepted drafts on the four question sets (docs/benchmarks.md 1.10).
    Empty when the full tree accepted nothing."""
    if accepted.get(full, 0.0) <= 0.0:
        return {}
    measured = {n: min(1.0, a / accepted[full]) for n, a in accepted.items() if 2 <= n < full}
    q = min(SHARE_DECAYS, key=lambda q: sum((share_curve(q, n, full) - m) ** 2 for n, m in measured.items()))
    return {n: share_curve(q, n, full) for n in accepted if n >= 2}


def accepted_within(path: list[int], nodes: int) -> int:
    """Accepted drafts that the tree of a step's first `nodes` nodes holds: `path` is
    the accepted path's node numbers past the root, increasing, so these are its first
    ones, and verifying only that tree would have accepted exactly them (greedy)."""
    return sum(1 for node in path if node < nodes)


class ServedShares:
    """What served steps of one method and full tree say of its shares: for each pair of
    a smaller size n within a step's reference size r (the drafted tree, or the part of
    it the drafter proposed where prompt lookup's copy took the last nodes), the decayed
    sums of accepted drafts within n and within r over the same steps."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, int], list[float]] = {}  # (n, r) -> [within n, within r, last observation]
        self.observed = 0
        self.q: Optional[float] = None  # `share_curve`'s q as last fitted (`refit`); None: no evidence yet
        self._fitted_at = -REFIT_EVERY

    def add(self, smaller: list[int], reference: int, path: list[int]) -> None:
        """One step whose tree of `reference` nodes (its first ones) accepted `path`;
        `smaller`: the sizes below it to learn about."""
        self.observed += 1
        within_reference = accepted_within(path, reference)
        for n in smaller:
            entry = self.sums.setdefault((n, reference), [0.0, 0.0, self.observed])
            keep = SHARE_DECAY ** (self.observed - entry[2])
            entry[0] = keep * entry[0] + accepted_within(path, n)
            entry[1] = keep * entry[1] + within_reference
            entry[2] = self.observed

    def refit(self, prior: Callable[[int], float], sizes: list[int], full: int) -> Optional[float]:
        """Sets and returns `q`: the q of `share_curve` that best fits the served ratios
        (each weighted by its accepted drafts within r, decayed to now) and the `prior`
        shares of `sizes` (SHARE_PRIOR_WEIGHT spread over them); None before a served
        step accepted a draft within a reference size. Fitted again only every
        REFIT_EVERY observations once it has a value (`add` then `refit` after each)."""
        if self.observed - self._fitted_at < REFIT_EVERY and self.q is not None:
            return self.q
        self._fitted_at = self.observed
        served = []  # (n, r, ratio, weight)
        for (n, r), (within_n, within_r, last) in self.sums.items():
            weight = within_r * SHARE_DECAY ** (self.observed - last)
            if weight > 0.0:
                served.append((n, r, within_n / within_r, weight))
        if not served:
            self.q = None
            return None
        prior_sizes = [n for n in sizes if 2 <= n < full]
        prior_weight = SHARE_PRIOR_WEIGHT / max(1, len(prior_sizes))
        targets = [(n, prior(n)) for n in prior_sizes]

        def loss(q: float) -> float:
            fit = sum(w * (share_curve(q, n, r) - ratio) ** 2 for n, r, ratio, w in served)
            return fit + prior_weight * sum((share_curve(q, n, full) - s) ** 2 for n, s in targets)
        self.q = min(SHARE_DECAYS, key=loss)
        return self.q
