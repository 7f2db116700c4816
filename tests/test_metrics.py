"""Metrics and paired statistics: hand-computed values, seeded intervals, honest sentences."""
import math

import numpy as np
import pytest

from lora_kit.evaluation import metrics as M
def test_exact_match_strips_whitespace_only():
    assert M.exact_match(" 2021-03-03\n", "2021-03-03") == 1.0
    assert M.exact_match("2021-03-3", "2021-03-03") == 0.0
    assert M.exact_match("ABC", "abc") == 0.0


def test_chrf_hand_computed():
    assert M.chrf("2021-03-03", "2021-03-03") == pytest.approx(100.0)
    assert M.chrf("xyz", "abc") == 0.0
    assert M.chrf("", "abc") == 0.0
    assert M.chrf("a b", "ab") == pytest.approx(100.0)  # whitespace is removed, as in sacrebleu
    # "ab" vs "abc": order 1 P=2/2 R=2/3, order 2 P=1/1 R=1/2, order 3+ skipped (hyp has none)
    # P=1, R=7/12, chrF2 = 5*P*R/(4P+R) = 35/55
    assert M.chrf("ab", "abc") == pytest.approx(100 * 35 / 55)
    assert M.chrf("2021-03-04", "2021-03-03") > M.chrf("1999-12-31", "2021-03-03")


def test_mean_ci_matches_normal_theory_and_is_seeded():
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 1.0, 400)
    ci = M.mean_ci(x, 0.95, 2000, seed=3)
    half = (ci["hi"] - ci["lo"]) / 2
    assert half == pytest.approx(1.96 * x.std(ddof=1) / math.sqrt(len(x)), rel=0.15)
    assert ci["lo"] < ci["mean"] < ci["hi"] and ci["n"] == 400
    assert M.mean_ci(x, 0.95, 2000, seed=3) == ci


def test_paired_bootstrap_pairs_examples():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, 200)
    adapter = base + 0.1  # same shift on every example: paired interval collapses to the shift
    d = M.paired_bootstrap(base, adapter)
    assert d["diff"] == pytest.approx(0.1) and d["lo"] == pytest.approx(0.1) and d["hi"] == pytest.approx(0.1)
    unpaired_half = 1.96 * math.sqrt(base.var() / 200 * 2)
    assert unpaired_half > 0.05  # an unpaired comparison could not even see the 0.1 shift clearly
    with pytest.raises(ValueError, match="same length"):
        M.paired_bootstrap([1, 0], [1])
    with pytest.raises(ValueError, match="empty"):
        M.paired_bootstrap([], [])
    with pytest.raises(ValueError, match="confidence"):
        M.paired_bootstrap([1], [1], confidence=95)


def test_summary_sentence_does_not_overclaim():
    gain = {"diff": 0.415, "lo": 0.36, "hi": 0.47, "n": 200, "confidence": 0.95}
    assert M.summary_sentence("exact match", gain) == \
        "+41.5 points exact match (95 % CI 36.0 to 47.0) on 200 held-out examples."
    unclear = {"diff": 0.02, "lo": -0.01, "hi": 0.05, "n": 50, "confidence": 0.95}
    s = M.summary_sentence("exact match", unclear)
    assert s.startswith("No clear difference in exact match: +2.0 points")
    drop = {"diff": -0.2, "lo": -0.3, "hi": -0.1, "n": 50, "confidence": 0.9}
    assert M.summary_sentence("exact match", drop).endswith("(worse).")
    assert "90 % CI" in M.summary_sentence("exact match", drop)
    all_flipped = {"diff": 1.0, "lo": 1.0, "hi": 1.0, "n": 200, "confidence": 0.95}
    assert "up to 1.5 % exceptions would still be plausible" in M.summary_sentence("exact match", all_flipped)
    loss_down = {"diff": -0.5, "lo": -0.6, "hi": -0.4, "n": 50, "confidence": 0.95}
    assert "worse" not in M.summary_sentence("loss", loss_down, scale=1, unit="nats", lower_is_better=True)


def test_outcome_and_perplexity():
    assert M.outcome((0.0, 50.0), (1.0, 100.0)) == "better"
    assert M.outcome((1.0, 100.0), (0.0, 90.0)) == "worse"
    assert M.outcome((0.0, 40.0), (0.0, 60.0)) == "better"  # chrF breaks the exact-match tie
    assert M.outcome((1.0, 100.0), (1.0, 100.0)) == "same"
    assert M.perplexity(2 * math.log(3), 2) == pytest.approx(3.0)
    assert math.isnan(M.perplexity(0.0, 0))
