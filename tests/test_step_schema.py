"""One step schema: every entry point takes the same step fields, with one of two stated default
sets, and refuses bad values with the same message from the same validator."""
from __future__ import annotations

import inspect
import math

import pytest

import lora_kit as lk
from lora_kit.memory.estimate import estimate, estimate_arrays
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.plan.planner import sweep
from lora_kit.settings import (CHOICES, EMBEDDED_DEFAULTS, PLANNING_DEFAULTS, STEP_FIELDS, Settings, check_step,
                               field_help, step_kwargs)
from lora_kit.ui.cli import ESTIMATE_FIELDS, main


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("fn", [estimate, simulate, measure_config])
def test_entry_points_take_the_step_fields_with_the_planning_defaults(fn):
    params = list(inspect.signature(fn).parameters)
    assert params[:len(STEP_FIELDS) + 1] == ["model", *STEP_FIELDS]
    assert {k: _defaults(fn)[k] for k in STEP_FIELDS} == PLANNING_DEFAULTS


def test_vectorized_core_and_public_api_share_the_defaults():
    core = _defaults(estimate_arrays)
    assert {k: core[k] for k in core} == {k: PLANNING_DEFAULTS[k] for k in core}
    assert lk.estimate is estimate and lk.simulate is simulate


def test_settings_hold_every_step_field_with_the_embedded_defaults_and_help():
    s = Settings()
    assert {k: getattr(s, k) for k in STEP_FIELDS} == EMBEDDED_DEFAULTS
    helps = field_help()
    assert all(helps.get(k) for k in STEP_FIELDS)
    # the two default sets differ exactly where the embedded model on a CPU differs from planning a real model
    assert {k for k in STEP_FIELDS if EMBEDDED_DEFAULTS[k] != PLANNING_DEFAULTS[k]} == \
        {"dtype", "seq_len", "batch_size", "gradient_checkpointing", "padding"}
    assert set(ESTIMATE_FIELDS) == {"model", *STEP_FIELDS, "gpu", "margin"}


BAD = [
    (dict(seq_len=0), "seq_len must be a positive integer"),
    (dict(seq_len=2 ** 62), r"seq_len must be a positive integer \(at most 16,777,216\)"),
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(lora_rank=2.5), "lora_rank must be a positive integer"),
    (dict(gradient_checkpointing="false "), None),  # accepted: the CLI's words, parsed strictly
    (dict(gradient_checkpointing="nope"), "gradient_checkpointing must be true or false"),
    (dict(double_quant="no"), None),
    (dict(autocast=1.0), "autocast must be true or false"),
    (dict(method="full", lora_rank=8), "lora_rank only applies to method='lora' or 'qlora'"),
    (dict(method="full", lora_targets=["q_proj"]), "lora_targets only applies"),
    (dict(sharding="zero2"), "needs num_gpus > 1"),
    (dict(cpu_offload=True), "cpu_offload=True needs sharding"),
    (dict(optimizer="adam"), r"optimizer='adam' is not valid \(did you mean 'adamw'\?\); choose one of 'adamw'"),
    (dict(method="prefix"), "method='prefix' is not valid; choose one of"),  # no near name: no guess
    (dict(method="lroa"), r"method='lroa' is not valid \(did you mean 'lora'\?\)"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_one_validator_refuses_the_same_way_everywhere(bad, match):
    calls = {
        "Settings": lambda: Settings(**bad),
        "check_step": lambda: check_step(bad),
        "estimate": lambda: estimate("tiny", **bad),
        "simulate": lambda: simulate("tiny", **bad),
        "measure_config": lambda: measure_config("tiny", **bad, steps=1),
        "sweep": lambda: sweep("tiny", **bad),
    }
    if match is None:  # strictly parsed booleans: the same value everywhere
        key, value = next(iter(bad.items()))
        assert check_step(bad)[key] is (value.strip() in ("true", "yes")) is getattr(Settings(**bad), key)
        assert estimate("tiny", **bad).settings[key] is check_step(bad)[key]
        return
    messages = {}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=match) as e:
            call()
        messages[name] = str(e.value)
    assert len(set(messages.values())) == 1, messages


def test_model_checks_are_shared_by_estimate_simulate_and_measure():
    for fn in (estimate, simulate, lambda m, **kw: measure_config(m, steps=1, **kw)):
        with pytest.raises(ValueError, match=r"lora_rank=5000 is larger than the smallest targeted layer"):
            fn("tiny", lora_rank=5000)
        with pytest.raises(ValueError, match=r"\['qkv'\] are not linear layers"):
            fn("tiny", lora_targets=["qkv"])


def test_settings_refuse_non_step_nonsense_up_front():
    for bad, match in ((dict(learning_rate=math.nan), "learning_rate"), (dict(learning_rate=-1e-4), "learning_rate"),
                       (dict(eval_examples=-1), "eval_examples must be a non-negative integer"),
                       (dict(method="full", lora_dropout=0.1), "lora_dropout only applies")):
        with pytest.raises(ValueError, match=match):
            Settings(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(n_heldout=-1), "n_heldout must be a non-negative integer"),  # once: "all but the last" (399 of 400)
    (dict(n_control=2.5), "n_control must be a non-negative integer"),
    (dict(heldout_split="train"), "training split"),  # once: reported as held-out "+100 points"
    (dict(heldout=("tiny:dates", "train")), "training split"),
    (dict(do_sample="maybe"), "do_sample must be true or false"),
    (dict(confidence=1.5), "confidence must be in"),
    (dict(do_sample=True, temperature=math.nan), "temperature must be > 0"),
    (dict(batch_size=0), "batch_size must be a positive integer")])
def test_evaluate_refuses_bad_arguments_before_loading_anything(bad, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        lk.evaluate(run_dir=tmp_path, **bad)
    assert not any(tmp_path.iterdir())  # nothing loaded, nothing written


def test_settings_and_evaluate_count_examples_the_same_way():
    for v in (-1, 1.5, True):
        with pytest.raises(ValueError) as from_settings:
            Settings(eval_examples=v)
        with pytest.raises(ValueError) as from_evaluate:
            lk.evaluate(n_heldout=v)
        assert str(from_settings.value).split(" must ")[1] == str(from_evaluate.value).split(" must ")[1]


def test_step_kwargs_drop_lora_fields_for_full_fine_tuning():
    s = Settings(lora_rank=8)
    assert step_kwargs(s)["lora_rank"] == 8
    full = step_kwargs(s, method="full")
    assert full["method"] == "full" and not {"lora_rank", "lora_alpha", "lora_targets"} & set(full)
    assert estimate("tiny", **full).settings["method"] == "full"


def test_widget_choices_come_from_the_schema():
    from lora_kit.ui.widgets import PlannerPanel
    panel = PlannerPanel()
    for name in ("method", "optimizer", "sharding"):
        assert tuple(getattr(panel, name).options) == CHOICES[name]


def test_readme_estimate_example_is_a_realistic_plan(capsys):
    """`lora-kit estimate --model llama-3.1-8b --method qlora --seq-len 2048 --gpu L4`: planning defaults,
    every assumed value printed, and the verdict on the L4."""
    assert main(["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--seq-len", "2048", "--gpu", "L4"]) == 0
    out = capsys.readouterr().out
    for k in ("dtype", "batch_size", "gradient_checkpointing", "optimizer", "lora_rank", "margin"):
        assert f"* {k}" in out, k
    assert "  model" in out and "* model" not in out and "* seq_len" not in out
    e = estimate("llama-3.1-8b", method="qlora", seq_len=2048)
    assert e.settings["dtype"] == "bfloat16" and e.settings["batch_size"] == 1
    assert f"{e.peak_allocated_bytes / 2**30:10.3f} GiB" in out
    assert "L4: fits" in out


def test_cli_estimate_refuses_unknown_gpu_and_missing_model(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpu", "NOPE"]) == 2
    assert "Unknown GPU 'NOPE'" in capsys.readouterr().err
    assert main(["estimate", "--method", "lora"]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_planner_sweeps_and_fits_over_every_step_field():
    from lora_kit.plan.planner import ARRAY_ARGS, CATEGORICAL_ARGS, PASSTHROUGH_ARGS, max_fit
    assert sorted(ARRAY_ARGS + CATEGORICAL_ARGS + PASSTHROUGH_ARGS) == sorted(STEP_FIELDS)
    kw = {k: v for k, v in PLANNING_DEFAULTS.items() if k not in ("seq_len",)}
    assert max_fit("seq_len", "llama-3.1-8b", gpu="A100-80GB", **kw) > 0
