"""The run card's "The loop you run next" from a plan.json as notebook 01 writes it under ``lora-kit run``: the
plan's ``batch_size`` is a sentence (each row has its own micro-batch), and every method's line uses the micro-batch
of its row on the planned GPU."""
from __future__ import annotations

from lora_kit.memory.estimate import estimate
from lora_kit.plan.config_import import plan_start
from lora_kit.plan.planner import compare_methods
from lora_kit.plan.records import PLAN_BATCH, plan_record
from lora_kit.results import write_json_atomic
from lora_kit.settings import LOOPS, Settings
from lora_kit.ui.run_card import _gib, build_report


def test_the_loop_section_uses_each_rows_micro_batch(tmp_path):
    s = Settings(run_dir=str(tmp_path))  # the embedded tutorial's settings: it plans llama-3.1-8b on A100-80GB
    write_json_atomic(tmp_path / "settings.json", s.to_dict())
    model, step, _ = plan_start(s)  # notebook 01's cells, as lora-kit run executes them
    table = compare_methods(model=model, gpus=s.gpus, margin=s.margin, step=step)
    plan = plan_record(table, model, step=step, margin=s.margin, gpu=s.gpu, method=s.method)
    write_json_atomic(tmp_path / "plan.json", plan)
    assert plan["batch_size"] == PLAN_BATCH  # a sentence, not a number: each row has its own micro-batch
    build_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## The loop you run next" in md, md
    section = md.split("## The loop you run next")[1].split("## Settings")[0]
    rows = {r["method"]: r for r in plan["rows"] if r["gpu"] == s.gpu}
    assert {r["batch_size"] for r in rows.values()} != {1}, "the planned GPU fits more than one example for some method"
    for method, label in (("full", "full"), ("lora", "LoRA"), ("qlora", "QLoRA")):
        row = rows[method]
        peak = {loop: estimate(model, step.for_method(method), batch_size=row["batch_size"], loop=loop)
                .peak_allocated_bytes for loop in LOOPS}
        fits = "" if row["fits"] else " (does not fit that GPU)"
        line = (f"- {label} on {s.gpu}, micro-batch {row['batch_size']}{fits}: your Trainer run will peak at "
                f"**{_gib(peak['trainer'])}**, TRL's SFTTrainer at **{_gib(peak['sft'])}** (lora_kit's step: "
                f"{_gib(peak['kit'])})")
        assert line in section.splitlines(), (line, section)


def test_a_method_without_figures_says_why_instead_of_vanishing():
    from lora_kit.settings import PLANNING
    from lora_kit.ui.run_card import loop_lines, loop_view
    a = {k: v for k, v in PLANNING.to_dict().items() if k not in ("method", "batch_size")}
    plan = {"model": "llama-3.1-8b", "batch_size": PLAN_BATCH, "assumptions": a,
            "rows": [{"method": "lora", "gpu": "A100-80GB", "fits": True, "batch_size": 2},
                     {"method": "qlora", "gpu": "A100-80GB", "fits": True}]}  # a row without its micro-batch
    text = "\n".join(loop_lines(loop_view(plan, "A100-80GB")))
    assert "- LoRA on A100-80GB, micro-batch 2: your Trainer run will peak at" in text
    assert f"- QLoRA on A100-80GB, micro-batch {PLAN_BATCH}: no estimate (" in text


def test_a_model_without_kept_fits_is_simulated_once_per_loop_not_fitted(tmp_path, monkeypatch):
    """A user trial: a model of one's own has no shipped fits, and the section fitted six memory models (188 s of a
    card build). Without a kept fit each loop's figure is one simulated step: the same number, nothing fitted."""
    from transformers import Qwen2Config

    from lora_kit.memory import fits
    from lora_kit.memory.estimate import has_fit
    from lora_kit.memory.simulate import simulate
    from lora_kit.settings import PLANNING
    from lora_kit.ui.run_card import loop_view
    cache = tmp_path / "fits"
    monkeypatch.setenv("LORA_KIT_FITS", str(cache))
    monkeypatch.setattr(fits, "_MEMO", {})
    model = tmp_path / "mine"
    Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(model)
    a = {k: v for k, v in PLANNING.replace(seq_len=128).to_dict().items() if k not in ("method", "batch_size")}
    plan = {"model": str(model), "batch_size": PLAN_BATCH, "assumptions": a,
            "rows": [{"method": "lora", "gpu": "L4", "fits": True, "batch_size": 4}]}
    step = PLANNING.replace(seq_len=128, batch_size=4)
    assert not any(has_fit(str(model), step, loop=loop) for loop in LOOPS)
    (row,) = loop_view(plan, "L4")["rows"]
    assert not cache.exists() or not any(cache.rglob("*.json*"))  # nothing fitted
    for loop in LOOPS:
        assert row[f"{loop}_bytes"] == simulate(str(model), step, loop=loop).peak_allocated_bytes
