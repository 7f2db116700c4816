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

import pandas as pd

from lora_kit.evaluation import metrics as M
BASE = "base"
# metric -> (label, scale for sentences, unit, lower_is_better)
METRICS = {
    "exact_match": ("exact match", 100.0, "points", False),
    "chrf": ("chrF", 1.0, "points", False),
    "ref_loss": ("reference loss", 1.0, "nats/token", True),
}
TOP_CHANGES = 10


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


def sentence(comp: dict, what: str, metric: str = "exact_match") -> str:
    label, scale, unit, lower = METRICS[metric]
    return M.summary_sentence(label, comp[metric], what=what, scale=scale, unit=unit, lower_is_better=lower)


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


def control_sentence(comp: dict, tasks: dict) -> str:
    """E.g. "Control set: 12 of 200 outputs changed; No clear difference in exact match ...;
    largest drop: 'add' -30.0 points exact match (95 % CI ...)."."""
    first = sentence(comp, "control examples")
    s = f"Control set: {comp['changed']} of {comp['n']} outputs changed; {first[0].lower()}{first[1:]}"
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
    what = ("held-out examples" if is_heldout
            else "evaluation examples that OVERLAP the training data (not a held-out result)")
    for a in adapters:
        comp = {split: paired(g, a, **stats) for split, g in by_split.items()}
        out["comparisons"][a] = comp
        out["sentences"][a] = {"heldout": sentence(comp["heldout"], what), "control": None}
        if "control" in comp:
            out["control_tasks"][a] = control_tasks(by_split["control"], a, **stats)
            out["top_changes"][a] = top_changes(by_split["control"], a)
            out["sentences"][a]["control"] = control_sentence(comp["control"], out["control_tasks"][a])
            frac = comp["control"]["changed"] / comp["control"]["n"]
            out["control_changed_fraction"] = max(frac, out["control_changed_fraction"] or 0.0)

    def joined(part: str) -> str | None:
        parts = [(x if len(adapters) == 1 else f"{a}: {x}") for a in adapters
                 if (x := out["sentences"][a][part])]
        return " ".join(parts) or None

    if adapters:
        out["summary_sentence"], out["control_sentence"] = joined("heldout"), joined("control")
    else:
        m = out["metrics"]["heldout"][BASE]["exact_match"]
        out["summary_sentence"] = (f"Base model only (no adapter given): exact match {100 * m['mean']:.1f} % "
                                   f"on {m['n']} {what}.")
    return out

