"""Planner figures from real planner outputs: traces, titles, axis units, hover text, and readability at a
notebook's width: where label positions can be computed (the figures fix their height, margins and axis
ranges), no two labels overlap and none leaves the plot."""
import numpy as np
import plotly.graph_objects as go
import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan import figures as F
from lora_kit.plan.figures import breakdown_bar, cost_time_scatter, fits_heatmap, length_histogram, memory_vs_seq_len
from lora_kit.plan.planner import compare_methods, sweep, usable

M = "llama-3.2-1b"
GPUS7 = ["T4", "L4", "A10G", "RTX-4090", "L40S", "A100-80GB", "H100-SXM"]


def label_boxes(fig, width=F.DESIGN_WIDTH):
    """(text, box) of every annotation, in px of the plotting area (y up), from the figure's own layout."""
    legend = fig.layout.showlegend is not False
    W, H = F.plot_size(width, fig.layout.height, legend=legend)
    out = []
    for a in fig.layout.annotations:
        # annotations on a log axis are placed in log10 units, like the axis range
        x = a.x * W if a.xref == "paper" else float(F.to_px([a.x], fig.layout.xaxis.range, W)[0])
        y = a.y * H if a.yref == "paper" else float(F.to_px([a.y], fig.layout.yaxis.range, H)[0])
        x, y = x + (a.xshift or 0), y + (a.yshift or 0)
        if a.showarrow:  # a leader line: the label sits at the line's tail, ax / ay px away (ay down)
            x, y = x + a.ax, y - a.ay
        w, h = F.text_size(a.text)
        x0 = {"left": x, "right": x - w}.get(a.xanchor, x - w / 2)
        y0 = {"bottom": y, "top": y - h}.get(a.yanchor, y - h / 2)
        out.append((a.text, (x0, y0, x0 + w, y0 + h), (W, H)))
    return out


def marker_boxes(fig, width=F.DESIGN_WIDTH):
    """Boxes (px) of the data markers of the figure's scatter traces."""
    W, H = F.plot_size(width, fig.layout.height)
    out = []
    for t in fig.data:
        if t.type == "scatter" and t.mode and "markers" in t.mode:
            xs = F.to_px(t.x, fig.layout.xaxis.range, W, fig.layout.xaxis.type == "log")
            ys = F.to_px(t.y, fig.layout.yaxis.range, H, fig.layout.yaxis.type == "log")
            r = (t.marker.size or 6) / 2
            out += [(x - r, y - r, x + r, y + r) for x, y in zip(xs, ys)]
    return out


def assert_readable(fig, widths=F.SHOWN_WIDTHS, markers=False):
    """At each output width: no label leaves the plot or overlaps another label (nor, with ``markers``,
    a data marker)."""
    for width in widths:
        boxes = label_boxes(fig, width)
        marks = marker_boxes(fig, width) if markers else []
        for i, (t, b, (W, H)) in enumerate(boxes):
            assert b[0] >= -1 and b[2] <= W + 1 and b[1] >= -1 and b[3] <= H + 1, \
                f"{width} px: label {t!r} leaves the plot: {b}"
            for t2, b2, _ in boxes[i + 1:]:
                assert not F.boxes_overlap(b, b2), f"{width} px: labels {t!r} and {t2!r} overlap"
            assert not any(F.boxes_overlap(b, m, pad=1) for m in marks), f"{width} px: label {t!r} hides a data marker"
    return [t for t, _, _ in boxes]


def test_place_labels_separates_crowded_points():
    anchors = [(100, 100), (104, 101), (108, 99), (300, 200), (302, 200), (650, 10)]  # the last at the right edge
    texts = ["A100-80GB", "H100-SXM", "L40S", "T4", "L4", "RTX-4090"]
    size = F.plot_size()
    shifts = F.place_labels(anchors, texts, size)
    boxes = []
    for (x, y), (dx, dy), t in zip(anchors, shifts, texts):
        w, h = F.text_size(t)
        boxes.append((x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2))
    assert not any(F.boxes_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert all(b[0] >= 0 and b[2] <= size[0] and b[1] >= 0 for b in boxes)


def test_place_labels_holds_at_every_shown_width():
    """Ten labels crowded in a corner: shifts stay fixed in px while anchors and markers stretch with the
    output's width (x scaled by W'/W), so the boxes are checked at each of the figure's shown widths."""
    anchors = [(84, 42), (24, 21), (101, 93), (81, 78), (74, 95), (102, 20), (106, 23), (93, 34), (106, 63), (50, 54)]
    texts = ["A100-80GB", "H100-SXM", "L40S", "T4", "L4", "RTX-4090", "A10G", "RTX-6000-Ada", "B200", "H200"]
    W, H = F.plot_size()
    widths = [F.plot_size(w)[0] for w in F.SHOWN_WIDTHS]
    shifts = F.place_labels(anchors, texts, (W, H), widths=widths)
    for Wp in widths:
        s = Wp / W
        boxes = [(x * s + dx - w / 2, y + dy - h / 2, x * s + dx + w / 2, y + dy + h / 2)
                 for (x, y), (dx, dy), (w, h) in zip(anchors, shifts, map(F.text_size, texts))]
        marks = [(x * s - F.MARKER_RADIUS, y - F.MARKER_RADIUS, x * s + F.MARKER_RADIUS, y + F.MARKER_RADIUS)
                 for x, y in anchors]
        assert not any(F.boxes_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), f"{Wp} px"
        assert not any(F.boxes_overlap(a, m, pad=1) for a in boxes for m in marks), f"{Wp} px"
        assert all(b[0] >= 0 and b[2] <= Wp and b[1] >= 0 and b[3] <= H for b in boxes), f"{Wp} px"


def test_breakdown_bar_stacks_parts_and_marks_gpu():
    e = estimate(M, seq_len=1024, batch_size=2)
    measured = {k: int(v * 1.02) for k, v in e.breakdown.items()}
    fig = breakdown_bar(e, measured=measured, gpu="L4")
    assert isinstance(fig, go.Figure) and fig.layout.barmode == "stack"
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == [k.replace("_", " ") for k, v in e.breakdown.items() if v]  # zero parts left out
    assert all(list(t.x) == ["estimate", "measured"] for t in bars)
    assert sum(t.y[0] for t in bars) == pytest.approx(e.peak_allocated_bytes / 2 ** 30)
    assert "GiB" in fig.layout.yaxis.title.text and "GiB" in bars[0].hovertemplate
    assert len(fig.layout.shapes) == 1 and "L4 usable" in fig.layout.annotations[0].text  # on scale: a line
    assert fig.layout.annotations[0].yref == "y" and fig.layout.annotations[0].y == pytest.approx(fig.layout.shapes[0].y0)
    assert fig.layout.yaxis.range[1] >= fig.layout.shapes[0].y0
    with pytest.raises(ValueError):
        breakdown_bar(None)


def test_breakdown_bar_keeps_a_tiny_run_visible_under_a_big_gpu():
    """The tiny model's ~14 MiB under an A100's 71 GiB usable: MiB axis scaled to the bar, the GPU as a note."""
    e = estimate("tiny", method="lora", seq_len=64, batch_size=16)
    fig = breakdown_bar(e, gpu="A100-80GB")
    bars = [t for t in fig.data if t.type == "bar"]
    total = sum(t.y[0] for t in bars)
    assert "MiB" in fig.layout.yaxis.title.text and total == pytest.approx(e.peak_allocated_bytes / 2 ** 20)
    assert total >= 0.75 * fig.layout.yaxis.range[1]  # the bar fills the plot (a note above it)
    assert not fig.layout.shapes  # no 71 GiB line squashing it
    note = fig.layout.annotations[0].text
    usable = F.fit_verdict(0, "A100-80GB")["usable_bytes"] / 2 ** 30  # 90 % of CUDA's total, not of 80 GiB
    assert "A100-80GB usable" in note and f"{usable:.1f} GiB" in note and "off this scale" in note
    assert_readable(fig)  # the note fits the plot's width, even at the narrowest
    assert fig.data[-1].text[0].endswith("MiB")


def test_memory_vs_seq_len_groups_gpus_with_the_same_capacity():
    df = sweep(M, method=["lora", "qlora"], seq_len=[256, 512, 1024, 2048], batch_size=[1, 2, 4], gpu="L4")
    fig = memory_vs_seq_len(df[df["batch_size"] == 1], gpus=["T4", "L4", "A10G", "RTX-4090", "A100-80GB"])
    assert [t.name for t in fig.data] == ["LoRA", "QLoRA"]
    lora = fig.data[0]
    assert list(lora.x) == [256, 512, 1024, 2048] and np.all(np.diff(lora.y) > 0)
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [256, 512, 1024, 2048]
    assert len(fig.layout.shapes) == 5  # one line per GPU ...
    texts = assert_readable(fig, markers=True)  # ... labels that never overlap, nor hide a point
    assert len(texts) == 3 and sum("L4" in t and "A10G" in t and "RTX-4090" in t for t in texts) == 1
    a100 = F.fit_verdict(0, "A100-80GB")["usable_bytes"] / 2 ** 30
    assert any(t.startswith("T4: ") for t in texts) and any(t.startswith(f"A100-80GB: {a100:.1f} GiB") for t in texts)
    assert "tokens" in fig.layout.xaxis.title.text and "GiB" in fig.layout.yaxis.title.text
    top = max(max(t.y) for t in fig.data)
    assert fig.layout.yaxis.type == "log"  # a 1B model's 2-4 GiB under an 80 GB GPU's line
    assert 10 ** fig.layout.yaxis.range[1] >= max(top, a100) and 10 ** fig.layout.yaxis.range[0] <= min(lora.y)


def test_fits_heatmap_cells_say_fit_and_headroom():
    df = sweep(M, method=["lora", "qlora"], seq_len=[256, 512, 1024, 2048], batch_size=[1, 2, 4], gpu="L4")
    hm = fits_heatmap(df[df["method"] == "qlora"], gpu="L4")
    z = np.asarray(hm.data[0].z)
    assert z.shape == (3, 4) and "L4" in hm.layout.title.text
    expect = df[(df["method"] == "qlora")].pivot(index="batch_size", columns="seq_len", values="headroom_gib")
    assert np.allclose(z, expect.to_numpy())
    text = np.asarray(hm.data[0].text)
    assert (np.char.startswith(text.astype(str), "✓") == (z >= 0)).all()
    assert text[0, 0] == f"✓ +{z[0, 0]:.1f}"
    assert "headroom" in hm.data[0].hovertemplate
    with pytest.raises(ValueError, match="one value"):
        fits_heatmap(df, gpu="L4")
    with pytest.raises(ValueError, match="needs a sweep"):
        fits_heatmap(df.drop(columns=["gpu"]))


def test_cost_time_scatter_shows_every_option_with_readable_labels():
    """Notebook 01's plan: LoRA and QLoRA on the same GPU land on one spot; both stay visible, each GPU
    is named once per spot, no label overlaps another or leaves the plot (A10G was clipped at the top)."""
    cmp = compare_methods("llama-3.1-8b", gpus=GPUS7, seq_len=2048, dtype="bfloat16", gradient_checkpointing=True)
    fig = cost_time_scatter(cmp)
    ok = cmp[cmp["fits"] & cmp["epoch_cost"].notna()]
    methods = {t.name: t for t in fig.data if t.name in ("full", "LoRA", "QLoRA")}
    assert sum(len(t.x) for t in methods.values()) == len(ok) > 0
    lora, qlora = methods["LoRA"], methods["QLoRA"]
    assert lora.marker.symbol != qlora.marker.symbol and lora.marker.size > qlora.marker.size
    assert list(fig.data).index(qlora) > list(fig.data).index(lora)  # the small diamond on top of the ring
    star = next(t for t in fig.data if t.name == "cheapest per epoch")
    cheapest = ok.loc[ok["epoch_cost"].idxmin()]
    assert (star.x[0], star.y[0]) == (cheapest["epoch_hours"], cheapest["epoch_cost"])
    texts = assert_readable(fig, markers=True)
    assert set(texts) == set(ok["gpu"])  # every GPU named, and once here (its LoRA and QLoRA coincide)
    assert fig.layout.yaxis.range[1] > ok["epoch_cost"].max() and fig.layout.xaxis.range[1] > ok["epoch_hours"].max()
    assert "USD" in fig.layout.yaxis.title.text and "example price" in fig.layout.yaxis.title.text
    assert "EXAMPLE" in fig.layout.title.text
    assert "(h)" in fig.layout.xaxis.title.text and "tokens/s" in lora.hovertemplate
    mine = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, dtype="bfloat16",
                           gradient_checkpointing=True, prices={"A100-80GB": 1.0})
    assert "your prices" in cost_time_scatter(mine, currency="EUR").layout.yaxis.title.text
    assert "EUR" in cost_time_scatter(mine, currency="EUR").layout.yaxis.title.text


def test_length_histogram_merges_coincident_marks():
    """All examples of one length (the embedded data): p50, p95, p99 and max share one label."""
    fig = length_histogram(np.full(200, 35), seq_len=64)
    texts = assert_readable(fig)
    assert texts == ["p50 = p95 = p99 = max: 35", "seq_len 64 (0 longer)"]
    assert fig.data[0].xbins.size == 1  # integer lengths: one bar per length, not a sliver
    assert fig.layout.xaxis.range[0] < 35 and fig.layout.xaxis.range[1] > 64


def test_length_histogram_stacks_close_labels():
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.lognormal(5, 0.5, 5000).astype(int), 3000]
    fig = length_histogram(lengths, seq_len=1024)
    texts = assert_readable(fig)
    p50, p95, p99 = np.percentile(lengths, [50, 95, 99])
    assert texts == [f"p50: {p50:.0f}", f"p95: {p95:.0f}", f"p99: {p99:.0f}", "max: 3000", "seq_len 1024 (1 longer)"]
    counts, _ = np.histogram(lengths, bins=np.arange(lengths.min() - 0.5, 3000 + fig.data[0].xbins.size + 0.5,
                                                     fig.data[0].xbins.size))
    assert fig.layout.yaxis.range[1] > counts.max()  # room for the label rows above the tallest bar
    small = length_histogram(np.array([5, 10, 10, 12, 40, 300]), seq_len=64)
    assert list(small.data[0].x) == [5, 10, 10, 12, 40, 300]
    assert "tokens" in small.layout.xaxis.title.text and "examples" in small.layout.yaxis.title.text
    assert any(t == "seq_len 64 (1 longer)" for t in assert_readable(small))
    with pytest.raises(ValueError):
        length_histogram([])


def test_cost_time_scatter_when_nothing_fits_says_so():
    cmp = compare_methods("llama-3.1-8b", gpus=["T4"], seq_len=8192, methods=("full", "lora"))
    assert not cmp["fits"].any()
    fig = cost_time_scatter(cmp)
    assert not fig.data and "No method x GPU fits" in fig.layout.annotations[0].text


def test_memory_vs_seq_len_log_axis_when_scales_differ_by_orders_of_magnitude():
    """70B full fine-tuning (~700 GiB) beside a T4's 13.5 GiB: a log memory axis, every GPU line labelled
    where it is (annotations on a log axis are placed in log10 units)."""
    df = sweep("llama-3.1-70b", method=["full", "lora", "qlora"], seq_len=[256, 1024, 4096, 16384], batch_size=1,
               gradient_checkpointing=True)
    fig = memory_vs_seq_len(df, gpus=GPUS7)
    assert fig.layout.yaxis.type == "log" and "log scale" in fig.layout.yaxis.title.text
    lo, hi = fig.layout.yaxis.range
    assert 10 ** lo < 13.5 and 10 ** hi > max(max(t.y) for t in fig.data)
    texts = assert_readable(fig, markers=True)
    assert len(texts) == 4 and all(g in " ".join(texts) for g in GPUS7)
    t4 = next(a for a in fig.layout.annotations if a.text.startswith("T4"))
    assert t4.y == pytest.approx(np.log10(13.5), abs=0.01)
    assert set(fig.layout.yaxis.tickvals) >= {20, 50, 100, 200}


def test_cost_time_scatter_crowded_labels_get_leader_lines():
    """A 1B model: 21 options crowded near the origin; labels that cannot sit next to their point are
    drawn farther out with a line to it, still clear of every label and marker."""
    cmp = compare_methods("llama-3.2-1b", gpus=GPUS7, seq_len=512, gradient_checkpointing=True)
    fig = cost_time_scatter(cmp)
    texts = assert_readable(fig, markers=True)
    assert set(texts) == set(cmp[usable(cmp)]["gpu"])  # the T4 fits but has no bf16: no time, no cost, no marker
    assert cmp[cmp["gpu"] == "T4"]["fits"].any() and "T4" not in texts
    assert any(a.showarrow for a in fig.layout.annotations)
