"""The planner panel and the planning notebooks start from the user's training config."""
from __future__ import annotations

from pathlib import Path

from lora_kit.plan.config_import import plan_start, settings_from_config
from lora_kit.settings import Settings
from lora_kit.ui.widgets import PlannerPanel

CONFIGS = Path(__file__).parent / "configs"


def test_panel_starts_from_a_config():
    path = CONFIGS / "axolotl_qlora_llama-3.1-8b.yml"
    step, report = settings_from_config(path)
    p = PlannerPanel(from_config=str(path))
    assert p.plan_kwargs() == {"model": "llama-3.1-8b", "step": step}  # every step field, not only the controls'
    assert (p.method.value, p.seq_len.value, p.batch_size.value, p.optimizer.value) == ("qlora", 4096, 2,
                                                                                         "paged_adamw_32bit")
    assert "sample_packing" in p.config_report.value and p.error is None and p.last_plan is not None


def test_load_button_replaces_the_plan_and_bad_config_says_why(tmp_path):
    p = PlannerPanel()
    before = p.plan_kwargs()
    bad = tmp_path / "x.yaml"
    bad.write_text("foo: 1\n")
    p.load_config(str(bad))
    assert "cannot tell which tool" in p.config_report.value and p.plan_kwargs() == before
    p.config_path.value = str(CONFIGS / "llamafactory_qlora_qwen2.5-7b.yaml")
    p.load_button.click()
    step, _ = settings_from_config(CONFIGS / "llamafactory_qlora_qwen2.5-7b.yaml")
    assert p.plan_kwargs() == {"model": "qwen2.5-7b", "step": step}
    assert tuple(p.targets.value) == ("q_proj", "v_proj") and (step.attn_implementation, step.padding) == (
        "flash_attention_2", "longest")  # LLaMA-Factory's fa2 on its padded batches: the unpad path, planned
    assert "Every field that changes memory or time is planned" in p.config_report.value
    assert p.settings().model == "tiny"  # the model the later steps train is left alone


def test_plan_start_without_and_with_a_config():
    s = Settings()
    assert plan_start(s) == (s.planning_model(), s.plan_step(), None)
    model, step, report = plan_start(s, CONFIGS / "trl_lora_qwen2.5-7b.yaml")
    assert model == "qwen2.5-7b" and step.loop == "sft" and report.format == "trl"
