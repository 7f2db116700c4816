"""Held-out hygiene: is the held-out split really unseen by training?

An example counts as leaked when its *prompt* also occurs in the training data, either exactly or
after normalizing (case-folded, punctuation, symbols and whitespace removed). Prompts, not whole
examples, are compared: a held-out prompt seen in training measures memory even if its reference
differs. Normalizing catches trivial variants ("What is 2+2?" vs "what is 2 + 2") at the price of
also matching strings that differ only in punctuation ("2024-01-05" vs "20240105"); that is the
conservative side for a held-out claim.

:func:`overlap_report` counts; :func:`check_heldout` refuses an overlapping split unless the caller
overrides it, in which case the result must be marked as not held-out.
"""
from __future__ import annotations

from lora_kit.data import normalize

MAX_SHOWN = 5


def _prompts(examples, prompt_field: str) -> list[str]:
    out = []
    for i, ex in enumerate(examples):
        if prompt_field not in ex or ex[prompt_field] is None:
            raise ValueError(f"example {i} has no {prompt_field!r} field; pass prompt_field=... naming the prompt column.")
        out.append(str(ex[prompt_field]))
    return out


def overlap_report(train, heldout, prompt_field: str = "prompt") -> dict:
    """Counts of held-out prompts that also occur in ``train`` (lists of dicts).

    Returns ``{"n_train", "n_heldout", "exact", "normalized", "overlapping", "fraction",
    "duplicates_within_heldout", "examples", "clean"}``: ``exact`` counts identical prompts,
    ``normalized`` those equal only after :func:`normalize`, ``overlapping`` their sum;
    ``examples`` shows up to five leaked prompts; ``duplicates_within_heldout`` counts held-out
    prompts repeated inside the held-out split (they inflate ``n`` but are not leaks).
    """
    tr, ho = _prompts(train, prompt_field), _prompts(heldout, prompt_field)
    tr_exact = set(tr)
    tr_norm = {normalize(p) for p in tr}
    exact = normalized = 0
    shown = []
    for i, p in enumerate(ho):
        kind = "exact" if p in tr_exact else "normalized" if normalize(p) in tr_norm else None
        if kind == "exact":
            exact += 1
        elif kind == "normalized":
            normalized += 1
        if kind and len(shown) < MAX_SHOWN:
            shown.append({"index": i, "prompt": p, "match": kind})
    n = len(ho)
    overlapping = exact + normalized
    return {"n_train": len(tr), "n_heldout": n, "exact": exact, "normalized": normalized,
            "overlapping": overlapping, "fraction": overlapping / n if n else 0.0,
            "duplicates_within_heldout": n - len({normalize(p) for p in ho}),
            "examples": shown, "clean": overlapping == 0}


def check_heldout(report: dict, allow_overlap: bool = False) -> dict:
    """Raise ValueError when ``report`` shows overlap, unless ``allow_overlap``; returns the report
    with ``"heldout"``: True only for a clean split."""
    report = dict(report, allow_overlap=allow_overlap, heldout=report["clean"])
    if report["clean"] or allow_overlap:
        return report
    eg = "; ".join(repr(e["prompt"][:60]) for e in report["examples"][:3])
    raise ValueError(
        f"{report['overlapping']} of {report['n_heldout']} held-out prompts also occur in the training data "
        f"({report['exact']} exact, {report['normalized']} after normalizing case/whitespace/punctuation), "
        f"e.g. {eg}. Remove them from the held-out split (or the training data), or pass "
        "allow_overlap=True to evaluate anyway; the result is then marked as not held-out.")
