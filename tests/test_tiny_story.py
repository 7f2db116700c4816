"""The embedded default tells a true story, measured on CPU: the base cannot do the new task, a
LoRA / QLoRA adapter learns it, and the control set shows how much the base tasks moved.

The story is trained once per session by the ``tiny_story`` fixture (tests/conftest.py): fewer
steps and examples than benchmarks/tiny_story.py (whose numbers are in MODEL_CARD.md), the same
code path, and a clear gain asserted here.
"""
from __future__ import annotations

import pytest

from lora_kit.embedded.story import round_robin_by_task, story_run

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
