"""Notebook 04 asserts the tutorial's claims about its adapter only on runs of the tutorial's settings; any other
run (a shorter one, another learning rate, the user's own model or data) gets the reason, and its figures are
reported without an assertion that could fail a correct run."""
from lora_kit.settings import Settings
from lora_kit.ui.notebook import tutorial_claims


def test_claims_apply_to_the_tutorial_and_longer_runs_of_it():
    assert tutorial_claims(Settings()) is None
    assert tutorial_claims(Settings(max_steps=600, method="qlora", eval_examples=0)) is None  # 0 = every example
    assert tutorial_claims(Settings(method="qlora", double_quant=True, gpu="L4", run_dir="elsewhere")) is None


def test_any_other_run_gets_the_reason():
    short = tutorial_claims(Settings(max_steps=5, eval_examples=5))
    assert "max_steps=5 (the tutorial's: 300)" in short and "eval_examples=5 (the tutorial's: 200)" in short
    assert "learning_rate=0.01" in tutorial_claims(Settings(learning_rate=1e-2))
    for changed in (dict(max_new_tokens=8), dict(base_mix=0.5), dict(control_examples=5), dict(lora_rank=2)):
        assert f"{next(iter(changed))}=" in tutorial_claims(Settings(**changed)), changed
    assert "embedded model on its dates task" in tutorial_claims(Settings(dataset="my.csv"))
    assert "with a LoRA method" in tutorial_claims(Settings(method="full"))
