"""What a decode step costs, measured: the cost model of adaptive speculation.

A step is drafting (one batched call per method) plus ONE verify forward over the batch,
every request's tree padded to the largest (`B x N` tokens). Both are measured:

- at load, the verify forward is timed on a grid of batch sizes B (1, 2, 4, ...,
  max_batch_size) and tree sizes N (1, 2, 4, ..., the largest tree), over a cached prefix
  of `prefix_len` tokens, in the engine's real batched layout (B cache slots, one
  tree mask per request), plus one shape over a longer prefix: the attention slope,
  seconds per (query token x extra cached token), that moves a prediction to the
  batch's real context (the padded batch attends over its longest prefix); drafting
  is timed per method and tree size (a smaller tree drafts shallower and narrower)
  from real generations (see `policy.calibrate`);
- while serving, every step's measured verify and draft times correct the load-time
  numbers, in two layers:
  - the machine's speed (`speed`): one running ratio of measured to predicted time over
    every verify forward and every steady drafting call. A machine runs every shape
    faster or slower alike when what else it runs changes: a GPU machine calibrated
    at ~1.4x the step times it then served (docs/benchmarks.md 3.7), and a load that
    calibrates beside another model instance's does too. Each layer below learns on
    top of it, so a slower calibration moves the tree sizes the plan has not served
    lately as much as the plain steps it serves: corrected by its own class alone, a
    tree stayed priced at load time's speed while plain steps came in at serving's,
    and trees that paid were turned down for good;
  - each grid cell (and each method's batch bucket) keeps a running ratio of measured
    time to the prediction at the current speed, so the sampling and bookkeeping
    around the forward (tree verification, KV compaction, emitting) and a drafter's
    real batched cost end up in the model. A cell seen fewer than `CELL_TRUST` times
    borrows the ratio of its whole class (plain steps, tree steps, one drafter's calls
    at one tree size), which every observation updates. Calls that caught a drafter up
    (after steps without drafting) are kept apart, as their ratio to the steady
    prediction, which prices probes.
  While the policy calibrates (`learning_speed` off), observations correct the cells
  and classes only: the load-time timings define speed 1.

Between grid points costs are interpolated linearly in B and in N; past the grid the
last segment's slope is extended. All times are seconds of wall clock.
"""
from __future__ import annotations

import bisect
import math
from types import MappingProxyType
from typing import Iterable, Mapping, Optional

# Weight of one observation in a running measured/predicted ratio (~20-observation
# memory). One step's time varies by ~10 % on a shared VM; at 0.2 a cell moved with the
# last ~5 steps, enough to flip the plan between tree sizes whose rates differ by 5 %
EMA = 0.05
# Weight of one observation in the machine's speed (~5-observation memory). The speed
# scales every prediction alike, so its noise never changes which tree the plan picks;
# learning 4x faster than the cells puts ~4/5 of a change that every shape shares into
# the speed, where the shapes not served lately see it too
SPEED_EMA = 0.2
CELL_TRUST = 3  # observations before a cell's own ratio replaces its class's
RATIO_CLAMP = (0.25, 8.0)  # one odd observation (a page fault, a GC pause) moves little
MAX_GRID_TOKENS = 1024  # the verify grid stops at B x N tokens beyond this (then extrapolated)
CATCH_UP = "catch-up"  # tags the cells and classes of drafting calls that caught a drafter up


def _pow2_upto(limit: int) -> list[int]:
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return out


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, len >= 1), extended past both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional (a pessimistic guess for x > xs[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _clamped(ratio: float) -> float:
    lo, hi = RATIO_CLAMP
    return min(hi, max(lo, ratio))


def _kind(nodes: int) -> str:
    return "plain" if nodes <= 1 else "tree"


def _nearest(xs: list[int], x: float) -> int:
    """Index of the grid value (xs sorted, positive) nearest to x on a log scale; the
    lower one on a tie. Called several times a step: bisection, not a scan."""
    x = max(x, 1)
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return 0
    if i == len(xs):
        return len(xs) - 1
    return i if math.log(xs[i]) - math.log(x) < math.log(x) - math.log(xs[i - 1]) else i - 1


class StepCost:
    def __init__(self, batch_sizes: list[int], tree_sizes: list[int], prefix_len: int = 0):
        self.batch_sizes = batch_sizes  # B grid, ascending
        self.tree_sizes = tree_sizes  # N grid, ascending
        self.prefix_len = prefix_len  # cached tokens before the tree in the grid's timings
        self.attn_slope = 0.0  # seconds per (query token x cached token past prefix_len)
        self._verify: dict[tuple[int, int], float] = {}  # (B, N) -> seconds, from the load-time timings
        # B -> (N grid, seconds): `_verify` as curves, built at the first prediction after a write
        self._curves: Optional[dict[int, tuple[list[int], list[float]]]] = None
        # (method, tree nodes) -> {requests drafted: seconds per call}
        self.draft: dict[tuple[str, int], dict[int, float]] = {}
        # measured / predicted at `speed`, with the number of observations behind it, per grid
        # cell ((B, N) or ((method, nodes), B)) and per class ("plain" / "tree" / (method, nodes)).
        self._ratio: dict[object, tuple[float, int]] = {}
        self.speed = 1.0  # the machine's speed now against the load-time timings' (module doc)
        self.learning_speed = True  # off while calibrating: its timings define speed 1

    @staticmethod
    def grid(max_batch: int, max_tree: int, more_trees: Iterable[int] = ()) -> tuple[list[int], list[int]]:
        """Batch sizes and tree sizes timed at load: powers of two up to each limit (and the
        limit), the tree sizes with `more_trees` (sizes the plan can pick between them)."""
        return _pow2_upto(max_batch), sorted(set(_pow2_upto(max_tree)) | {n for n in more_trees if n <= max_tree})

    @property
    def ready(self) -> bool:
        return bool(self._verify)

    @property
    def verify(self) -> Mapping[tuple[int, int], float]:
        """(B, N) -> seconds of the load-time verify grid, read-only: write with `set_verify`."""
        return MappingProxyType(self._verify)

    def set_verify(self, batch: int, nodes: int, seconds: float) -> None:
        """One cell of the verify grid (calibration); predictions rebuild their curves."""
        self._verify[(batch, nodes)] = seconds
        self._curves = None

    # -- predictions ---------------------------------------------------------------------
    def _verify_curve(self, B: int) -> tuple[list[int], list[float]]:
        """Load-time verify seconds against N for grid batch size B, as built once after
        the grid's last write (predictions run several times a step)."""
        if self._curves is None:
            self._curves = {}
            for b in self.batch_sizes:
                ns = [n for n in self.tree_sizes if (b, n) in self._verify]
                self._curves[b] = (ns, [self._verify[(b, n)] for n in ns])
        return self._curves[B]

    def verify_seconds(self, batch: int, nodes: int, key_len: int = 0) -> float:
        """Predicted verify step for `batch` requests whose trees pad to `nodes`, over a
        longest cached prefix of `key_len` tokens (0: the grid's); never below the plain
        step of the same batch, which verifies a subset of its work. (Each is corrected
        by what serving measured, plain steps by plain steps and trees by trees: a tree
        ratio learned at 1 request, 0.87, once priced 8 requests' 2-node trees 16 %
        below their plain step, where they measured 6 % above it.)"""
        seconds = self._verify_base(batch, nodes, key_len) * self._correction(self._cell(batch, nodes), _kind(nodes))
        if nodes > 1:
            seconds = max(seconds, self.verify_seconds(batch, 1, key_len))
        return seconds

    def _verify_base(self, batch: int, nodes: int, key_len: int) -> float:
        rows = []
        for B in self.batch_sizes:
            ns, ts = self._verify_curve(B)
            if ns:
                rows.append((B, _interp(ns, ts, nodes)))
        base = _interp([b for b, _ in rows], [t for _, t in rows], batch)
        if key_len:
            base = max(0.2 * base, base + self.attn_slope * batch * nodes * (key_len - self.prefix_len))
        return base

    def draft_seconds(self, method: str, requests: int, nodes: int, catching_up: bool = False) -> float:
        """Predicted drafting call of `method` for `requests` requests whose trees have
        `nodes` nodes (0 if the method was never timed); `catching_up`: a call whose
        drafter first catches up on tokens it has not seen (a prompt; the tokens of steps
        without drafting), priced at the measured ratio of such calls to steady ones."""
        key = self._draft_key(method, nodes)
        if key is None or requests <= 0:
            return 0.0
        cell, kind = self._draft_cell(method, nodes, requests)
        seconds = self._draft_base(key, requests) * self._correction(cell, kind)
        if catching_up:
            seconds *= self._relative(cell + (CATCH_UP,), kind + (CATCH_UP,))
        return seconds

    def _draft_key(self, method: str, nodes: int) -> Optional[tuple[str, int]]:
        """The timed (method, size) that predicts `nodes`: itself, else the method's
        smallest timed size above it (a pessimistic guess), else its largest."""
        sizes = sorted(n for m, n in self.draft if m == method and self.draft[(m, n)])
        if not sizes:
            return None
        above = [n for n in sizes if n >= nodes]
        return method, (above[0] if above else sizes[-1])

    def cap_drafts_by_larger_trees(self, method: str) -> None:
        """Lowers each timed drafting call of `method` to the least time of the same number
        of requests at any larger timed tree: a smaller tree drafts a subset of a larger
        one's work (fewer depths, fewer candidates), so a timing above a larger tree's is
        noise. (Seen on a 2-core Xeon: EAGLE-3 2-node 7.4 ms against 4-node 6.7 ms at one
        load, 2.6 ms at another.) Calibration calls it once a method's sizes are timed."""
        least: dict[int, float] = {}  # requests -> least seconds over the sizes seen (largest first)
        for nodes in sorted((n for m, n in self.draft if m == method), reverse=True):
            points = self.draft[(method, nodes)]
            for requests, seconds in points.items():
                least[requests] = points[requests] = min(seconds, least.get(requests, seconds))

    def _draft_base(self, key: tuple[str, int], requests: int) -> float:
        points = self.draft[key]
        bs = sorted(points)
        return _interp(bs, [points[b] for b in bs], requests)

    # -- observations --------------------------------------------------------------------
    def observe_verify(self, batch: int, nodes: int, key_len: int, seconds: float) -> None:
        if self.ready:
            self._observe(self._cell(batch, nodes), _kind(nodes), seconds, self._verify_base(batch, nodes, key_len))

    def observe_draft(self, method: str, requests: int, nodes: int, seconds: float, catching_up: bool = False) -> None:
        """A drafting call's time; a call that caught up (`draft_seconds`) teaches only the
        ratio of such calls to the steady prediction, which it must not inflate."""
        key = self._draft_key(method, nodes)
        if key is None or requests <= 0:
            return
        cell, kind = self._draft_cell(method, nodes, requests)
        base = self._draft_base(key, requests)
        if catching_up:  # against the steady prediction, its own correction included
            if base > 0:
                steady = base * self._correction(cell, kind)
                self._learn(cell + (CATCH_UP,), kind + (CATCH_UP,), _clamped(seconds / steady))
        else:
            self._observe(cell, kind, seconds, base)

    def _relative(self, cell, kind) -> float:
        """The cell's running ratio to the prediction at the machine's speed (its class's
        until the cell has been seen CELL_TRUST times)."""
        ratio, seen = self._ratio.get(cell, (1.0, 0))
        return ratio if seen >= CELL_TRUST else self._ratio.get(kind, (1.0, 0))[0]

    def _correction(self, cell, kind) -> float:
        return self.speed * self._relative(cell, kind)

    def _observe(self, cell, kind, seconds: float, predicted: float) -> None:
        """A steady call's time against its load-time prediction: first the machine's
        speed learns what the call says of it (at the cell's own relative cost), then
        the cell and its class learn what is left."""
        if predicted <= 0 or seconds <= 0:
            return
        if self.learning_speed:
            implied = _clamped(seconds / (predicted * self._relative(cell, kind)))
            self.speed = (1 - SPEED_EMA) * self.speed + SPEED_EMA * implied
        self._learn(cell, kind, _clamped(seconds / (predicted * self.speed)))

    def _learn(self, cell, kind, measured: float) -> None:
        """A cell's first observation starts from its class's ratio."""
        start = self._ratio.get(kind, (1.0, 0))[0]
        for key in (cell, kind):
            ratio, seen = self._ratio.get(key, (start, 0))
            self._ratio[key] = ((1 - EMA) * ratio + EMA * measured, seen + 1)

    def _cell(self, batch: int, nodes: int) -> tuple[int, int]:
        return self.batch_sizes[_nearest(self.batch_sizes, batch)], self.tree_sizes[_nearest(self.tree_sizes, nodes)]

    def _draft_cell(self, method: str, nodes: int, requests: int) -> tuple[tuple, tuple]:
        """(cell, class) of a drafting call's running ratio: its batch bucket, and the
        method's calls at that tree size."""
        return ((method, nodes), self._bucket(requests)), (method, nodes)

    def _bucket(self, requests: int) -> int:
        return self.batch_sizes[_nearest(self.batch_sizes, requests)]

    def describe(self) -> Optional[str]:
        if not self.ready:
            return None
        rows = []
        for B in self.batch_sizes:
            ns, ts = self._verify_curve(B)
            rows.append(f"B{B}: " + " ".join(f"{n}:{t * 1e3:.1f}" for n, t in zip(ns, ts)))
        drafts = "; ".join(f"{m}/{n} " + " ".join(f"B{b}:{t * 1e3:.1f}" for b, t in sorted(p.items()))
                           for (m, n), p in sorted(self.draft.items()))
        return (f"verify ms by batch and tree size over {self.prefix_len} cached tokens [{'; '.join(rows)}], "
                f"+{self.attn_slope * 1e9:.1f} ns per query x cached token; draft ms [{drafts}]")
