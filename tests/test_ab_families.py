"""tools/bench/ab_families.py's arithmetic: ratios are paired within a round (a slow
round slows both families alike and cancels), each method's speedup is over its own
family's plain decoding, and the table names both families."""
from __future__ import annotations

import pytest

import ab_families


def result(none_a, eagle_a, none_b, eagle_b) -> dict:
    def cell(tok_s, draft):
        return {"tok_s": tok_s, "draft_ms": [draft] * len(tok_s), "tau": 2.0 if draft else 1.0}
    return {"A": {"none": cell(none_a, 0.0), "eagle3": cell(eagle_a, 6.0)},
            "B": {"none": cell(none_b, 0.0), "eagle3": cell(eagle_b, 5.0)}}


def test_ratios_are_paired_within_a_round():
    """Rounds at 10, 20, ..., 70 tok/s: unpaired medians would also give B/A 1.1, but the
    pairing's interval collapses onto it, and B's speedup over its own plain decoding is
    1.5 whatever A's is."""
    speeds = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    summary = ab_families.summarize(result(speeds, [2 * x for x in speeds], speeds, [1.5 * x for x in speeds]),
                                    ["none", "eagle3"])
    assert summary["B/A/none"]["ratio"] == pytest.approx(1.0)
    assert summary["B/A/eagle3"]["ratio"] == pytest.approx(0.75)
    assert summary["B/A/eagle3"]["ratio_ci95_low"] == pytest.approx(0.75)
    assert summary["B/A/eagle3"]["ratio_ci95_high"] == pytest.approx(0.75)
    assert summary["A/eagle3"]["speedup"] == pytest.approx(2.0) and summary["B/eagle3"]["speedup"] == pytest.approx(1.5)
    assert summary["B/eagle3"]["draft_ms"] == 5.0 and "speedup" not in summary["B/none"]


def test_a_noisy_round_widens_the_interval_not_the_median():
    speeds = [50.0] * 7
    eagle_b = [55.0] * 6 + [80.0]  # one round B ran alone
    summary = ab_families.summarize(result(speeds, speeds, speeds, eagle_b), ["none", "eagle3"])
    assert summary["B/A/eagle3"]["ratio"] == pytest.approx(1.1)
    assert summary["B/A/eagle3"]["ratio_max"] == pytest.approx(1.6)


def test_markdown_names_both_families_and_every_set():
    speeds = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    summary = ab_families.summarize(result(speeds, speeds, speeds, speeds), ["none", "eagle3"])
    text = ab_families.markdown({"labels": ["A", "B"], "methods": ["none", "eagle3"],
                                 "sets": {"mt_bench": summary, "gsm8k": summary}})
    assert "| mt_bench | A | eagle3 |" in text and "| gsm8k | B | none |" in text
    assert "| B / A tok/s (95 % CI) |" in text and "| gsm8k | eagle3 | 1.000 (1.000-1.000) |" in text
