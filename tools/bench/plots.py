"""Matplotlib figures for the benchmark reports (Agg backend, PNG files).

Owns only drawing: every function takes plain Python data (dicts of lists or
numbers, already measured), writes one PNG and returns its path. No benchmark
runs, file parsing or statistics beyond a mean in a legend live here.

    speedup_bars({"eagle2": {"mt_bench": 2.8, "humaneval": 3.3}, "medusa": {...}}, "speedup.png")
    tau_histogram({"eagle2": [3, 4, 2, ...], "eagle3": [...]}, "tau.png")
    throughput_vs_concurrency({"plain": [(1, 40.0), (4, 120.0)], "eagle2": [...]}, "tput.png")

τ (tau) is tokens emitted per target forward, accepted draft tokens + 1 (see
docs/DESIGN.md), so a τ histogram has integer bins starting at 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator  # noqa: E402


def _validate_that(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speedup_bars(
    speedups: Mapping[str, Mapping[str, float]],
    path: str | Path,
    title: str = "Speedup over plain decoding",
    ylabel: str = "speedup (x)",
) -> Path:
    """Grouped bars: one group per question set, one bar per method.

    speedups[method][question_set] = speedup; a missing pair leaves a gap.
    A dashed line marks 1.0 (no speedup).
    """
    _validate_that(len(speedups) > 0, "speedup_bars: no methods")
    methods = list(speedups)
    sets: list[str] = []
    for per_set in speedups.values():
        sets += [s for s in per_set if s not in sets]
    _validate_that(len(sets) > 0, "speedup_bars: no question sets")

    x = np.arange(len(sets))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(sets) + 2) + 1.6, 4))
    for i, method in enumerate(methods):
        values = [speedups[method].get(s, np.nan) for s in sets]
        bars = ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=method)
        ax.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.2f}" for v in values], fontsize=7)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(x, sets)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    return _save(fig, path)


def tau_histogram(
    taus: Mapping[str, Sequence[int]],
    path: str | Path,
    title: str = "Tokens per target forward (τ)",
) -> Path:
    """Side-by-side bars of the fraction of verify steps with each τ, per method.

    taus[method] = τ of each verify step (integers >= 1). The legend shows the mean.
    """
    _validate_that(len(taus) > 0, "tau_histogram: no methods")
    for method, values in taus.items():
        _validate_that(len(values) > 0, f"tau_histogram: no steps for {method!r}")
        _validate_that(min(values) >= 1, f"tau_histogram: τ < 1 for {method!r}")
    top = int(max(max(v) for v in taus.values()))
    bins = np.arange(1, top + 1)
    width = 0.8 / len(taus)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * top + 2), 4))
    for i, (method, values) in enumerate(taus.items()):
        arr = np.asarray(values, dtype=np.int64)
        frac = np.array([(arr == b).mean() for b in bins])
        ax.bar(bins - 0.4 + width * (i + 0.5), frac, width, label=f"{method} (mean {arr.mean():.2f})")
    ax.set_xticks(bins)
    ax.set_xlabel("τ (accepted + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def throughput_vs_concurrency(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    title: str = "Output throughput vs concurrency",
    ylabel: str = "output tokens/s",
) -> Path:
    """One line per label through (concurrency, throughput) points; log2 x axis."""
    _validate_that(len(series) > 0, "throughput_vs_concurrency: no series")
    fig, ax = plt.subplots(figsize=(6, 4))
    ticks: set[float] = set()
    for label, points in series.items():
        _validate_that(len(points) > 0, f"throughput_vs_concurrency: no points for {label!r}")
        pts = sorted(points)
        _validate_that(pts[0][0] > 0, f"throughput_vs_concurrency: concurrency must be > 0 ({label!r})")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ticks.update(p[0] for p in pts)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))  # the measured concurrencies,
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))  # as plain numbers
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
