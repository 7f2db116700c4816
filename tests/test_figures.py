"""Planner figures: right traces, titles, axis units and hover text, from real planner outputs."""
import numpy as np
import plotly.graph_objects as go
import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan.figures import breakdown_bar, cost_time_scatter, fits_heatmap, length_histogram, memory_vs_seq_len
from lora_kit.plan.planner import compare_methods, sweep

M = "llama-3.2-1b"


def test_breakdown_bar_stacks_parts_and_marks_gpu():
    e = estimate(M, seq_len=1024, batch_size=2)
    measured = {k: int(v * 1.02) for k, v in e.breakdown.items()}
    fig = breakdown_bar(e, measured=measured, gpu="L4")
    assert isinstance(fig, go.Figure) and fig.layout.barmode == "stack"
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == [k.replace("_", " ") for k in e.breakdown]
    assert all(list(t.x) == ["estimate", "measured"] for t in bars)
    assert sum(t.y[0] for t in bars) == pytest.approx(e.peak_allocated_bytes / 2 ** 30)
    assert "GiB" in fig.layout.yaxis.title.text and "GiB" in bars[0].hovertemplate
    assert "L4" in fig.layout.annotations[0].text
    with pytest.raises(ValueError):
        breakdown_bar(None)


def test_memory_vs_seq_len_and_heatmap():
    df = sweep(M, method=["lora", "qlora"], seq_len=[256, 512, 1024, 2048], batch_size=[1, 2, 4], gpu="L4")
    fig = memory_vs_seq_len(df[df["batch_size"] == 1], gpus=["L4", "A100-80GB"])
    assert sorted(t.name for t in fig.data) == ["lora", "qlora"]
    lora = next(t for t in fig.data if t.name == "lora")
    assert list(lora.x) == [256, 512, 1024, 2048] and np.all(np.diff(lora.y) > 0)
    assert len(fig.layout.shapes) == 2 and "tokens" in fig.layout.xaxis.title.text
    assert "GiB" in fig.layout.yaxis.title.text
    hm = fits_heatmap(df[df["method"] == "qlora"], gpu="L4")
    z = np.asarray(hm.data[0].z)
    assert z.shape == (3, 4) and "L4" in hm.layout.title.text
    expect = df[(df["method"] == "qlora")].pivot(index="batch_size", columns="seq_len", values="headroom_gib")
    assert np.allclose(z, expect.to_numpy())
    assert ((np.asarray(hm.data[0].text) == "fits") == (z >= 0)).all()
    assert "headroom" in hm.data[0].hovertemplate
    with pytest.raises(ValueError, match="one value"):
        fits_heatmap(df, gpu="L4")
    with pytest.raises(ValueError, match="needs a sweep"):
        fits_heatmap(df.drop(columns=["gpu"]))


def test_cost_time_scatter_labels_example_prices():
    cmp = compare_methods("llama-3.1-8b", gpus=["L4", "A100-80GB"], seq_len=1024, dtype="bfloat16",
                          gradient_checkpointing=True)
    fig = cost_time_scatter(cmp)
    shown = sum(len(t.x) for t in fig.data)
    assert shown == int((cmp["fits"] & cmp["epoch_cost"].notna()).sum()) > 0
    assert "example price" in fig.layout.yaxis.title.text and "EXAMPLE" in fig.layout.title.text
    assert "(h)" in fig.layout.xaxis.title.text and "tokens/s" in fig.data[0].hovertemplate
    mine = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, dtype="bfloat16",
                           gradient_checkpointing=True, prices={"A100-80GB": 1.0})
    assert "your prices" in cost_time_scatter(mine).layout.yaxis.title.text


def test_length_histogram_marks_seq_len():
    lengths = np.array([5, 10, 10, 12, 40, 300])
    fig = length_histogram(lengths, seq_len=64)
    assert list(fig.data[0].x) == list(lengths)
    texts = [a.text for a in fig.layout.annotations]
    assert any("seq_len 64 (1 longer)" in t for t in texts) and any("max 300" in t for t in texts)
    assert "tokens" in fig.layout.xaxis.title.text and "examples" in fig.layout.yaxis.title.text
    with pytest.raises(ValueError):
        length_histogram([])
