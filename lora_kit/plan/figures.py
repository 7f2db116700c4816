"""Planner figures: plotly ``go.Figure`` builders (never ``.show()``; the caller displays or saves).

- :func:`breakdown_bar` -- stacked memory breakdown: estimate, and simulated / measured beside it;
- :func:`memory_vs_seq_len` -- device memory vs sequence length per method, GPU capacity lines;
- :func:`fits_heatmap` -- seq_len x micro-batch for one GPU, coloured by headroom;
- :func:`cost_time_scatter` -- time vs cost per epoch of method x GPU (from ``compare_methods``);
- :func:`length_histogram` -- token lengths of a dataset with the chosen max length marked.

Memory axes are GiB (2**30 bytes; MiB when everything is under 1 GiB), times hours or seconds,
costs in USD at the catalog's example prices (labelled so) or in the user's currency for their prices.

Readable at a notebook's width: every figure has a fixed height and margins and its legend above the
plot, so label positions are computed in pixels. A label's shift is fixed in px while the data it points
at stretches with the output's width, so a spot free at one width can hide a marker at another: positions
are chosen for every width in :data:`SHOWN_WIDTHS` (760 px, the narrowest designed for; ~900 px in
JupyterLab; 1200 px). Labels that would collide are merged (GPUs with the same capacity, percentiles with
the same value) or moved (:func:`place_labels`), and the tests check the computed boxes never overlap.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import fit_verdict
from lora_kit.settings import METHOD_LABELS, method_label

GIB = 2 ** 30
MIB = 2 ** 20
PART_COLORS = {"weights": "#4C78A8", "quant_constants": "#72B7B2", "adapters": "#54A24B", "gradients": "#F58518",
               "optimizer_states": "#E45756", "activations": "#B279A2"}
METHOD_COLORS = {"full": "#E45756", "lora": "#4C78A8", "qlora": "#54A24B"}
# LoRA and QLoRA on one GPU often land on the same spot: a wide open ring with a small filled diamond
# drawn on top of it keeps both visible.
METHOD_MARKERS = {"full": dict(symbol="square", size=12), "lora": dict(symbol="circle-open", size=18, line_width=2.5),
                  "qlora": dict(symbol="diamond", size=9)}

DESIGN_WIDTH = 760  # px: the narrowest notebook output that label positions are computed for
NOTEBOOK_WIDTH = 900  # px: a typical JupyterLab output width (screenshots, the run card's PNGs)
WIDE_WIDTH = 1200  # px: a wide screen's notebook output
SHOWN_WIDTHS = (DESIGN_WIDTH, NOTEBOOK_WIDTH, WIDE_WIDTH)  # label positions must hold at each of these
HEIGHT = 480
MARGIN = {"l": 70, "r": 30, "t": 85, "b": 60}  # t: title + one legend row; 55 without a legend
TOP_NO_LEGEND = 55
FONT_PX = 12
MARKER_RADIUS = 9  # px: labels keep clear of markers by this much
STAR_SIZE = 28  # px: the star behind the cheapest option


# --- geometry: where things land on a DESIGN_WIDTH x HEIGHT figure ------------------------------------------

def plot_size(width: int = DESIGN_WIDTH, height: int = HEIGHT, legend: bool = True) -> tuple[float, float]:
    """Width and height (px) of the plotting area inside the margins of :func:`style`."""
    top = MARGIN["t"] if legend else TOP_NO_LEGEND
    return width - MARGIN["l"] - MARGIN["r"], height - top - MARGIN["b"]


def text_size(text: str, font_px: int = FONT_PX) -> tuple[float, float]:
    """Width and height (px) a label takes: a generous estimate (0.62 em per character, 1.3 em per line)."""
    lines = str(text).split("<br>")
    return max(len(s) for s in lines) * 0.62 * font_px + 6, len(lines) * 1.3 * font_px + 2


def to_px(values, axis_range, length: float, log: bool = False) -> np.ndarray:
    """Data values -> px from the axis start (plotly's log axes take their range in log10 units)."""
    v = np.asarray(values, dtype=float)
    v = np.log10(v) if log else v
    lo, hi = axis_range
    return (v - lo) / (hi - lo) * length


def boxes_overlap(a, b, pad: float = 0.0) -> bool:
    """Do boxes ``(x0, y0, x1, y1)`` overlap (by more than ``pad`` px)?"""
    return min(a[2], b[2]) - max(a[0], b[0]) > pad and min(a[3], b[3]) - max(a[1], b[1]) > pad


def _overlap_area(a, b) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def place_labels(anchors, texts, size, markers=None, gap: float = 3.0, radii=None,
                 widths=None) -> list[tuple[float, float]]:
    """Label-centre shifts (px, y up) from each anchor so that no two labels overlap, nor a marker,
    nor the plot's edges: the first free spot of above / right / below / left / the diagonals / twice
    as far, else the least-overlapping one. ``anchors`` are px in the plotting area; ``markers`` are
    ``(x, y)`` or ``(x, y, radius)`` px (default: the anchors); ``radii`` the marker radius at each anchor.

    ``widths``: the plotting-area widths (px) the figure is shown at (default: ``size``'s only). A label
    keeps its px shift while its anchor and the markers move with the axis (x scaled by W'/W, the height
    fixed), so a spot's cost is summed over every width: one free at 760 px may cover a marker at 900."""
    W, H = size
    scales = [1.0] if widths is None else [float(w) / W for w in widths]
    marks = [(m[0], m[1], m[2] if len(m) > 2 else MARKER_RADIUS) for m in (anchors if markers is None else markers)]
    marks = [[(mx * s - r, my - r, mx * s + r, my + r) for mx, my, r in marks] for s in scales]
    placed: list[list[tuple]] = [[] for _ in scales]  # per width: the boxes of the labels placed so far
    shifts = [None] * len(anchors)
    pts = np.asarray(anchors, dtype=float).reshape(-1, 2)
    crowd = [int((np.hypot(*(pts - p).T) < 60).sum()) for p in pts]
    for k in sorted(range(len(anchors)), key=lambda i: -crowd[i]):  # the most crowded first: they need the room
        (x, y), text = anchors[k], texts[k]
        w, h = text_size(text)
        r = radii[k] if radii is not None else MARKER_RADIUS
        ox, oy = w / 2 + r + gap, h / 2 + r + gap
        cands = [(0, oy), (ox, 0), (0, -oy), (-ox, 0), (ox, oy), (-ox, oy), (ox, -oy), (-ox, -oy),
                 (0, oy + h + gap), (0, -oy - h - gap), (ox, oy + h), (-ox, oy + h), (ox, -oy - h), (-ox, -oy - h)]
        # crowded: farther out, where the caller draws a leader line (:func:`is_far`)
        cands += [(np.cos(a) * (d + w / 2), np.sin(a) * (d + h / 2)) for d in (30.0, 50.0, 75.0, 100.0, 130.0)
                  for a in np.radians([90, 45, 135, 0, 180, -45, -135, -90, 67.5, 112.5, 22.5, 157.5,
                                       -22.5, -157.5, -67.5, -112.5])]
        best, best_cost = None, None
        for dx, dy in cands:
            boxes = [(x * s + dx - w / 2, y + dy - h / 2, x * s + dx + w / 2, y + dy + h / 2) for s in scales]
            cost = 0.0
            for box, s, done, ms in zip(boxes, scales, placed, marks):
                outside = (max(0, -box[0]) + max(0, box[2] - W * s)) * h + (max(0, -box[1]) + max(0, box[3] - H)) * w
                cost += (10 * sum(_overlap_area(box, b) for b in done) + sum(_overlap_area(box, m) for m in ms)
                         + 10 * outside)
            if best_cost is None or cost < best_cost:
                best, best_cost = (dx, dy, boxes), cost
            if cost == 0:
                break
        for done, box in zip(placed, best[2]):
            done.append(box)
        shifts[k] = (best[0], best[1])
    return shifts


def is_far(shift, text: str, radius: float = MARKER_RADIUS) -> bool:
    """Is a label's shift from :func:`place_labels` beyond the spots next to its point (draw a leader line)?"""
    w, h = text_size(text)
    return abs(shift[0]) > w / 2 + radius + 3.5 or abs(shift[1]) > h / 2 + radius + 3.5  # beyond the first ring


def style(fig: go.Figure, height: int = HEIGHT, legend: bool = True) -> go.Figure:
    """The common frame: fixed height and margins, title top left, legend in one row above the plot."""
    fig.update_layout(height=height, margin={**MARGIN, "t": MARGIN["t"] if legend else TOP_NO_LEGEND},
                      font_size=FONT_PX, showlegend=legend,
                      title=dict(x=0.01, xanchor="left", y=0.98, yanchor="top"),
                      legend=dict(orientation="h", x=0, xanchor="left", y=1.01, yanchor="bottom"))
    return fig


def _label(fig, x, y, text, dx=0.0, dy=0.0, xanchor="center", **kw):
    fig.add_annotation(x=x, y=y, text=text, showarrow=False, xshift=dx, yshift=dy, xanchor=xanchor,
                       yanchor="middle", bgcolor="rgba(255,255,255,0.75)", borderpad=1, **kw)


# --- figures --------------------------------------------------------------------------------------------------

def _breakdown(x) -> dict:
    if x is None:
        return {}
    b = x.breakdown if hasattr(x, "breakdown") else x
    if not isinstance(b, dict):
        raise ValueError(f"expected an estimate/simulate/measure result or a breakdown dict, got {type(x).__name__}.")
    return b


def breakdown_bar(estimate, simulated=None, measured=None, gpu: str | None = None, margin: float = 0.10,
                  title: str | None = None) -> go.Figure:
    """Stacked bar of the memory breakdown (GiB, or MiB below 1 GiB); one bar per given result.

    Parts that are zero in every bar are left out. With ``gpu``, its usable memory is a line when it
    is on the bars' scale (at most 4x the tallest bar); otherwise the scale stays on the bars and a
    note states the usable memory and the share of it used (a 40 MiB bar under a 72 GiB line would be
    invisible)."""
    bars = [(n, _breakdown(r)) for n, r in (("estimate", estimate), ("simulated", simulated),
                                            ("measured", measured)) if r is not None]
    if not bars:
        raise ValueError("breakdown_bar needs at least the estimate.")
    totals = [sum(b.values()) for _, b in bars]
    unit, div = ("GiB", GIB) if max(totals) >= GIB else ("MiB", MIB)
    parts = [p for p in dict.fromkeys(k for _, b in bars for k in b) if any(b.get(p, 0) for _, b in bars)]
    names = [n for n, _ in bars]
    fig = go.Figure()
    for part in parts:
        fig.add_bar(name=part.replace("_", " "), x=names, y=[b.get(part, 0) / div for _, b in bars],
                    marker_color=PART_COLORS.get(part),
                    hovertemplate=f"{part.replace('_', ' ')}: %{{y:.3f}} {unit}<extra>%{{x}}</extra>")
    fig.add_scatter(x=names, y=[t / div for t in totals], mode="text", text=[_amount(t) for t in totals],
                    textposition="top center", showlegend=False, hoverinfo="skip", cliponaxis=False)
    top, room = max(totals) / div, 1.2
    if gpu is not None:
        v = fit_verdict(0, gpu, margin)
        usable = v["usable_bytes"]
        what = f"{v['gpu']} usable ({margin:.0%} margin): {usable / GIB:.1f} GiB"
        if usable / div <= 4 * top:
            top = max(top, usable / div)
            fig.add_hline(y=usable / div, line_dash="dash", line_color="black", annotation_text=what,
                          annotation_position="top right", annotation_bgcolor="rgba(255,255,255,0.75)")
        else:
            fig.add_annotation(xref="paper", yref="paper", x=1, y=1, xanchor="right", yanchor="top", showarrow=False,
                               text=f"{what}<br>off this scale: the largest bar is {max(totals) / usable:.2%} of it",
                               bgcolor="rgba(255,255,255,0.75)")
            room = 1.3  # the two-line note above the bars
    fig.update_layout(barmode="stack", title=title or "Peak memory per GPU, by part",
                      yaxis=dict(title=f"memory at the peak ({unit})", range=[0, top * room]),
                      xaxis_title="source", legend_title="part")
    return style(fig)


def _amount(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def _gpu_groups(usable: dict, y_range, H: float, log: bool = False) -> list[list[str]]:
    """GPUs whose usable-memory lines sit within a label's height of each other, as groups (lowest first)."""
    order = sorted(usable, key=usable.get)
    px = dict(zip(order, to_px([usable[g] for g in order], y_range, H, log)))
    h = text_size("X")[1] + 4
    groups: list[list[str]] = []
    for g in order:
        if groups and px[g] - px[groups[-1][0]] < h:
            groups[-1].append(g)
        else:
            groups.append([g])
    return groups


def _nice_ticks(log_range) -> list[float]:
    """1-2-5 ticks inside a log10 range (plotly's default log ticks print every minor digit)."""
    lo, hi = log_range
    return [m * 10 ** e for e in range(int(np.floor(lo)), int(np.ceil(hi)) + 1) for m in (1, 2, 5)
            if lo <= np.log10(m * 10 ** e) <= hi]


def memory_vs_seq_len(sweep_df: pd.DataFrame, gpus=None, margin: float = 0.10, title: str | None = None,
                      y: str = "device_total_gib") -> go.Figure:
    """Lines of ``y`` (GiB) vs ``seq_len`` (log axis), one per method (and other varying setting), GPU lines.

    GPUs whose usable memory is about the same (L4, A10G and RTX-4090 all near 20 GiB) share one label."""
    need = {"seq_len", "method", y}
    if not need <= set(sweep_df.columns):
        raise ValueError(f"memory_vs_seq_len needs a sweep DataFrame with columns {sorted(need)}.")
    df = sweep_df.drop_duplicates([c for c in sweep_df.columns if c not in ("gpu", "capacity_gib", "cuda_capacity_gib",
                                   "usable_gib", "fits", "headroom_gib", "headroom_pct")])
    varying = [c for c in ("batch_size", "gradient_checkpointing", "lora_rank", "optimizer", "model")
               if c in df.columns and df[c].astype(str).nunique() > 1]
    fig = go.Figure()
    for key, g in df.groupby(["method", *varying], sort=False, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        label = " · ".join([method_label(key[0])] + [f"{c}={v}" for c, v in zip(varying, key[1:])])
        g = g.sort_values("seq_len")
        fig.add_scatter(x=g["seq_len"], y=g[y], mode="lines+markers", name=label,
                        line_color=METHOD_COLORS.get(str(key[0])) if not varying else None,
                        hovertemplate=f"{label}<br>seq_len %{{x}}<br>%{{y:.2f}} GiB<extra></extra>")
    usable = {}
    for gname in ([gpus] if isinstance(gpus, str) else list(gpus or [])):
        v = fit_verdict(0, gname, margin)
        usable[v["gpu"]] = v["usable_bytes"] / GIB
    seqs = np.sort(df["seq_len"].unique())
    pad = 0.04 * max(np.log10(seqs[-1] / seqs[0]), 0.5)
    values = [float(v) for v in df[y]] + list(usable.values())
    # orders of magnitude apart (a 70B model's full fine-tune over a T4's 13 GiB): a log axis keeps both readable
    ylog = min(values) > 0 and max(values) / min(values) > 20
    y_range = ([np.log10(min(values)) - 0.1, np.log10(max(values)) + 0.12] if ylog else [0, 1.12 * max(values)])
    W, H = plot_size()
    x_range = [np.log10(seqs[0]) - pad, np.log10(seqs[-1]) + pad]
    marks = [(x - MARKER_RADIUS, y - MARKER_RADIUS, x + MARKER_RADIUS, y + MARKER_RADIUS)
             for t in fig.data for x, y in zip(to_px(t.x, x_range, W, log=True), to_px(t.y, y_range, H, ylog))]
    placed = []
    order = {g: i for i, g in enumerate(usable)}
    for group in _gpu_groups(usable, y_range, H, ylog):
        group = sorted(group, key=order.get)  # as the caller listed them
        for g in group:
            fig.add_hline(y=usable[g], line_dash="dot", line_color="gray")
        vals = [usable[g] for g in group]
        amount = f"{vals[0]:.1f}" if max(vals) - min(vals) < 0.05 else f"{min(vals):.1f}–{max(vals):.1f}"
        text = f"{', '.join(group)}: {amount} GiB usable"
        w, h = text_size(text)
        mid = float(np.exp(np.mean(np.log(vals)))) if ylog else float(np.mean(vals))
        y0 = float(to_px([mid], y_range, H, ylog)[0])
        best = None
        for side, dy in ((1, h / 2 + 2), (0, h / 2 + 2), (1, -h / 2 - 2), (0, -h / 2 - 2)):  # right/left, above/below
            box = (W - w if side else 0, y0 + dy - h / 2, W if side else w, y0 + dy + h / 2)
            cost = (sum(_overlap_area(box, m) for m in marks) + 10 * sum(_overlap_area(box, b) for b in placed)
                    + 10 * w * (max(0, -box[1]) + max(0, box[3] - H)))
            if best is None or cost < best[0]:
                best = (cost, side, dy, box)
        _, side, dy, box = best
        placed.append(box)
        # an annotation on a log axis is placed in log10 units
        _label(fig, x=side, y=float(np.log10(mid)) if ylog else mid, text=text, dy=dy,
               xanchor="right" if side else "left", xref="paper", yref="y", font_color="dimgray")
    fig.update_layout(title=title or f"Memory per GPU vs sequence length ({margin:.0%} safety margin on GPU lines)",
                      xaxis=dict(title="sequence length (tokens, log scale)", type="log", tickvals=list(seqs),
                                 ticktext=[f"{s:,}" for s in seqs],
                                 range=x_range),
                      yaxis=dict(title="device memory per GPU (GiB" + (", log scale)" if ylog else ")"),
                                 type="log" if ylog else "linear", range=y_range,
                                 tickvals=_nice_ticks(y_range) if ylog else None))
    return style(fig)


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
    z = head.to_numpy()
    zmin, zmax = min(float(np.nanmin(z)), -1.0), max(float(np.nanmax(z)), 1.0)
    f = -zmin / (zmax - zmin)  # where 0 GiB falls: a sharp change of hue there, so "short by 0.5" never looks like a fit
    scale = [[0, "#a50026"], [f * 0.999, "#fdae61"], [f, "#d9ef8b"], [1, "#1a9850"]]
    text = np.where(z >= 0, np.char.add("✓ +", np.char.mod("%.1f", np.abs(z))),
                    np.char.add("✗ −", np.char.mod("%.1f", np.abs(z))))
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"{c:,}" for c in head.columns], y=[str(i) for i in head.index], text=text,
        texttemplate="%{text}", customdata=total.to_numpy(), zmin=zmin, zmax=zmax, colorscale=scale,
        colorbar_title="headroom (GiB)",
        hovertemplate="seq_len %{x} · micro-batch %{y}<br>%{customdata:.2f} GiB per GPU<br>"
                      "headroom %{z:+.2f} GiB<extra></extra>"))
    fig.update_layout(title=title or f"Which seq_len x micro-batch fits on {gname} (cell: headroom, GiB)",
                      xaxis_title="sequence length (tokens)", yaxis_title="micro-batch per GPU",
                      xaxis_type="category", yaxis_type="category")
    return style(fig, legend=False)


def _recommended(df: pd.DataFrame):
    """Index of the cheapest fitting row per epoch (the planner's recommendation), else the fastest."""
    ok = df[df["fits"].astype(bool)]
    priced = ok[ok["epoch_cost"].notna()]
    if len(priced):
        return priced["epoch_cost"].astype(float).idxmin()
    timed = ok[ok["epoch_hours"].notna()]
    return timed["epoch_hours"].astype(float).idxmin() if len(timed) else None


def cost_time_scatter(compare_df: pd.DataFrame, title: str | None = None, currency: str | None = None) -> go.Figure:
    """Time per epoch (h) vs cost per epoch, one marker per fitting method x GPU (from compare_methods) with a cost
    (a row whose GPU cannot run the step, ``runs_on_gpu`` False, has none).

    Markers differ by method in shape as well as colour (LoRA an open ring, QLoRA a diamond inside
    it), the cheapest option carries a star, and each GPU is labelled once per spot, placed where it
    overlaps no other label or marker. Costs are USD at the catalog's example prices, else
    ``currency`` (default "your currency") for prices you passed."""
    need = {"method", "gpu", "fits", "epoch_hours", "epoch_cost", "price_source"}
    if not need <= set(compare_df.columns):
        raise ValueError(f"cost_time_scatter needs a compare_methods table (columns {sorted(need)}).")
    df = compare_df[compare_df["fits"].astype(bool) & compare_df["epoch_cost"].notna()]
    if df.empty:  # a figure that says so, not an error: the notebook goes on to what would fit
        fig = go.Figure()
        fig.add_annotation(xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font_size=14,
                           text="No method x GPU fits (or none has a price): see the table's recommendation.")
        fig.update_layout(title=title or "Time vs cost per epoch, method x GPU", xaxis_visible=False,
                          yaxis_visible=False)
        return style(fig, legend=False)
    example = bool((df["price_source"] == "example").any())
    money = "USD" if example else (currency or "your currency")
    fig = go.Figure()
    best = _recommended(df)
    b = df.loc[best]
    fig.add_scatter(x=[b["epoch_hours"]], y=[b["epoch_cost"]], mode="markers", name="cheapest per epoch",
                    marker=dict(symbol="star", size=STAR_SIZE, color="#FFD54F", line=dict(color="#B8860B", width=1)),
                    hoverinfo="skip")
    for method in [m for m in METHOD_LABELS if m in set(df["method"])] + \
                  [m for m in dict.fromkeys(df["method"]) if m not in METHOD_LABELS]:
        g = df[df["method"] == method]
        name = method_label(method)
        fig.add_scatter(
            x=g["epoch_hours"], y=g["epoch_cost"], mode="markers", name=name, text=g["gpu"],
            marker=dict(color=METHOD_COLORS.get(method), **METHOD_MARKERS.get(method, dict(size=10))),
            customdata=np.stack([g["batch_size"], g["tokens_per_second"], g["price_per_hour"],
                                 g["price_source"]], axis=-1),
            hovertemplate=(f"{name} on %{{text}}<br>%{{x:.2f}} h per epoch<br>cost %{{y:.2f}} {money} per epoch<br>"
                           "micro-batch %{customdata[0]} · %{customdata[1]:.0f} tokens/s<br>"
                           f"price %{{customdata[2]:.2f}} {money}/h (%{{customdata[3]}})<extra></extra>"))
    x_range = [0, 1.12 * float(df["epoch_hours"].max())]
    y_range = [0, 1.18 * float(df["epoch_cost"].max())]
    W, H = plot_size()
    px = np.stack([to_px(df["epoch_hours"], x_range, W), to_px(df["epoch_cost"], y_range, H)], axis=-1)
    radius = np.array([(STAR_SIZE if i == best else METHOD_MARKERS.get(m, {}).get("size", 10)) / 2
                       for i, m in zip(df.index, df["method"])])  # the star is the widest
    spots = _label_spots(px, df["gpu"].tolist())
    anchors = [px[idx].mean(axis=0) for _, idx in spots]
    shifts = place_labels(anchors, [t for t, _ in spots], (W, H), markers=[(*p, r) for p, r in zip(px, radius)],
                          radii=[radius[idx].max() for _, idx in spots],
                          widths=[plot_size(w)[0] for w in SHOWN_WIDTHS])
    for (text, idx), (dx, dy), r in zip(spots, shifts, [radius[idx].max() for _, idx in spots]):
        x, y = float(df["epoch_hours"].iloc[idx].mean()), float(df["epoch_cost"].iloc[idx].mean())
        if is_far((dx, dy), text, r):  # a leader line from the point to its label (ay: px, down)
            fig.add_annotation(x=x, y=y, text=text, showarrow=True, ax=dx, ay=-dy, arrowhead=0, arrowwidth=1,
                               arrowcolor="gray", standoff=r, xanchor="center", yanchor="middle",
                               bgcolor="rgba(255,255,255,0.75)", borderpad=1)
        else:
            _label(fig, x=x, y=y, text=text, dx=dx, dy=dy)
    ylabel = f"cost per epoch ({money}{', example prices' if example else ', your prices'})"
    fig.update_layout(title=title or ("Time vs cost per epoch, method x GPU"
                                      + (" — EXAMPLE prices, not quotes" if example else "")),
                      xaxis=dict(title="time per epoch (h)", range=x_range),
                      yaxis=dict(title=ylabel, range=y_range))
    return style(fig)


def _label_spots(px: np.ndarray, names: list[str], near: float = 2 * MARKER_RADIUS) -> list[tuple[str, list[int]]]:
    """One label per GPU per spot: markers of the same GPU closer than ``near`` px share a label."""
    spots: list[tuple[str, list[int]]] = []
    for i, name in enumerate(names):
        for text, idx in spots:
            if text == name and np.hypot(*(px[idx].mean(axis=0) - px[i])) < near:
                idx.append(i)
                break
        else:
            spots.append((name, [i]))
    return spots


def _rows(xs_px, texts, W: float, gap: float = 6.0) -> list[tuple[int, float]]:
    """Stack labels centred over x positions into rows so that none overlap: (row, x shift) each,
    the shift keeping a label inside the plot's width."""
    rows: list[list[tuple[float, float]]] = []
    out = []
    for x, text in zip(xs_px, texts):
        w = text_size(text)[0]
        c = min(max(x, w / 2), W - w / 2)
        for r, taken in enumerate(rows):
            if all(c + w / 2 + gap <= a or c - w / 2 - gap >= b for a, b in taken):
                taken.append((c - w / 2, c + w / 2))
                out.append((r, c - x))
                break
        else:
            rows.append([(c - w / 2, c + w / 2)])
            out.append((len(rows) - 1, c - x))
    return out


def length_histogram(lengths, seq_len: int | None = None, title: str | None = None, nbins: int = 50) -> go.Figure:
    """Histogram of token lengths (a DatasetLengths or an array) with seq_len and p50/p95/p99/max marked.

    Markers at the same length share one label ("p95 = p99 = max: 35"); labels that would collide
    are stacked in rows above the bars."""
    stats = lengths if hasattr(lengths, "lengths") else None
    arr = np.asarray(stats.lengths if stats is not None else lengths)
    if arr.size == 0:
        raise ValueError("length_histogram: no lengths given.")
    seq_len = seq_len if seq_len is not None else getattr(stats, "seq_len", None)
    lo, hi = int(arr.min()), int(arr.max())
    width = max(1, int(np.ceil((hi - lo + 1) / nbins)))
    edges = np.arange(lo - 0.5, hi + width + 0.5, width)
    counts, _ = np.histogram(arr, bins=edges)
    fig = go.Figure(go.Histogram(x=arr, xbins=dict(start=lo - 0.5, end=hi + width - 0.5, size=width),
                                 name="examples", marker_color="#4C78A8",
                                 hovertemplate="%{x} tokens: %{y} examples<extra></extra>"))
    marks: dict[float, list[str]] = {}
    for name, x in zip(("p50", "p95", "p99", "max"), np.percentile(arr, [50, 95, 99, 100])):
        marks.setdefault(float(np.round(x)), []).append(name)
    lines = [(x, f"{' = '.join(names)}: {x:.0f}", "gray", "dot" if names[-1] != "max" else "dash", 1)
             for x, names in sorted(marks.items())]
    if seq_len is not None:
        over = int((arr > seq_len).sum())
        lines.append((float(seq_len), f"seq_len {seq_len} ({over} longer)", "#E45756", "solid", 3))
    right = max(hi, seq_len or hi)
    span = max(right - lo, 4)
    x_range = [lo - 0.5 - 0.06 * span, right + 0.5 + 0.06 * span]
    W, H = plot_size(legend=False)
    rows = _rows(to_px([x for x, *_ in lines], x_range, W), [t for _, t, *_ in lines], W)
    h = text_size("X")[1] + 3
    band = (max(r for r, _ in rows) + 1) * h + 6
    for (x, text, color, dash, lw), (row, dx) in zip(lines, rows):
        fig.add_vline(x=x, line_dash=dash, line_color=color, line_width=lw)
        _label(fig, x=x, y=1, text=text, dx=dx, dy=-(row + 0.5) * h - 3, yref="paper", font_color=color)
    fig.update_layout(title=title or f"Token length per example ({arr.size} examples)",
                      xaxis=dict(title="tokens per example (prompt + response + EOS)", range=x_range),
                      yaxis=dict(title="examples", range=[0, counts.max() * H / max(H - band, H / 3) * 1.04]),
                      bargap=0.05)
    return style(fig, legend=False)
