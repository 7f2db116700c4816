"""The embedded default tells a true story, measured on CPU: the base cannot do the new task, a
LoRA / QLoRA adapter learns it, and the control set shows how much the base tasks moved.

The story is trained once per session by the ``tiny_story`` fixture (tests/conftest.py): fewer
steps and examples than benchmarks/tiny_story.py (whose numbers are in MODEL_CARD.md), the same
code path, and a clear gain asserted here.
"""
from __future__ import annotations

import pytest

from lora_kit.embedded.story import round_robin_by_task, story_run
from lora_kit.evaluation.evaluate import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapter_learns_new_task_and_control_shows_forgetting(method, tiny_story):
    r = tiny_story(method, 0.0)
    assert r["dates_before"] <= 0.05, "the base already knows the new task: the story is broken"
    assert r["control_before"]["exact_match"] >= 0.5, "the base lost its base tasks"
    assert r["dates_after"] >= 0.8, (r["dates_after"], r["dates_predictions_after"])
    # Without base-task examples in the data, the base tasks are forgotten: the control set shows it.
    assert r["control_after"]["exact_match"] < r["control_before"]["exact_match"]


@pytest.mark.slow
def test_mixing_base_examples_limits_forgetting(tiny_story):
    plain, mixed = tiny_story("lora", 0.0), tiny_story("lora", 0.25)
    assert mixed["dates_after"] >= 0.8, (mixed["dates_after"], mixed["dates_predictions_after"])
    # More steps than the plain run (more chance to drift) and still far less forgetting.
    assert mixed["control_after"]["exact_match"] >= 0.7, mixed["control_after"]
    assert mixed["control_after"]["exact_match"] > plain["control_after"]["exact_match"] + 0.2


def test_same_seed_same_numbers():
    a, b = (story_run("lora", steps=8, batch_size=8, test_examples=16, control_examples=16, seed=1)
            for _ in range(2))
    assert a["losses"] == b["losses"]
    assert a["control_after"] == b["control_after"] and a["dates_after"] == b["dates_after"]
    c = story_run("lora", steps=8, batch_size=8, test_examples=16, control_examples=16, seed=2)
    assert c["losses"] != a["losses"]


def test_story_run_rejects_full_fine_tuning():
    with pytest.raises(ValueError, match="choose 'lora' or 'qlora'"):
        story_run("full", steps=1)


def test_round_robin_covers_every_task_in_a_prefix():
    rows = [{"task": t, "i": i} for t in "abc" for i in range(3)]
    assert [r["task"] for r in round_robin_by_task(rows)[:6]] == list("abcabc")
    assert sorted(map(str, round_robin_by_task(rows))) == sorted(map(str, rows))


@pytest.mark.slow
def test_evaluate_on_the_story_adapter_gain_and_control(tiny_story, tmp_path):
    """evaluate() on the embedded default: the story's LoRA on tiny:dates vs the base, with the control
    set (8 base tasks the fine-tune was not about). Here, beside the story, so that one pytest worker
    trains it once (scripts/test.sh distributes whole files)."""
    r = evaluate("tiny", tiny_story("lora")["adapter_dir"], run_dir=tmp_path, n_heldout=32, n_control=32,
                 max_new_tokens=12, n_resamples=500, progress=False)
    s = r.summary
    assert s["heldout"]["is_heldout"] and s["heldout"]["hygiene"]["checked"]  # tiny:dates train vs test
    comp = s["comparisons"]["adapter"]["heldout"]
    assert comp["chrf"]["lo"] > 20 and comp["ref_loss"]["hi"] < 0  # a real gain, interval excludes 0
    assert s["metrics"]["control"]["base"]["exact_match"]["mean"] > 0.8  # the base knows its own tasks
    assert len(s["control_tasks"]["adapter"]) == 8 and s["control"]["summary_sentence"].startswith("Control set:")
    assert (tmp_path / "eval" / "eval.json").is_file() and (tmp_path / "eval" / "per_example.csv").is_file()


def test_the_story_adapter_names_its_base_by_name_not_by_a_local_path(tmp_path):
    """The adapter is meant to be shared: its config names the base "tiny" (what evaluate and the card take), not
    the folder on this machine the base was loaded from."""
    import json
    r = story_run("lora", steps=1, batch_size=2, test_examples=1, control_examples=1, lora_rank=2,
                  adapter_dir=tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "tiny", cfg["base_model_name_or_path"]
    assert str(tmp_path) not in json.dumps(cfg) and r["adapter_dir"] == str(tmp_path / "adapter")
