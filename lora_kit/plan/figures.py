"""Planner figures: plotly ``go.Figure`` builders (never ``.show()``; the caller displays or saves).

- :func:`breakdown_bar` -- stacked memory breakdown: estimate, and simulated / measured beside it;
- :func:`memory_vs_seq_len` -- device memory vs sequence length per method, GPU capacity lines;
- :func:`fits_heatmap` -- seq_len x micro-batch for one GPU, coloured by headroom;
- :func:`cost_time_scatter` -- time vs cost per epoch of method x GPU (from ``compare_methods``);
- :func:`length_histogram` -- token lengths of a dataset with the chosen max length marked.

Memory axes are GiB (2**30 bytes), times hours or seconds, costs in the user's currency per the
prices given; the catalog's example prices are labelled "example price" wherever they are used.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import fit_verdict

GIB = 2 ** 30
PART_COLORS = {"weights": "#4C78A8", "quant_constants": "#72B7B2", "adapters": "#54A24B", "gradients": "#F58518",
               "optimizer_states": "#E45756", "activations": "#B279A2"}
METHOD_COLORS = {"full": "#E45756", "lora": "#4C78A8", "qlora": "#54A24B"}


def _breakdown(x) -> dict:
    if x is None:
        return {}
    b = x.breakdown if hasattr(x, "breakdown") else x
    if not isinstance(b, dict):
        raise ValueError(f"expected an estimate/simulate/measure result or a breakdown dict, got {type(x).__name__}.")
    return b


def breakdown_bar(estimate, simulated=None, measured=None, gpu: str | None = None, margin: float = 0.10,
                  title: str | None = None) -> go.Figure:
    """Stacked bar of the memory breakdown (GiB); one bar per given result; optional GPU usable line."""
    bars = [(n, _breakdown(r)) for n, r in (("estimate", estimate), ("simulated", simulated),
                                            ("measured", measured)) if r is not None]
    if not bars:
        raise ValueError("breakdown_bar needs at least the estimate.")
    parts = list(dict.fromkeys(k for _, b in bars for k in b))
    fig = go.Figure()
    for part in parts:
        ys = [b.get(part, 0) / GIB for _, b in bars]
        fig.add_bar(name=part.replace("_", " "), x=[n for n, _ in bars], y=ys,
                    marker_color=PART_COLORS.get(part),
                    hovertemplate=f"{part.replace('_', ' ')}: %{{y:.3f}} GiB<extra>%{{x}}</extra>")
    totals = [sum(b.values()) / GIB for _, b in bars]
    fig.add_scatter(x=[n for n, _ in bars], y=totals, mode="text", text=[f"{t:.2f} GiB" for t in totals],
                    textposition="top center", showlegend=False, hoverinfo="skip")
    if gpu is not None:
        v = fit_verdict(0, gpu, margin)
        fig.add_hline(y=v["usable_bytes"] / GIB, line_dash="dash", line_color="black",
                      annotation_text=f"{v['gpu']} usable ({margin:.0%} margin): {v['usable_bytes'] / GIB:.1f} GiB")
    fig.update_layout(barmode="stack", title=title or "Peak memory per GPU, by part",
                      yaxis_title="memory at the peak (GiB)", xaxis_title="source", legend_title="part")
    return fig


def memory_vs_seq_len(sweep_df: pd.DataFrame, gpus=None, margin: float = 0.10, title: str | None = None,
                      y: str = "device_total_gib") -> go.Figure:
    """Lines of ``y`` (GiB) vs ``seq_len``, one per method (and per other varying setting), GPU lines."""
    need = {"seq_len", "method", y}
    if not need <= set(sweep_df.columns):
        raise ValueError(f"memory_vs_seq_len needs a sweep DataFrame with columns {sorted(need)}.")
    df = sweep_df.drop_duplicates([c for c in sweep_df.columns if c not in ("gpu", "capacity_gib", "usable_gib",
                                   "fits", "headroom_gib", "headroom_pct")])
    varying = [c for c in ("batch_size", "gradient_checkpointing", "lora_rank", "optimizer", "model")
               if c in df.columns and df[c].astype(str).nunique() > 1]
    fig = go.Figure()
    for key, g in df.groupby(["method", *varying], sort=False):
        key = key if isinstance(key, tuple) else (key,)
        label = " · ".join([str(key[0])] + [f"{c}={v}" for c, v in zip(varying, key[1:])])
        g = g.sort_values("seq_len")
        fig.add_scatter(x=g["seq_len"], y=g[y], mode="lines+markers", name=label,
                        line_color=METHOD_COLORS.get(key[0]) if not varying else None,
                        hovertemplate=f"{label}<br>seq_len %{{x}}<br>%{{y:.2f}} GiB<extra></extra>")
    for gname in ([gpus] if isinstance(gpus, str) else list(gpus or [])):
        v = fit_verdict(0, gname, margin)
        fig.add_hline(y=v["usable_bytes"] / GIB, line_dash="dot", line_color="gray",
                      annotation_text=f"{v['gpu']} ({v['usable_bytes'] / GIB:.0f} GiB usable)",
                      annotation_position="top left")
    fig.update_layout(title=title or f"Memory per GPU vs sequence length ({margin:.0%} safety margin on GPU lines)",
                      xaxis_title="sequence length (tokens)", yaxis_title="device memory per GPU (GiB)",
                      legend_title="method")
    return fig


def fits_heatmap(sweep_df: pd.DataFrame, gpu: str | None = None, title: str | None = None) -> go.Figure:
    """seq_len x micro-batch grid for one GPU, coloured by headroom (GiB; red = does not fit)."""
    need = {"seq_len", "batch_size", "headroom_gib", "device_total_gib", "gpu"}
    if not need <= set(sweep_df.columns):
        raise ValueError(f"fits_heatmap needs a sweep with a gpu (columns {sorted(need)}); pass gpu= to sweep().")
    df = sweep_df
    if gpu is not None:
        df = df[df["gpu"] == get_gpu(gpu)["name"]]
    if df["gpu"].nunique() != 1:
        raise ValueError(f"fits_heatmap shows one GPU; the sweep has {sorted(df['gpu'].unique())}: pass gpu=.")
    if df.duplicated(["seq_len", "batch_size"]).any():
        raise ValueError("fits_heatmap: several rows per (seq_len, batch_size); sweep one value of the other settings.")
    gname = df["gpu"].iloc[0]
    head = df.pivot(index="batch_size", columns="seq_len", values="headroom_gib").sort_index()
    total = df.pivot(index="batch_size", columns="seq_len", values="device_total_gib").reindex_like(head)
    lim = float(np.nanmax(np.abs(head.to_numpy()))) or 1.0
    text = np.where(head.to_numpy() >= 0, "fits", "✗")
    fig = go.Figure(go.Heatmap(
        z=head.to_numpy(), x=[str(c) for c in head.columns], y=[str(i) for i in head.index], text=text,
        texttemplate="%{text}", customdata=total.to_numpy(), zmid=0, zmin=-lim, zmax=lim, colorscale="RdYlGn",
        colorbar_title="headroom (GiB)",
        hovertemplate="seq_len %{x} · micro-batch %{y}<br>%{customdata:.2f} GiB per GPU<br>"
                      "headroom %{z:+.2f} GiB<extra></extra>"))
    fig.update_layout(title=title or f"Which seq_len x micro-batch fits on {gname}",
                      xaxis_title="sequence length (tokens)", yaxis_title="micro-batch per GPU",
                      xaxis_type="category", yaxis_type="category")
    return fig


def cost_time_scatter(compare_df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Time per epoch (h) vs cost per epoch, one marker per fitting method x GPU (from compare_methods)."""
    need = {"method", "gpu", "fits", "epoch_hours", "epoch_cost", "price_source"}
    if not need <= set(compare_df.columns):
        raise ValueError(f"cost_time_scatter needs a compare_methods table (columns {sorted(need)}).")
    df = compare_df[compare_df["fits"] & compare_df["epoch_cost"].notna()]
    example = bool((df["price_source"] == "example").any())
    fig = go.Figure()
    for method, g in df.groupby("method", sort=False):
        fig.add_scatter(
            x=g["epoch_hours"], y=g["epoch_cost"], mode="markers+text", name=method, text=g["gpu"],
            textposition="top center", marker=dict(size=12, color=METHOD_COLORS.get(method)),
            customdata=np.stack([g["batch_size"], g["tokens_per_second"], g["price_per_hour"],
                                 g["price_source"]], axis=-1),
            hovertemplate=(f"{method} on %{{text}}<br>%{{x:.2f}} h per epoch<br>cost %{{y:.2f}} per epoch<br>"
                           "micro-batch %{customdata[0]} · %{customdata[1]:.0f} tokens/s<br>"
                           "price %{customdata[2]:.2f}/h (%{customdata[3]})<extra></extra>"))
    ylabel = "cost per epoch (example price, USD)" if example else "cost per epoch (your prices)"
    fig.update_layout(title=title or ("Time vs cost per epoch, method x GPU"
                                      + (" — EXAMPLE prices, not quotes" if example else "")),
                      xaxis_title="time per epoch (h)", yaxis_title=ylabel, legend_title="method")
    return fig


def length_histogram(lengths, seq_len: int | None = None, title: str | None = None, nbins: int = 50) -> go.Figure:
    """Histogram of token lengths (a DatasetLengths or an array) with seq_len and p95/p99/max marked."""
    stats = lengths if hasattr(lengths, "lengths") else None
    arr = np.asarray(stats.lengths if stats is not None else lengths)
    if arr.size == 0:
        raise ValueError("length_histogram: no lengths given.")
    seq_len = seq_len if seq_len is not None else getattr(stats, "seq_len", None)
    fig = go.Figure(go.Histogram(x=arr, nbinsx=nbins, name="examples", marker_color="#4C78A8",
                                 hovertemplate="%{x} tokens: %{y} examples<extra></extra>"))
    p95, p99 = np.percentile(arr, [95, 99])
    for x, label, dash in ((p95, f"p95 {p95:.0f}", "dot"), (p99, f"p99 {p99:.0f}", "dot"),
                           (arr.max(), f"max {arr.max()}", "dash")):
        fig.add_vline(x=float(x), line_dash=dash, line_color="gray", annotation_text=label,
                      annotation_position="top")
    if seq_len is not None:
        over = int((arr > seq_len).sum())
        fig.add_vline(x=seq_len, line_color="#E45756", line_width=3,
                      annotation_text=f"seq_len {seq_len} ({over} longer)", annotation_position="top left")
    fig.update_layout(title=title or f"Token length per example ({arr.size} examples)",
                      xaxis_title="tokens per example (prompt + response + EOS)", yaxis_title="examples",
                      bargap=0.05, showlegend=False)
    return fig
