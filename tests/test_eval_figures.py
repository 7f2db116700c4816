"""Figures and the examples table: plotly figures inspected through fig.data / fig.layout, never shown."""
import pandas as pd
import plotly.graph_objects as go
import pytest

from lora_kit.evaluation import compare as C
from lora_kit.evaluation.evaluate import EvalResult
from test_evaluate_compare import CONTROL, HELDOUT, hand_result
from test_figures import assert_readable

# a second adapter "b" that keeps the control set (a base-mix adapter) and gets one held-out example right
B_HELDOUT = ["3 March", "1999-12-31", "2000-01-01", "2010-05-06"]
B_CONTROL = ["cba", "zyx", "3", "6"]  # one count answer changed (still wrong)


def two_adapters() -> EvalResult:
    rows = [{"split": "heldout", "task": "dates", "index": i, "prompt": f"p{i}", "reference": r, "pred:base": b,
             "pred:a": a, "pred:b": bb} for i, ((r, b, a), bb) in enumerate(zip(HELDOUT, B_HELDOUT))]
    rows += [{"split": "control", "task": t, "index": i, "prompt": f"c{i}", "reference": r, "pred:base": b,
              "pred:a": a, "pred:b": bb} for i, ((t, r, b, a), bb) in enumerate(zip(CONTROL, B_CONTROL))]
    df = C.score_frame(pd.DataFrame(rows), ["base", "a", "b"])
    summary = {"adapters": {"a": "path", "b": "path"}, "statistics": {"confidence": 0.95},
               **C.summarize(df, ["a", "b"], True, n_resamples=400)}
    return EvalResult(summary=summary, per_example=df, summary_sentence=summary["summary_sentence"])


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
    # panel names are axis titles, not subplot titles that would sit under the legend row
    assert "exact match" in fig.layout.yaxis.title.text and "lower is better" in fig.layout.yaxis2.title.text
    assert not fig.layout.annotations
    with pytest.raises(ValueError, match="choose one of"):
        r.metric_bars("test")


def test_diff_histogram_one_label_with_mean_and_interval():
    """Was two annotations at one spot: "interval of the meanmean +97.30"."""
    r = hand_result()
    fig = r.diff_histogram(metric="exact_match")
    assert list(fig.data[0].x) == [100.0, 100.0, 0.0, -100.0]
    comp = r.summary["comparisons"]["a"]["heldout"]["exact_match"]
    texts = assert_readable(fig)
    assert texts == [f"mean {100 * comp['diff']:+.2f} (95 % interval {100 * comp['lo']:+.2f} "
                     f"to {100 * comp['hi']:+.2f})"]
    rect = next(s for s in fig.layout.shapes if s.type == "rect")
    assert (rect.x0, rect.x1) == pytest.approx((100 * comp["lo"], 100 * comp["hi"]))
    lo, hi = fig.layout.xaxis.range
    assert lo < -100 and hi > 100  # every difference, the interval and 0 in view
    with pytest.raises(ValueError, match="not in this result"):
        r.diff_histogram(adapter="nope")
    with pytest.raises(ValueError, match="metric"):
        r.diff_histogram(metric="bleu")


def test_control_changes_marks_regressions():
    fig = hand_result().control_changes()
    em, changed = fig.data
    assert list(em.x) == ["count", "reverse"] and em.name == "a"
    assert dict(zip(em.x, em.y)) == pytest.approx({"count": 50.0, "reverse": -50.0})
    assert list(changed.text) == ["1/2", "1/2"] and list(changed.y) == pytest.approx([50.0, 50.0])
    assert "control task" in fig.layout.xaxis2.title.text and "points" in fig.layout.yaxis.title.text


def test_control_changes_draws_every_adapter():
    """Notebook 04 says the figure shows what the base-mix adapter kept: every adapter is drawn."""
    r = two_adapters()
    fig = r.control_changes()
    assert [t.name for t in fig.data if t.showlegend is not False] == ["a", "b"]
    by = {(t.name, t.yaxis): t for t in fig.data}
    assert set(by) == {("a", "y"), ("b", "y"), ("a", "y2"), ("b", "y2")}
    tasks = r.summary["control_tasks"]
    for a in ("a", "b"):
        em = by[(a, "y")]
        for x, y in zip(em.x, em.y):
            assert y == pytest.approx(100 * tasks[a][x]["exact_match_diff"]["diff"])
        assert list(by[(a, "y2")].text) == [f"{tasks[a][x]['changed']}/{tasks[a][x]['n']}" for x in em.x]
    # b kept reverse; one count answer changed (wrong before and after): 0/2 and 1/2 changed
    assert dict(zip(by[("b", "y2")].x, by[("b", "y2")].text)) == {"reverse": "0/2", "count": "1/2"}
    hatched = {x for x, p, in zip(by[("a", "y")].x, by[("a", "y")].marker.pattern.shape) if p == "/"}
    assert hatched == {x for x in by[("a", "y")].x if tasks["a"][x]["exact_match_diff"]["hi"] < 0}
    assert "2 adapters" in fig.layout.title.text
    only_b = r.control_changes(adapter="b")
    assert {t.name for t in only_b.data} == {"b"}


def test_examples_table_worst_regressions_first():
    t = hand_result().examples_table()
    assert t["prompt"].tolist()[:2] == ["c1", "p3"]  # both lose exact match; c1 loses more chrF
    assert t["delta_exact_match:a"].is_monotonic_increasing
    changed = hand_result().examples_table(split="control", changed_only=True)
    assert changed["prompt"].tolist() == ["c1", "c3"]
