"""Ratios over repeated runs (`tools/bench/repeats.py`) and their use by `bench.py`'s
comparison: the median's distribution-free interval holds as often as it says, and each
pass's speedup is taken against the first configuration's same pass."""
from __future__ import annotations

import math
import random
import statistics

import pytest

import bench
import repeats

def test_the_median_interval_covers_the_median_as_often_as_it_says():
    """The distribution-free interval of a median ratio: the order statistics that
    Binomial(n, 1/2) puts them at, None below 6 values; drawn from a skewed distribution
    many times, it holds the true median as often as its stated coverage."""
    assert repeats.median_interval([1.0] * 5) is None
    low, high, coverage = repeats.median_interval(list(range(15, 0, -1)))
    assert (low, high) == (4, 12) and coverage == pytest.approx(1 - 2 * 576 / 2 ** 15)
    assert repeats.median_interval(list(range(6)))[:2] == (0, 5)
    rng = random.Random(0)
    for n in (6, 10, 15):
        trials, held = 4000, 0
        for _ in range(trials):
            low, high, coverage = repeats.median_interval([rng.expovariate(1.0) for _ in range(n)])
            held += low <= math.log(2) <= high  # the exponential's median
        assert coverage >= 0.95 and abs(held / trials - coverage) < 0.015, (n, held / trials, coverage)


def test_a_ratio_summary_names_its_median_range_and_interval():
    assert repeats.ratio_summary([]) == {}
    few = repeats.ratio_summary([1.2, 0.9, 1.1], "speedup")
    assert few == {"speedup": 1.1, "speedup_min": 0.9, "speedup_max": 1.2}
    assert repeats.format_ratio(few, "speedup") == "1.10x (0.90-1.20)"
    many = repeats.ratio_summary([1.0 + i / 100 for i in range(10)])
    assert (many["ratio_ci95_low"], many["ratio_ci95_high"]) == (1.01, 1.08)  # 2nd and 9th of 10
    assert repeats.format_ratio(many) == "1.04x (1.00-1.09; median's 95 % CI 1.01-1.08)"


def _run(label: str, per_pass: list[float]) -> bench.Run:
    result = bench.RequestResult(0, 4, 0.0, 0.1, 1.0, output_ids=[1] * 10)
    return bench.Run(label, "-", [result], 1.0, pass_throughputs=per_pass)


def test_each_pass_is_compared_with_the_same_pass_of_the_first_configuration():
    """Passes are paired: a machine slower in pass 2 is slower for both. Pairing by
    position gives 2.0x every time; sorting the two lists apart would not."""
    plain = [10.0, 5.0, 8.0, 20.0, 12.0, 6.0]
    rows = bench.comparison_rows([_run("none", plain), _run("eagle3", [2 * x for x in plain])], greedy=False)
    assert rows[1]["speedup_repeats"] == [2.0] * 6
    assert rows[1]["speedup_over_repeats"] == 2.0
    assert rows[1]["speedup_over_repeats_ci95_low"] == rows[1]["speedup_over_repeats_ci95_high"] == 2.0
    mixed = [20.0, 5.0, 16.0, 10.0, 12.0, 12.0]
    rows = bench.comparison_rows([_run("none", plain), _run("eagle3", mixed)], greedy=False)
    assert rows[1]["speedup_repeats"] == [2.0, 1.0, 2.0, 0.5, 1.0, 2.0]
    assert rows[1]["speedup_over_repeats"] == statistics.median([2.0, 1.0, 2.0, 0.5, 1.0, 2.0])
    text = "\n".join(bench.repeats_lines(rows))
    assert "over 6 paired passes" in text and "eagle3: 1.50x (0.50-2.00; median's 95 % CI 0.50-2.00) of none" in text
    # ... and against a transformers entry, pass by pass too
    hf = [x / 2 for x in plain[::-1]]
    rows = bench.comparison_rows([_run("none", plain), _run("eagle3", mixed), _run("hf-prompt-lookup", hf)],
                                 greedy=False)
    over_hf = [m / h for m, h in zip(mixed, hf)]
    assert rows[1]["over_repeats_against"]["hf-prompt-lookup"]["ratio"] == statistics.median(over_hf)
    assert "over_repeats_against" not in rows[2] and "over_repeats_against" not in rows[0]
    assert f"of none; {statistics.median(over_hf):.2f}x" in bench.repeats_lines(rows)[1]
    single = bench.comparison_rows([_run("none", [10.0]), _run("eagle3", [20.0])], greedy=False)
    assert "speedup_repeats" not in single[1] and bench.repeats_lines(single) == []
