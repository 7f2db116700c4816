"""The comparison layer on hand-written outputs: every number below can be checked by eye."""
from __future__ import annotations

import pandas as pd
import pytest

from lora_kit.evaluation import compare as C
from lora_kit.evaluation.evaluate import EvalResult

HELDOUT = [  # (reference, base output, adapter output)
    ("2021-03-03", "3 March", "2021-03-03"),
    ("1999-12-31", "1999", "1999-12-31"),
    ("2000-01-01", "2000-01-01", "2000-01-01"),
    ("2010-05-06", "2010-05-06", "2010-05-07"),
]
CONTROL = [  # (task, reference, base output, adapter output)
    ("reverse", "cba", "cba", "cba"),
    ("reverse", "zyx", "zyx", "2021-01-01"),
    ("count", "3", "3", "3"),
    ("count", "5", "4", "5"),
]


def hand_result(is_heldout: bool = True, n_resamples: int = 400) -> EvalResult:
    rows = [{"split": "heldout", "task": "dates", "index": i, "prompt": f"p{i}", "reference": r,
             "pred:base": b, "pred:a": a} for i, (r, b, a) in enumerate(HELDOUT)]
    rows += [{"split": "control", "task": t, "index": i, "prompt": f"c{i}", "reference": r,
              "pred:base": b, "pred:a": a} for i, (t, r, b, a) in enumerate(CONTROL)]
    df = C.score_frame(pd.DataFrame(rows), ["base", "a"])
    summary = {"adapters": {"a": "path"}, "statistics": {"confidence": 0.95},
               **C.summarize(df, ["a"], is_heldout, n_resamples=n_resamples)}
    return EvalResult(summary=summary, per_example=df, summary_sentence=summary["summary_sentence"])


def test_scores_and_outcomes_per_example():
    df = hand_result().per_example
    h = df[df["split"] == "heldout"]
    assert h["exact_match:base"].tolist() == [0, 0, 1, 1]
    assert h["exact_match:a"].tolist() == [1, 1, 1, 0]
    assert h["outcome:a"].tolist() == ["better", "better", "same", "worse"]
    assert h["changed:a"].tolist() == [True, True, False, True]
    assert h["delta_exact_match:a"].tolist() == [1, 1, 0, -1]
    assert 0 < h["chrf:a"].iloc[3] < 100  # one wrong digit keeps partial credit


def test_summary_counts_and_sentences():
    s = hand_result().summary
    comp = s["comparisons"]["a"]["heldout"]
    assert comp["exact_match"]["diff"] == pytest.approx(0.25)
    assert (comp["better"], comp["worse"], comp["same"], comp["changed"], comp["n"]) == (2, 1, 1, 3, 4)
    assert s["metrics"]["heldout"]["base"]["exact_match"]["mean"] == 0.5
    chrf = [C.mean_text("chrf", s["metrics"]["heldout"][k]["chrf"]["mean"]) for k in ("base", "a")]
    assert s["sentences"]["a"]["heldout"] == (  # n=4: neither interval is clear of 0
        "On 4 held-out examples: no clear difference in exact match or chrF. Exact match 50.0 % → 75.0 % "
        f"({C.diff_text('exact_match', comp['exact_match'])}); chrF {chrf[0]} → {chrf[1]} "
        f"({C.diff_text('chrf', comp['chrf'])}).")
    tasks = s["control_tasks"]["a"]
    assert tasks["reverse"]["exact_match:base"] == 1.0 and tasks["reverse"]["exact_match:a"] == 0.5
    assert tasks["count"]["exact_match_diff"]["diff"] == pytest.approx(0.5)
    assert tasks["reverse"]["changed"] == 1
    assert "Largest drop: task 'reverse', \u221250.0 points" in s["control_sentence"]
    assert s["control_changed_fraction"] == 0.5
    assert s["top_changes"]["a"][0]["prompt"] == "c1"  # the regression comes first


def test_sentence_weighs_every_metric_measured():
    """Exact match flat while chrF rises and the reference loss falls (a user's run: answers closer to the
    references, none exact): the sentence says so for each metric instead of "no clear difference" alone."""
    refs = ["The capital of France is Paris.", "The capital of Spain is Madrid.", "The capital of Peru is Lima."]
    rows = [{"split": "heldout", "task": "t", "index": i, "prompt": f"p{i}", "reference": r, "pred:base": "",
             "pred:a": "The capital of", "ref_loss:base": 6.4 - i / 100, "ref_loss:a": 5.6 - i / 50}
            for i, r in enumerate(refs)]
    df = C.score_frame(pd.DataFrame(rows), ["base", "a"])
    s = C.summarize(df, ["a"], n_resamples=200)
    comp, said = s["comparisons"]["a"]["heldout"], s["summary_sentence"]
    assert comp["exact_match"]["diff"] == 0 and comp["chrf"]["lo"] > 0 and comp["ref_loss"]["hi"] < 0
    assert said.startswith("On 3 held-out examples: the adapter is better in chrF and reference loss; exact match "
                           "unchanged (no example's score moved).")
    assert f"reference loss 6.39 → 5.58 nats/token ({C.diff_text('ref_loss', comp['ref_loss'], unit=False)})" in said
    assert f"chrF 0.0 → {C.mean_text('chrf', s['metrics']['heldout']['a']['chrf']['mean'])}" in said
    assert [C.verdict(m, comp[m]) for m in C.METRICS] == ["unchanged", "better", "better"]
    worse = C.summarize(df.assign(**{"ref_loss:a": df["ref_loss:base"] + 1}).pipe(C.score_frame, ["base", "a"]),
                        ["a"], n_resamples=200)["summary_sentence"]
    assert "better in chrF; worse in reference loss; exact match unchanged" in worse


def test_overlapping_split_is_named_in_the_sentence():
    assert "not a held-out result" in hand_result(is_heldout=False).summary_sentence


def test_base_only_summary():
    df = C.score_frame(pd.DataFrame([{"split": "heldout", "task": "t", "index": 0, "prompt": "p",
                                      "reference": "x", "pred:base": "x"}]), ["base"])
    s = C.summarize(df, [], n_resamples=100)
    assert s["summary_sentence"].startswith("Base model only") and s["comparisons"] == {}


def test_settings_kwargs_match_evaluate_signature(tmp_path):
    import inspect
    from lora_kit.data import load_examples
    from lora_kit.evaluation.evaluate import evaluate, settings_kwargs
    from lora_kit.settings import Settings
    kw = settings_kwargs(Settings(eval_examples=50, run_dir=str(tmp_path / "x")))
    assert set(kw) <= set(inspect.signature(evaluate).parameters)
    assert kw["heldout"] == load_examples("tiny:dates", split="test") and kw["n_heldout"] == 50
    assert kw["control"] == load_examples("tiny:control") and kw["source_names"]["control"] == "tiny:control"
    # your own data with no held-out file: a seeded split, and the overlap check sees only the training part
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(40)]
    (tmp_path / "my.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    s = Settings(model=str(tmp_path / "m"), dataset=str(tmp_path / "my.jsonl"), prompt_field="q", response_field="a",
                 heldout_fraction=0.25, seed=3, run_dir=str(tmp_path / "y"))
    own = settings_kwargs(s)
    assert len(own["heldout"]) == 10 and len(own["train_examples"]) == 30
    assert not {r["prompt"] for r in own["heldout"]} & {r["prompt"] for r in own["train_examples"]}
    assert own["heldout"] == settings_kwargs(s)["heldout"] != settings_kwargs(s.replace(seed=4))["heldout"]
    assert own["source_names"]["control"] == "generic:control" and len(own["control"]) >= 150


def test_subsets_take_every_task_in_turn():
    from lora_kit.evaluation.evaluate import _rows
    rows = [{"prompt": f"{t}{i}", "response": "x", "task": t} for t in "abc" for i in range(4)]  # grouped by task
    assert [r["prompt"] for r in _rows(rows, n=5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert len(_rows(rows, n=0)) == 12 and [r["prompt"] for r in _rows(rows[:4], n=2)] == ["a0", "a1"]


