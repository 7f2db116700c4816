"""Planner panel, driven without a browser: set .value, assert the verdict, figure and settings."""
import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan.gpus import known_gpus
from lora_kit.settings import DTYPES, METHODS, OPTIMIZERS, SHARDINGS, Settings
from lora_kit.memory.specs import valid_targets
from lora_kit.ui.widgets import PARTS, PlannerPanel

GIB = 2 ** 30


@pytest.fixture(scope="module")
def panel():
    return PlannerPanel(Settings(plan_model="llama-3.2-1b", dtype="bfloat16", seq_len=512, batch_size=1, gpu="L4"))


def _bars_total(p):
    return sum(t.y[0] for t in p.figure.data[:len(PARTS)])


def test_options_come_from_settings_and_catalogs(panel):
    assert tuple(panel.method.options) == METHODS and tuple(panel.optimizer.options) == OPTIMIZERS
    assert tuple(panel.sharding.options) == SHARDINGS and tuple(panel.dtype.options) == DTYPES
    assert list(panel.gpu.options) == known_gpus()
    assert "llama-3.1-8b" in panel.model.options and "tiny" in panel.model.options
    assert list(panel.targets.options) == valid_targets("llama-3.2-1b")
    for c in panel.controls():  # readable labels with units, fixed description width
        assert c.description and c.style.description_width == "170px"
    assert "tokens" in panel.seq_len.description and "%" in panel.margin.description


def test_change_updates_verdict_figure_and_settings(panel):
    panel.gpu.value = "L4"
    panel.seq_len.value = 512
    assert panel.verdict.value.count("Fits on L4") == 1 and "headroom" in panel.verdict.value
    s = panel.settings()
    e = estimate(**panel.plan_kwargs())
    assert _bars_total(panel) == pytest.approx(e.peak_allocated_bytes / GIB)
    assert panel.figure.layout.shapes[0].y0 == pytest.approx(panel.last_plan["usable_bytes"] / GIB)
    panel.seq_len.value = 16384
    panel.batch_size.value = 8
    assert "Does NOT fit on L4" in panel.verdict.value and "Cheapest change" in panel.verdict.value
    assert "GiB" in panel.verdict.value and "%" in panel.verdict.value
    s = panel.settings()
    assert (s.seq_len, s.batch_size, s.gpu, s.plan_model, s.model) == (16384, 8, "L4", "llama-3.2-1b", "tiny")
    e = estimate(**panel.plan_kwargs())
    assert _bars_total(panel) == pytest.approx(e.peak_allocated_bytes / GIB)
    panel.gpu.value = "H200"
    panel.checkpointing.value = True
    assert panel.settings().gradient_checkpointing is True
    assert "Fits on H200" in panel.verdict.value or "Does NOT fit on H200" in panel.verdict.value
    panel.batch_size.value = 1
    panel.seq_len.value = 512


def test_targets_rank_method_and_margin(panel):
    panel.targets.value = ("q_proj", "v_proj")
    assert panel.settings().lora_targets == ["q_proj", "v_proj"]
    small = _bars_total(panel)
    panel.targets.value = tuple(panel.targets.options)
    assert panel.settings().lora_targets == "all-linear" and _bars_total(panel) > small
    panel.method.value = "full"
    assert panel.settings().method == "full" and panel.error is None  # rank/targets are ignored for full
    panel.method.value = "lora"
    panel.margin.value = 25
    assert panel.settings().margin == pytest.approx(0.25) and "25% margin" in panel.verdict.value
    panel.margin.value = 10


def test_lora_dropout_and_lora_controls_under_full(panel):
    """Dropout is a control of the plan; switching to full fine-tuning greys the LoRA controls out and plans
    without them, and switching back restores what the user set."""
    panel.method.value = "lora"
    before = panel.last_plan["estimate"].peak_allocated_bytes
    panel.lora_rank.value, panel.lora_dropout.value = 32, 0.1
    s = panel.settings()
    assert (s.lora_rank, s.lora_dropout) == (32, 0.1) and panel.error is None
    assert panel.last_plan["estimate"].peak_allocated_bytes == estimate(**panel.plan_kwargs()).peak_allocated_bytes
    assert panel.last_plan["estimate"].peak_allocated_bytes > before
    panel.method.value = "full"
    assert panel.error is None and panel.settings().lora_dropout == 0.0 and panel.settings().lora_rank != 32
    assert panel.lora_rank.disabled and panel.lora_dropout.disabled and panel.targets.disabled
    panel.method.value = "lora"
    assert (panel.settings().lora_rank, panel.settings().lora_dropout) == (32, 0.1) and not panel.lora_dropout.disabled
    panel.lora_rank.value, panel.lora_dropout.value = 16, 0.0


def test_inconsistent_choice_shows_what_to_change(panel):
    panel.sharding.value = "zero3"  # with 1 GPU
    assert "Cannot plan" in panel.verdict.value and "num_gpus" in panel.verdict.value
    panel.num_gpus.value = 4
    assert panel.error is None and "Cannot plan" not in panel.verdict.value
    panel.sharding.value = "none"
    panel.num_gpus.value = 1


def test_plan_model_same_means_model():
    p = PlannerPanel(Settings(model="llama-3.2-1b", plan_model="same", seq_len=256, batch_size=1))
    assert p.model.value == "llama-3.2-1b"
    p.model.value = "qwen2.5-0.5b"
    assert p.settings().model == "qwen2.5-0.5b" and p.settings().plan_model == "same"


def test_model_change_refreshes_targets(panel):
    panel.model.value = "pythia-1b"
    assert list(panel.targets.options) == valid_targets("pythia-1b")
    assert panel.settings().lora_targets == "all-linear" and panel.error is None
    panel.model.value = "llama-3.2-1b"


def test_unknown_gpu_in_settings_lists_known_ones():
    with pytest.raises(ValueError, match="Unknown GPU 'V100'.*H100-SXM"):
        PlannerPanel(Settings(gpu="V100"))


def test_bar_stacks_to_the_device_total_in_the_verdict(panel):
    """The stacked bar adds the CUDA context + reserve, so its top equals the number the verdict uses."""
    panel.seq_len.value = 4096
    est = panel.last_plan["estimate"]
    top = sum(t.y[0] for t in panel.figure.data)
    assert top == pytest.approx(est.device_total_bytes / 2**30, rel=1e-9)
    assert panel.figure.data[len(PARTS)].y[0] > 0
