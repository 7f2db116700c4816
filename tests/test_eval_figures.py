"""Figures and the examples table: plotly figures inspected through fig.data, never shown."""
import plotly.graph_objects as go
import pytest

from test_evaluate_compare import hand_result


def test_metric_bars_have_intervals_per_system():
    r = hand_result()
    fig = r.metric_bars("heldout")
    assert isinstance(fig, go.Figure)
    bars = [t for t in fig.data if t.showlegend]
    assert [t.name for t in bars] == ["base", "a"]
    base = r.summary["metrics"]["heldout"]["base"]["exact_match"]
    em = bars[0]
    assert em.y[0] == pytest.approx(100 * base["mean"])
    assert em.error_y.arrayminus[0] == pytest.approx(100 * (base["mean"] - base["lo"]))
    with pytest.raises(ValueError, match="choose one of"):
        r.metric_bars("test")


def test_diff_histogram_uses_per_example_differences():
    r = hand_result()
    fig = r.diff_histogram(metric="exact_match")
    assert list(fig.data[0].x) == [100.0, 100.0, 0.0, -100.0]
    with pytest.raises(ValueError, match="not in this result"):
        r.diff_histogram(adapter="nope")
    with pytest.raises(ValueError, match="metric"):
        r.diff_histogram(metric="bleu")


def test_control_changes_marks_regressions():
    fig = hand_result().control_changes()
    bar = fig.data[0]
    assert list(bar.x) == ["count", "reverse"]
    assert list(bar.y) == pytest.approx([50.0, -50.0])
    assert list(bar.text) == ["1/2 changed", "1/2 changed"]


def test_examples_table_worst_regressions_first():
    t = hand_result().examples_table()
    assert t["prompt"].tolist()[:2] == ["c1", "p3"]  # both lose exact match; c1 loses more chrF
    assert t["delta_exact_match:a"].is_monotonic_increasing
    changed = hand_result().examples_table(split="control", changed_only=True)
    assert changed["prompt"].tolist() == ["c1", "c3"]
