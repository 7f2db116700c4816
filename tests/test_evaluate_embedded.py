"""evaluate() on the embedded default: a briefly trained LoRA on tiny:dates vs the base, with the
control set (8 base tasks the fine-tune was not about). Real model, real data, CPU only."""
from __future__ import annotations

import pytest

from lora_kit.loading import EMBEDDED_DIR
from test_evaluate import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(),
                                 reason="embedded model not built (python scripts/build_tiny_model.py)")]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    from lora_kit.data import load_examples
    from lora_kit.loading import load_model, load_tokenizer
    from lora_kit.embedded.story import train_adapter
    from lora_kit.training import attach_adapter
    out = tmp_path_factory.mktemp("embedded_adapter")
    model = attach_adapter(load_model("tiny"), "lora", seed=0)
    train_adapter(model, load_tokenizer("tiny"), load_examples("tiny:dates", split="train"),
                  steps=60, batch_size=16, lr=1e-2, seed=0, warmup=5)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def test_embedded_default_gain_and_control(adapter_dir, tmp_path):
    from lora_kit.evaluation.evaluate import evaluate
    r = evaluate("tiny", adapter_dir, run_dir=tmp_path, n_heldout=32, n_control=32, max_new_tokens=12,
                 n_resamples=500, progress=False)
    s = r.summary
    assert s["heldout"]["is_heldout"] and s["heldout"]["hygiene"]["checked"]  # tiny:dates train vs test
    comp = s["comparisons"]["adapter"]["heldout"]
    assert comp["chrf"]["lo"] > 20 and comp["ref_loss"]["hi"] < 0  # a real gain, interval excludes 0
    assert s["metrics"]["control"]["base"]["exact_match"]["mean"] > 0.8  # the base knows its own tasks
    assert len(s["control_tasks"]["adapter"]) == 8 and s["control"]["summary_sentence"].startswith("Control set:")
    assert (tmp_path / "eval" / "eval.json").is_file() and (tmp_path / "eval" / "per_example.csv").is_file()
