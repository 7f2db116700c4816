"""From per-example outputs to the comparison: metrics per row, paired differences, control changes.

Pure pandas/numpy (no model): :func:`evaluate` fills a table with one row per example and one
``pred:<system>`` column per system ("base" and each adapter), then :func:`score_frame` adds the
metric columns and :func:`compare` builds the summary. Keeping this apart from generation makes
every number testable on hand-written outputs.

Column names: ``exact_match:<system>``, ``chrf:<system>``, ``ref_loss:<system>`` (mean NLL per
reference token, prompt masked), and per adapter ``changed:<a>`` (output differs from the base's),
``delta_<metric>:<a>`` (adapter minus base) and ``outcome:<a>`` ("better" / "worse" / "same",
judged on exact match, then chrF).
"""
from __future__ import annotations

from typing import NamedTuple

import pandas as pd

from lora_kit.evaluation import metrics as M
BASE = "base"


class Metric(NamedTuple):
    label: str
    scale: float  # multiplies a mean or difference for display (100: a 0/1 rate in percent / points)
    unit: str  # of a difference
    lower_is_better: bool
    digits: int  # shown
    mean_unit: str  # of a mean


METRICS = {
    "exact_match": Metric("exact match", 100.0, "points", False, 1, "%"),
    "chrf": Metric("chrF", 1.0, "points", False, 1, ""),
    "ref_loss": Metric("reference loss", 1.0, "nats/token", True, 2, "nats/token"),
}
TOP_CHANGES = 10


def mean_text(metric: str, mean: float | None, unit: bool = True) -> str:
    """A metric's mean as the summaries show it, e.g. "12.5 %", "24.9", "5.58 nats/token" (``unit=False``:
    without its unit, "%" excepted)."""
    if mean is None:
        return "—"
    spec = METRICS[metric]
    shown = spec.mean_unit if spec.mean_unit and (unit or spec.mean_unit == "%") else ""
    return M._fmt(mean * spec.scale, spec.digits) + (f" {shown}" if shown else "")


def diff_text(metric: str, diff: dict, unit: bool = True) -> str:
    """A paired difference with its interval, e.g. "+24.9 points, 95 % CI 24.5 to 25.3" (``unit=False``:
    without its unit)."""
    spec = METRICS[metric]
    return (f"{M.signed(diff['diff'] * spec.scale, spec.digits)}{f' {spec.unit}' if unit else ''}, "
            f"{M.interval_text(diff, spec.scale, spec.digits)}")


def score_frame(df: pd.DataFrame, systems: list[str]) -> pd.DataFrame:
    """Add ``exact_match:<s>`` and ``chrf:<s>`` for every system, and the paired columns per adapter."""
    df = df.copy()
    refs = df["reference"].astype(str).tolist()
    for s in systems:
        preds = df[f"pred:{s}"].astype(str).tolist()
        df[f"exact_match:{s}"] = [M.exact_match(p, r) for p, r in zip(preds, refs)]
        df[f"chrf:{s}"] = [M.chrf(p, r) for p, r in zip(preds, refs)]
    for a in systems:
        if a == BASE:
            continue
        df[f"changed:{a}"] = df[f"pred:{a}"].astype(str).str.strip() != df[f"pred:{BASE}"].astype(str).str.strip()
        for m in METRICS:
            if f"{m}:{a}" in df:
                df[f"delta_{m}:{a}"] = df[f"{m}:{a}"] - df[f"{m}:{BASE}"]
        df[f"outcome:{a}"] = [M.outcome((eb, cb), (ea, ca)) for eb, cb, ea, ca in zip(
            df[f"exact_match:{BASE}"], df[f"chrf:{BASE}"], df[f"exact_match:{a}"], df[f"chrf:{a}"])]
    return df


def system_metrics(df: pd.DataFrame, system: str, confidence: float, n_resamples: int, seed: int) -> dict:
    """Mean and bootstrap interval of each metric for one system, plus perplexity."""
    out = {}
    for m in METRICS:
        col = f"{m}:{system}"
        if col in df:
            out[m] = M.mean_ci(df[col].to_numpy(float), confidence, n_resamples, seed)
    if f"ref_nll:{system}" in df:
        out["perplexity"] = M.perplexity(float(df[f"ref_nll:{system}"].sum()), int(df["ref_tokens"].sum()))
    return out


def paired(df: pd.DataFrame, adapter: str, confidence: float, n_resamples: int, seed: int) -> dict:
    """Paired differences (adapter - base) per metric, and better/worse/same/changed counts."""
    out = {m: M.paired_bootstrap(df[f"{m}:{BASE}"].to_numpy(float), df[f"{m}:{adapter}"].to_numpy(float),
                                 confidence, n_resamples, seed)
           for m in METRICS if f"{m}:{adapter}" in df}
    counts = df[f"outcome:{adapter}"].value_counts()
    out.update({k: int(counts.get(k, 0)) for k in ("better", "worse", "same")})
    out["changed"] = int(df[f"changed:{adapter}"].sum())
    out["n"] = int(len(df))
    return out


def verdict(metric: str, diff: dict) -> str:
    """"unchanged" when no example's score moved (an interval of 0 to 0), else
    :func:`lora_kit.evaluation.metrics.verdict`: "better", "worse" or "no clear difference"."""
    return "unchanged" if diff["lo"] == diff["hi"] == 0 else M.verdict(diff, METRICS[metric].lower_is_better)


def _listed(names: list[str], last: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def sentence(comp: dict, means: dict, adapter: str, what: str) -> str:
    """Every metric of one adapter's paired comparison on one split (``comp``, :func:`paired`), in words that do
    not overclaim (:func:`lora_kit.evaluation.metrics.verdict`): what the adapter is better or worse in and where
    there is no clear difference, then each metric base -> adapter with the difference and its interval, e.g.
    "On 6 held-out examples: the adapter is better in chrF and reference loss; no clear difference in exact match.
    Exact match 0.0 % → 0.0 % (+0.0 points, 95 % CI 0.0 to 0.0); chrF 0.0 → 24.9 (+24.9 points, ...); ...".
    ``means``: the split's :func:`system_metrics` per system."""
    said: dict[str, list[str]] = {"better": [], "worse": [], "no clear difference": [], "unchanged": []}
    parts = []
    for m, spec in METRICS.items():
        if m not in comp:
            continue
        d = comp[m]
        v = verdict(m, d)
        said[v].append(spec.label)
        b, a = ((means.get(s) or {}).get(m, {}).get("mean") for s in (BASE, adapter))
        no_width = f"; {M.no_width_note(d['n'])}" if d["lo"] == d["hi"] and v in ("better", "worse") else ""
        once = spec.unit == spec.mean_unit  # e.g. nats/token: said after the means, not again after the difference
        parts.append(f"{spec.label} {mean_text(m, b, unit=not once)} → {mean_text(m, a)} "
                     f"({diff_text(m, d, unit=not once)}{no_width})")
    lead = []
    if said["better"]:
        lead.append(f"the adapter is better in {_listed(said['better'])}")
    if said["worse"]:
        lead.append(f"{'worse' if lead else 'the adapter is worse'} in {_listed(said['worse'])}")
    if said["no clear difference"]:
        lead.append(f"no clear difference in {_listed(said['no clear difference'], 'and' if lead else 'or')}")
    if said["unchanged"]:
        lead.append(f"{_listed(said['unchanged'])} unchanged (no example's score moved)")
    body = "; ".join(parts)
    return f"On {comp['n']} {what}: {'; '.join(lead)}. {body[0].upper()}{body[1:]}."


def control_tasks(df: pd.DataFrame, adapter: str, confidence: float, n_resamples: int, seed: int) -> dict:
    """Per control task: n, outputs changed, base and adapter means, and the paired difference."""
    out = {}
    for task, g in df.groupby("task", sort=True):
        row = {"n": int(len(g)), "changed": int(g[f"changed:{adapter}"].sum())}
        for m in ("exact_match", "chrf"):
            row[f"{m}:{BASE}"] = float(g[f"{m}:{BASE}"].mean())
            row[f"{m}:{adapter}"] = float(g[f"{m}:{adapter}"].mean())
            row[f"{m}_diff"] = M.paired_bootstrap(g[f"{m}:{BASE}"].to_numpy(float),
                                                  g[f"{m}:{adapter}"].to_numpy(float),
                                                  confidence, n_resamples, seed)
        out[str(task)] = row
    return out


def worst_first(df: pd.DataFrame, adapter: str) -> pd.DataFrame:
    """Rows sorted with the worst regressions first: exact-match drop, then chrF drop, then changed."""
    return df.assign(_changed=~df[f"changed:{adapter}"]).sort_values(
        [f"delta_exact_match:{adapter}", f"delta_chrf:{adapter}", "_changed"], kind="stable").drop(columns="_changed")


def top_changes(df: pd.DataFrame, adapter: str, k: int = TOP_CHANGES) -> list[dict]:
    """The ``k`` changed outputs with the largest drop (regressions first), as plain records."""
    changed = worst_first(df[df[f"changed:{adapter}"]], adapter).head(k)
    cols = ["task", "index", "prompt", "reference", f"pred:{BASE}", f"pred:{adapter}",
            f"delta_exact_match:{adapter}", f"delta_chrf:{adapter}", f"outcome:{adapter}"]
    return changed[cols].to_dict("records")


def control_sentence(comp: dict, tasks: dict, means: dict, adapter: str) -> str:
    """E.g. "Control set: 12 of 200 outputs changed. On 200 control examples: no clear difference in ...
    Largest drop: task 'add', -30.0 points exact match (95 % CI ...)." (:func:`sentence` in between)."""
    s = (f"Control set: {comp['changed']} of {comp['n']} outputs changed. "
         f"{sentence(comp, means, adapter, 'control examples')}")
    drops = sorted(tasks.items(), key=lambda kv: kv[1]["exact_match_diff"]["diff"])
    if drops and drops[0][1]["exact_match_diff"]["diff"] < 0:
        name, t = drops[0]
        d = t["exact_match_diff"]
        s += (f" Largest drop: task {name!r}, {M._fmt(100 * d['diff'], 1)} points exact match "
              f"({round(100 * d['confidence'])} % CI {M._fmt(100 * d['lo'], 1)} to {M._fmt(100 * d['hi'], 1)}, "
              f"n={t['n']}).")
    return s


def summarize(per_example: pd.DataFrame, adapters: list[str], is_heldout: bool = True,
              confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Everything :func:`lora_kit.evaluation.evaluate` reports from the scored table: ``metrics`` (per split and
    system), ``comparisons`` (per adapter and split), ``control_tasks``, ``top_changes``,
    ``sentences`` (per adapter: ``{"heldout", "control"}``), ``summary_sentence`` (held-out, all
    adapters), ``control_sentence`` and ``control_changed_fraction`` (largest over adapters)."""
    stats = dict(confidence=confidence, n_resamples=n_resamples, seed=seed)
    systems = [BASE] + list(adapters)
    out = {"metrics": {}, "comparisons": {}, "control_tasks": {}, "top_changes": {}, "sentences": {},
           "control_sentence": None, "control_changed_fraction": None}
    by_split = dict(tuple(per_example.groupby("split", sort=False)))
    for split, g in by_split.items():
        out["metrics"][split] = {s: system_metrics(g, s, **stats) for s in systems}
    for a in adapters:
        comp = {split: paired(g, a, **stats) for split, g in by_split.items()}
        out["comparisons"][a] = comp
        if "control" in comp:
            out["control_tasks"][a] = control_tasks(by_split["control"], a, **stats)
            out["top_changes"][a] = top_changes(by_split["control"], a)
            frac = comp["control"]["changed"] / comp["control"]["n"]
            out["control_changed_fraction"] = max(frac, out["control_changed_fraction"] or 0.0)
    out["sentences"] = sentences(out, is_heldout)
    out["summary_sentence"], out["control_sentence"] = joined_sentences(out, is_heldout)
    return out


def _what(is_heldout: bool) -> str:
    return ("held-out examples" if is_heldout
            else "evaluation examples that OVERLAP the training data (not a held-out result)")


def sentences(summary: dict, is_heldout: bool = True) -> dict:
    """Per adapter ``{"heldout", "control"}``: :func:`sentence` and :func:`control_sentence`, made from a summary's
    ``metrics``, ``comparisons`` and ``control_tasks`` alone (:func:`summarize`'s, or eval.json's)."""
    out = {}
    for a, comp in (summary.get("comparisons") or {}).items():
        means = summary.get("metrics") or {}
        out[a] = {"heldout": sentence(comp["heldout"], means.get("heldout") or {}, a, _what(is_heldout)),
                  "control": None}
        if "control" in comp:
            out[a]["control"] = control_sentence(comp["control"], (summary.get("control_tasks") or {}).get(a) or {},
                                                 means.get("control") or {}, a)
    return out


def joined_sentences(summary: dict, is_heldout: bool = True) -> tuple[str, str | None]:
    """(held-out sentence, control sentence) over every adapter ("<name>: " before each when there are several),
    from a summary's records (:func:`sentences`); the base model's own scores when no adapter was given."""
    per = sentences(summary, is_heldout)
    if not per:
        m = summary["metrics"]["heldout"][BASE]
        scores = ", ".join(f"{METRICS[k].label} {mean_text(k, m[k]['mean'])}" for k in METRICS if k in m)
        n = next(m[k]["n"] for k in METRICS if k in m)
        return f"Base model only (no adapter given): {scores} on {n} {_what(is_heldout)}.", None

    def joined(part: str) -> str | None:
        return " ".join((x if len(per) == 1 else f"{a}: {x}") for a, s in per.items() if (x := s[part])) or None

    return joined("heldout"), joined("control")
