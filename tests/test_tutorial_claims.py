"""The notebooks assert the tutorial's claims about its adapter only on runs of the tutorial's settings; any other
run (a shorter one, another learning rate, the user's own model or data) gets the reason, and its figures are
reported without an assertion that could fail a correct run."""
from lora_kit.settings import Settings
from lora_kit.ui.notebook import tutorial_claims


def test_claims_apply_to_the_tutorial_and_longer_runs_of_it():
    assert tutorial_claims(Settings()) is None
    assert tutorial_claims(Settings(max_steps=600, method="qlora", eval_examples=0)) is None  # 0 = every example


def test_any_other_run_gets_the_reason():
    short = tutorial_claims(Settings(max_steps=5, eval_examples=5))
    assert "max_steps=5 (the tutorial's: 300)" in short and "eval_examples=5 (the tutorial's: 200)" in short
    assert "learning_rate=0.01" in tutorial_claims(Settings(learning_rate=1e-2))
    assert "embedded model on its dates task" in tutorial_claims(Settings(dataset="my.csv"))
    assert "with a LoRA method" in tutorial_claims(Settings(method="full"))
