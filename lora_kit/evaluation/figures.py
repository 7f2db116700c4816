"""Figures and tables for an :class:`lora_kit.evaluation.evaluate.EvalResult` (plotly; nothing is shown).

- :func:`metric_bars`: mean per metric, base vs each adapter, with bootstrap intervals as error bars
  (exact match and chrF on a 0-100 scale; reference loss in its own panel, lower is better).
- :func:`diff_histogram`: per-example adapter - base differences, with the mean and its paired
  interval marked; shows whether a gain is broad or carried by a few examples.
- :func:`control_changes`: per control task, the exact-match change (with interval) and how many
  outputs changed: where regressions show.
- :func:`examples_table`: a DataFrame to scroll, worst regressions first.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lora_kit.evaluation.compare import BASE, METRICS, worst_first

SCALE = {"exact_match": 100.0, "chrf": 1.0, "ref_loss": 1.0}


def _adapter(result, adapter: str | None) -> str:
    names = result.adapters
    if not names:
        raise ValueError("this result has no adapter (base model only); pass adapters= to evaluate.")
    if adapter is None:
        return names[0]
    if adapter not in names:
        raise ValueError(f"adapter {adapter!r} is not in this result; choose one of {names}.")
    return adapter


def metric_bars(result, split: str = "heldout") -> go.Figure:
    """Grouped bars: one bar group per metric, one bar per system, error bars = bootstrap interval."""
    if split not in result.summary["metrics"]:
        raise ValueError(f"split {split!r} was not evaluated; choose one of {list(result.summary['metrics'])}.")
    per_system = result.summary["metrics"][split]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35],
                        subplot_titles=("exact match (%) and chrF", "reference loss (nats/token, lower is better)"))
    for i, (system, ms) in enumerate(per_system.items()):
        for col, metrics in ((1, ("exact_match", "chrf")), (2, ("ref_loss",))):
            ms_here = [m for m in metrics if m in ms]
            y = [ms[m]["mean"] * SCALE[m] for m in ms_here]
            fig.add_trace(go.Bar(
                x=[METRICS[m][0] for m in ms_here], y=y, name=system, legendgroup=system, showlegend=col == 1,
                marker_color=_color(i),
                error_y=dict(type="data", symmetric=False,
                             array=[(ms[m]["hi"] - ms[m]["mean"]) * SCALE[m] for m in ms_here],
                             arrayminus=[(ms[m]["mean"] - ms[m]["lo"]) * SCALE[m] for m in ms_here])),
                row=1, col=col)
    conf = round(100 * result.summary["statistics"]["confidence"])
    n = next(iter(per_system.values()))["exact_match"]["n"]
    fig.update_layout(barmode="group", title=f"{split}: base vs adapter on {n} examples ({conf} % intervals)")
    return fig


def diff_histogram(result, adapter: str | None = None, metric: str = "chrf", split: str = "heldout") -> go.Figure:
    """Histogram of per-example ``metric`` differences (adapter - base) with the mean and interval."""
    a = _adapter(result, adapter)
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is not known; choose one of {list(METRICS)}.")
    df = result.per_example[result.per_example["split"] == split]
    diffs = df[f"delta_{metric}:{a}"] * SCALE[metric]
    comp = result.summary["comparisons"][a][split][metric]
    fig = go.Figure(go.Histogram(x=diffs, name=f"{a} - base", nbinsx=40))
    fig.add_vrect(x0=comp["lo"] * SCALE[metric], x1=comp["hi"] * SCALE[metric], fillcolor="orange",
                  opacity=0.25, line_width=0, annotation_text="interval of the mean")
    fig.add_vline(x=comp["diff"] * SCALE[metric], line_color="orange",
                  annotation_text=f"mean {comp['diff'] * SCALE[metric]:+.2f}")
    fig.add_vline(x=0, line_dash="dot", line_color="gray")
    label, _, unit, lower = METRICS[metric]
    better = "left" if lower else "right"
    fig.update_layout(title=f"{split}: per-example change in {label} ({a} - base; {better} is better)",
                      xaxis_title=f"{label} difference ({unit})", yaxis_title="examples", bargap=0.05)
    return fig


def control_changes(result, adapter: str | None = None) -> go.Figure:
    """Per control task: exact-match change in points (with interval) and outputs changed."""
    a = _adapter(result, adapter)
    tasks = result.summary["control_tasks"].get(a)
    if not tasks:
        raise ValueError("this result has no control set; pass control= to evaluate.")
    names = list(tasks)
    d = [tasks[t]["exact_match_diff"] for t in names]
    text = [f"{tasks[t]['changed']}/{tasks[t]['n']} changed" for t in names]
    fig = go.Figure(go.Bar(
        x=names, y=[100 * x["diff"] for x in d], text=text, textposition="outside", name="exact match change",
        marker_color=["#d62728" if x["hi"] < 0 else "#2ca02c" if x["lo"] > 0 else "#7f7f7f" for x in d],
        error_y=dict(type="data", symmetric=False, array=[100 * (x["hi"] - x["diff"]) for x in d],
                     arrayminus=[100 * (x["diff"] - x["lo"]) for x in d])))
    fig.add_hline(y=0, line_color="gray")
    fig.update_layout(title=f"control set: exact-match change per task ({a} - base); red = clear regression",
                      xaxis_title="control task", yaxis_title="points")
    return fig


def examples_table(result, adapter: str | None = None, split: str | None = None,
                   changed_only: bool = False) -> pd.DataFrame:
    """Examples to scroll, worst regressions first (exact-match drop, then chrF drop)."""
    a = _adapter(result, adapter)
    df = result.per_example
    if split is not None:
        df = df[df["split"] == split]
    if changed_only:
        df = df[df[f"changed:{a}"]]
    cols = ["split", "task", "index", "prompt", "reference", f"pred:{BASE}", f"pred:{a}",
            f"exact_match:{BASE}", f"exact_match:{a}", f"chrf:{BASE}", f"chrf:{a}",
            f"delta_exact_match:{a}", f"delta_chrf:{a}", f"outcome:{a}"]
    return worst_first(df, a)[cols].reset_index(drop=True)


def all_figures(result) -> dict:
    """Every figure that applies to ``result`` by name."""
    figs = {"metric_bars": metric_bars(result)}
    if result.adapters:
        figs["diff_histogram"] = diff_histogram(result)
        if result.summary["control_tasks"]:
            figs["control_changes"] = control_changes(result)
    return figs


def _color(i: int) -> str:
    return ("#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")[i % 6]
