"""Ratios measured over repeated runs: their median and a confidence interval for it.

A shared 2-core VM moves by 10-20 % from one run to the next, so a speedup measured
once says little; measured in R paired repeats (the configurations taking turns in
each), the median ratio and a distribution-free confidence interval of that median say
what the machine allows. Used by `bench.py latency --repeats` and
`bench_concurrency.py --repeats`.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional


def median_interval(values: list[float], confidence: float = 0.95) -> Optional[tuple[float, float, float]]:
    """A distribution-free confidence interval for the median of `values`: the k-th
    smallest and k-th largest value, with k the largest for which a Binomial(n, 1/2) draw
    falls below k with probability at most (1 - confidence) / 2 (each value lies above
    the median with probability one half, whatever the distribution). Returns (low, high,
    the interval's exact coverage), or None where n is too small (fewer than 6 values
    for 95 %)."""
    n, ordered = len(values), sorted(values)
    tail, k = 0.0, 0  # tail: P(Binomial(n, 1/2) < k + 1)
    while True:
        tail_next = tail + math.comb(n, k) / 2 ** n
        if tail_next > (1 - confidence) / 2:
            break
        tail, k = tail_next, k + 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k], 1 - 2 * tail


def ratio_summary(ratios: list[float], prefix: str = "ratio") -> dict:
    """`prefix` (the median), `_min`, `_max` and, from 6 ratios on, `_ci95_low`,
    `_ci95_high` and `_ci_coverage` (`median_interval`); empty without ratios."""
    if not ratios:
        return {}
    out = {prefix: statistics.median(ratios), f"{prefix}_min": min(ratios), f"{prefix}_max": max(ratios)}
    interval = median_interval(ratios)
    if interval is not None:
        out.update({f"{prefix}_ci95_low": interval[0], f"{prefix}_ci95_high": interval[1],
                    f"{prefix}_ci_coverage": interval[2]})
    return out


def format_ratio(summary: dict, prefix: str = "ratio") -> str:
    """"1.10x (0.90-1.20; median's 95 % CI 0.96-1.03)": the median, the range, and the
    interval where there is one."""
    ci = (f"; median's 95 % CI {summary[prefix + '_ci95_low']:.2f}-{summary[prefix + '_ci95_high']:.2f}"
          if prefix + "_ci95_low" in summary else "")
    return f"{summary[prefix]:.2f}x ({summary[prefix + '_min']:.2f}-{summary[prefix + '_max']:.2f}{ci})"
