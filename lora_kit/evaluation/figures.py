"""Figures and tables for an :class:`lora_kit.evaluation.evaluate.EvalResult` (plotly; nothing is shown).

- :func:`metric_bars`: mean per metric, base vs each adapter, with bootstrap intervals as error bars
  (exact match and chrF on a 0-100 scale; reference loss in its own panel, lower is better).
- :func:`diff_histogram`: per-example adapter - base differences, with the mean and its paired
  interval marked; shows whether a gain is broad or carried by a few examples.
- :func:`control_changes`: per control task and adapter (every adapter of the result), the
  exact-match change (with interval) and how many outputs changed: where regressions show.
- :func:`examples_table`: a DataFrame to scroll, worst regressions first.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lora_kit.evaluation.compare import BASE, METRICS, worst_first
from lora_kit.plan.figures import plot_size, style, text_size, to_px

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
    # panel names as axis titles: subplot titles would sit where the legend row is
    fig = make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35], horizontal_spacing=0.12)
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
    fig.update_yaxes(title_text="exact match (%) and chrF (0-100)", row=1, col=1)
    fig.update_yaxes(title_text="reference loss (nats/token, lower is better)", row=1, col=2)
    fig.update_layout(barmode="group", title=f"{split}: base vs adapter on {n} examples ({conf} % intervals)")
    return style(fig)


def diff_histogram(result, adapter: str | None = None, metric: str = "chrf", split: str = "heldout") -> go.Figure:
    """Histogram of per-example ``metric`` differences (adapter - base) with the mean and its interval.

    One label states the mean and the interval ("mean +96.89 (95 % interval +96.16 to +97.54)"), on the
    side of the line that has room."""
    a = _adapter(result, adapter)
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is not known; choose one of {list(METRICS)}.")
    df = result.per_example[result.per_example["split"] == split]
    diffs = df[f"delta_{metric}:{a}"] * SCALE[metric]
    comp = result.summary["comparisons"][a][split][metric]
    mean, lo, hi = (comp[k] * SCALE[metric] for k in ("diff", "lo", "hi"))
    conf = round(100 * comp.get("confidence", result.summary["statistics"]["confidence"]))
    fig = go.Figure(go.Histogram(x=diffs, name=f"{a} - base", nbinsx=40, marker_color=_color(1)))
    fig.add_vrect(x0=lo, x1=hi, fillcolor="orange", opacity=0.3, line_width=0)
    fig.add_vline(x=mean, line_color="darkorange", line_width=2)
    fig.add_vline(x=0, line_dash="dot", line_color="gray")
    left, right = min(float(diffs.min()), 0.0, lo), max(float(diffs.max()), 0.0, hi)
    pad = 0.05 * max(right - left, 1e-9)
    x_range = [left - pad, right + pad]
    text = f"mean {mean:+.2f} ({conf} % interval {lo:+.2f} to {hi:+.2f})"
    W, _ = plot_size(legend=False)
    at = float(to_px([mean], x_range, W)[0])
    room_right = W - at >= text_size(text)[0] + 8
    fig.add_annotation(x=mean, y=1, yref="paper", text=text, showarrow=False, yanchor="top",
                       xanchor="left" if room_right else "right", xshift=6 if room_right else -6,
                       font_color="darkorange", bgcolor="rgba(255,255,255,0.8)")
    spec = METRICS[metric]
    label, unit, lower = spec.label, spec.unit, spec.lower_is_better
    better = "left" if lower else "right"
    fig.update_layout(title=f"{split}: per-example change in {label} ({a} - base; {better} is better)",
                      xaxis=dict(title=f"{label} difference ({unit}; 0 = no change)", range=x_range),
                      yaxis_title="examples", bargap=0.05)
    return style(fig, legend=False)


def control_changes(result, adapter: str | None = None) -> go.Figure:
    """Per control task and adapter: exact-match change in points (with interval) and outputs changed.

    Every adapter of the result is drawn (or only ``adapter``), one colour each, beside each other:
    the top panel the change in exact match (hatched = a clear regression: the whole interval below
    0), the bottom panel the share of answers that changed, labelled "changed/n"."""
    if not result.adapters:
        _adapter(result, None)
    names = [_adapter(result, adapter)] if adapter is not None else result.adapters
    per = {a: result.summary["control_tasks"].get(a) for a in names}
    if not all(per.values()):
        raise ValueError("this result has no control set; pass control= to evaluate.")
    tasks = list(dict.fromkeys(t for a in names for t in per[a]))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.6, 0.4])
    for a in names:
        i = result.adapters.index(a) + 1
        d = [per[a][t]["exact_match_diff"] if t in per[a] else None for t in tasks]
        fig.add_trace(go.Bar(
            x=tasks, y=[100 * x["diff"] if x else None for x in d], name=a, legendgroup=a, marker_color=_color(i),
            marker_pattern_shape=["/" if x and x["hi"] < 0 else "" for x in d],
            error_y=dict(type="data", symmetric=False, array=[100 * (x["hi"] - x["diff"]) if x else 0 for x in d],
                         arrayminus=[100 * (x["diff"] - x["lo"]) if x else 0 for x in d]),
            hovertemplate=f"{a}<br>%{{x}}: %{{y:+.1f}} points<extra></extra>"), row=1, col=1)
        n = [per[a].get(t, {}).get("n", 0) for t in tasks]
        c = [per[a].get(t, {}).get("changed", 0) for t in tasks]
        fig.add_trace(go.Bar(
            x=tasks, y=[100 * ci / ni if ni else None for ci, ni in zip(c, n)], name=a, legendgroup=a,
            showlegend=False, marker_color=_color(i), text=[f"{ci}/{ni}" for ci, ni in zip(c, n)],
            textposition="outside", cliponaxis=False,
            hovertemplate=f"{a}<br>%{{x}}: %{{text}} answers changed<extra></extra>"), row=2, col=1)
    fig.add_hline(y=0, line_color="gray", row=1, col=1)
    fig.update_yaxes(title_text="exact-match change (points)", row=1, col=1)
    fig.update_yaxes(title_text="answers changed (%)", range=[0, 120], row=2, col=1)
    fig.update_xaxes(title_text="control task", row=2, col=1)
    who = names[0] if len(names) == 1 else f"{len(names)} adapters"
    fig.update_layout(barmode="group", bargap=0.25,
                      title=f"control set: what each task kept ({who} - base); hatched = clear regression")
    return style(fig, height=600)


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
