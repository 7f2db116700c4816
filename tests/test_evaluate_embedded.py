"""evaluate() on the embedded default: the tiny story's LoRA on tiny:dates (trained once per session by
the ``tiny_story`` fixture, tests/conftest.py) vs the base, with the control set (8 base tasks the
fine-tune was not about). Real model, real data, CPU only."""
from __future__ import annotations

import pytest

from lora_kit.evaluation.evaluate import evaluate
from lora_kit.loading import EMBEDDED_DIR

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(),
                                 reason="embedded model not built (python scripts/build_tiny_model.py)")]


def test_embedded_default_gain_and_control(tiny_story, tmp_path):
    r = evaluate("tiny", tiny_story("lora")["adapter_dir"], run_dir=tmp_path, n_heldout=32, n_control=32,
                 max_new_tokens=12, n_resamples=500, progress=False)
    s = r.summary
    assert s["heldout"]["is_heldout"] and s["heldout"]["hygiene"]["checked"]  # tiny:dates train vs test
    comp = s["comparisons"]["adapter"]["heldout"]
    assert comp["chrf"]["lo"] > 20 and comp["ref_loss"]["hi"] < 0  # a real gain, interval excludes 0
    assert s["metrics"]["control"]["base"]["exact_match"]["mean"] > 0.8  # the base knows its own tasks
    assert len(s["control_tasks"]["adapter"]) == 8 and s["control"]["summary_sentence"].startswith("Control set:")
    assert (tmp_path / "eval" / "eval.json").is_file() and (tmp_path / "eval" / "per_example.csv").is_file()
