"""Per-example metrics and the paired statistics used to compare a base model with an adapter.

- :func:`exact_match`: 1.0 when prediction and reference are equal after ``strip()``. Strict: one
  wrong character is a miss, which is what a structured task (dates, codes) wants.
- :func:`chrf`: character n-gram F-score (chrF, Popović 2015) on a 0-100 scale, with sacrebleu's
  sentence-level defaults (orders 1-6, beta=2, whitespace removed, orders averaged where both
  strings have n-grams). Gives partial credit ("2024-01-06" vs "2024-01-05"), so it moves when
  exact match cannot; it is a small local implementation so the kit needs no extra dependency.
- :func:`paired_bootstrap`: confidence interval of the difference of means on the *same*
  examples (resampling example indices, seeded, vectorized). Pairing removes the between-example
  variance, so it is much tighter than comparing two independent intervals.
- :func:`summary_sentence` / :func:`verdict`: words that do not overclaim: when the interval includes 0
  they say there is no clear difference.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

CHRF_ORDER = 6
CHRF_BETA = 2.0


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when ``prediction.strip() == reference.strip()``, else 0.0."""
    return float(prediction.strip() == reference.strip())


def _char_ngrams(text: str, n: int) -> Counter:
    return Counter(text[i:i + n] for i in range(len(text) - n + 1))


def chrf(prediction: str, reference: str, order: int = CHRF_ORDER, beta: float = CHRF_BETA) -> float:
    """Sentence-level chrF in [0, 100] (sacrebleu's default definition; 0 when either side is empty)."""
    hyp, ref = "".join(prediction.split()), "".join(reference.split())
    precision = recall = 0.0
    orders = 0
    for n in range(1, order + 1):
        h, r = _char_ngrams(hyp, n), _char_ngrams(ref, n)
        n_hyp, n_ref = sum(h.values()), sum(r.values())
        if n_hyp == 0 or n_ref == 0:
            continue
        match = sum((h & r).values())
        precision += match / n_hyp
        recall += match / n_ref
        orders += 1
    if orders == 0:
        return 0.0
    precision, recall = precision / orders, recall / orders
    if precision + recall == 0:
        return 0.0
    b2 = beta * beta
    return 100.0 * (1 + b2) * precision * recall / (b2 * precision + recall)


def bootstrap_means(values, n_resamples: int = 2000, seed: int = 0, chunk: int = 500) -> np.ndarray:
    """Means of ``n_resamples`` resamples (with replacement) of ``values`` (1-D or (n, k) columns).

    The same resampled indices are used for every column, which is what makes a difference of
    columns *paired*. Processed in chunks of resamples so memory stays ~``chunk * n`` numbers.
    """
    v = np.asarray(values, dtype=float)
    n = v.shape[0]
    if n == 0:
        raise ValueError("cannot bootstrap an empty set of examples; pass at least one example.")
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n_resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, n_resamples - start), n))
        out.append(v[idx].mean(axis=1))
    return np.concatenate(out)


def mean_ci(values, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Mean with a percentile-bootstrap confidence interval: ``{"mean", "lo", "hi", "n"}``."""
    v = np.asarray(values, dtype=float)
    means = bootstrap_means(v, n_resamples, seed)
    a = (1 - confidence) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return {"mean": float(v.mean()), "lo": float(lo), "hi": float(hi), "n": int(v.shape[0])}


def paired_bootstrap(base, adapter, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Difference of means ``adapter - base`` on paired examples, with a bootstrap interval.

    Returns ``{"diff", "lo", "hi", "n", "confidence"}``; ``lo``/``hi`` are percentile bounds.
    """
    b, a = np.asarray(base, dtype=float), np.asarray(adapter, dtype=float)
    if b.shape != a.shape or b.ndim != 1:
        raise ValueError(f"paired comparison needs two 1-D arrays of the same length, got {b.shape} and {a.shape}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence!r}.")
    ci = mean_ci(a - b, confidence, n_resamples, seed)
    return {"diff": ci["mean"], "lo": ci["lo"], "hi": ci["hi"], "n": ci["n"], "confidence": confidence}


def outcome(base_key: tuple, adapter_key: tuple) -> str:
    """"better" / "worse" / "same" comparing tuples of per-example scores (higher is better)."""
    if adapter_key > base_key:
        return "better"
    if adapter_key < base_key:
        return "worse"
    return "same"


def _fmt(x: float, digits: int) -> str:
    return f"{x:.{digits}f}".replace("-", "\u2212")


def signed(x: float, digits: int) -> str:
    """``x`` rounded, with "+" when positive and a true minus sign when negative."""
    return ("+" if x > 0 else "") + _fmt(x, digits)


def verdict(diff: dict, lower_is_better: bool = False) -> str:
    """"no clear difference" when the paired interval contains 0, else "better" or "worse" (the adapter's)."""
    if diff["lo"] <= 0 <= diff["hi"]:
        return "no clear difference"
    return "better" if ((diff["diff"] < 0) if lower_is_better else (diff["diff"] > 0)) else "worse"


def interval_text(diff: dict, scale: float = 100.0, digits: int = 1) -> str:
    """E.g. "95 % CI 36.0 to 47.0" (``scale`` multiplies the bounds)."""
    return (f"{round(diff['confidence'] * 100)} % CI {_fmt(diff['lo'] * scale, digits)} to "
            f"{_fmt(diff['hi'] * scale, digits)}")


def no_width_note(n: int) -> str:
    """What an interval of no width (every paired difference equal) still allows."""
    return (f"every example moved the same way, so the bootstrap interval has no width -- with n={n}, "
            f"up to {300 / n:.1f} % exceptions would still be plausible (rule of three)")


def summary_sentence(metric: str, diff: dict, what: str = "held-out examples", scale: float = 100.0,
                     unit: str = "points", digits: int = 1, lower_is_better: bool = False) -> str:
    """One sentence for a paired difference, e.g.
    ``"+41.5 points exact match (95 % CI 36.0 to 47.0) on 200 held-out examples."``

    When the interval contains 0 the sentence says "no clear difference" instead of a direction.
    ``scale`` multiplies the difference (100 turns a 0/1 rate into percentage points).
    """
    d, n, interval = diff["diff"] * scale, diff["n"], interval_text(diff, scale, digits)
    said = verdict(diff, lower_is_better)
    if said == "no clear difference":
        return f"No clear difference in {metric}: {signed(d, digits)} {unit} ({interval}) on {n} {what}."
    tail = "" if said == "better" else " (worse)"
    if diff["lo"] == diff["hi"]:  # every paired difference equal: the bootstrap cannot see any spread
        tail += f"; {no_width_note(n)}"
    return f"{signed(d, digits)} {unit} {metric} ({interval}) on {n} {what}{tail}."


def perplexity(total_nll: float, total_tokens: int) -> float:
    """exp(token-weighted mean negative log-likelihood); NaN when there are no tokens."""
    return math.exp(total_nll / total_tokens) if total_tokens else float("nan")
