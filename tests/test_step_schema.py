"""One step schema: a frozen ``Step`` defines every field once; every entry point takes a Step plus step fields
with one of two named default sets, and refuses bad values with the same message from the same validator."""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
from pathlib import Path

import pytest

import lora_kit as lk
from lora_kit.memory.estimate import estimate, estimate_arrays
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.plan.planner import sweep
from lora_kit.settings import (CHOICES, EMBEDDED, EMBEDDED_CHANGES, EMBEDDED_DEFAULTS, LORA_FIELDS, PLANNING,
                               STEP_FIELDS, Settings, Step, as_step, check_axes, field_help)
from lora_kit.ui.cli import ESTIMATE_FIELDS, build_parser, main

PACKAGE = Path(lk.__file__).parent


@pytest.mark.parametrize("fn", [estimate, simulate, measure_config])
def test_entry_points_take_a_step_and_overrides(fn):
    params = inspect.signature(fn).parameters
    assert list(params)[:2] == ["model", "step"] and params["step"].default is None
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert not set(params) & set(STEP_FIELDS)  # no field written out again in a signature


def test_no_other_hand_written_step_defaults_on_the_planning_side():
    """memory/, plan/ and ui/ (estimate, simulate, measure, the planner, the time model, the CLI) spell no
    default for a step field in a signature: a value comes from a Step. (None, or compare_methods'
    batch_size="max", mean "not given" and are allowed.)"""
    import ast
    wrong = []
    for path in (p for room in ("memory", "plan", "ui") for p in (PACKAGE / room).rglob("*.py")):
        for node in ast_functions(path):
            args = node.args
            pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults)) + \
                list(zip(args.kwonlyargs, args.kw_defaults))
            for a, d in pairs:
                if a.arg in STEP_FIELDS and isinstance(d, ast.Constant) and d.value not in (None, "max"):
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}({a.arg}={d.value!r})")
    assert not wrong, "step fields with their own defaults:\n" + "\n".join(wrong)


def ast_functions(path):
    import ast
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_every_field_is_documented_and_validated_by_its_own_rule():
    for f in dataclasses.fields(Step):
        doc = Step.doc(f.name)
        assert len(doc) > 40 and "Default" in doc, f.name  # meaning, allowed values, default and why
        assert f.metadata["kind"] in ("choice", "bool", "int", "targets", "fraction"), f.name
    assert Step() == PLANNING and hash(PLANNING) == hash(Step())
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLANNING.seq_len = 1


def test_settings_hold_every_step_field_with_the_embedded_defaults_and_help():
    s = Settings()
    assert s.step == EMBEDDED and {k: getattr(s, k) for k in STEP_FIELDS} == EMBEDDED_DEFAULTS
    helps = field_help()
    assert all(helps[k] == Step.doc(k) for k in STEP_FIELDS)
    # the two default sets differ exactly where EMBEDDED_CHANGES says, each with its reason
    assert {k for k in STEP_FIELDS if getattr(EMBEDDED, k) != getattr(PLANNING, k)} == set(EMBEDDED_CHANGES)
    assert all(len(why) > 20 for _, why in EMBEDDED_CHANGES.values())
    # trust_remote_code: a model of its own code is planned from that code only when the user says so
    assert set(ESTIMATE_FIELDS) == {"model", *STEP_FIELDS, "gpu", "margin", "trust_remote_code"}


def test_a_new_field_is_a_flag_and_a_params_key():
    """CLI flags and params keys come from the fields: every step field is a flag of run and estimate."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for cmd in ("run", "estimate"):
        flags = {o for a in sub.choices[cmd]._actions for o in a.option_strings}
        assert {"--" + k.replace("_", "-") for k in STEP_FIELDS} <= flags, cmd
    assert set(STEP_FIELDS) <= set(Settings().to_dict())


def test_unknown_names_get_did_you_mean():
    for call in (lambda: estimate("tiny", seq_length=128), lambda: PLANNING.replace(lora_rnk=8),
                 lambda: Settings.replace(Settings(), gradient_checkpoint=True),
                 lambda: sweep("tiny", batch_sise=[1, 2])):
        with pytest.raises(ValueError, match=r"did you mean '(seq_len|lora_rank|gradient_checkpointing|batch_size)'"):
            call()


def test_a_sweep_is_a_step_plus_axes_validated_the_same_way():
    axes = check_axes(PLANNING, seq_len=[512, 1024], batch_size=[1, 2])
    assert axes["seq_len"].tolist() == [512, 1024]
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        check_axes(PLANNING, seq_len=[512, 0])
    with pytest.raises(ValueError, match="needs num_gpus > 1"):
        check_axes(PLANNING.replace(num_gpus=2, sharding="fsdp"), num_gpus=[1, 2])
    with pytest.raises(ValueError, match="Unknown sweep axis"):
        check_axes(PLANNING, method=["lora"])
    arr = estimate_arrays("tiny", PLANNING, seq_len=[64, 128])
    assert arr["peak_allocated_bytes"].tolist() == [estimate("tiny", seq_len=n).peak_allocated_bytes for n in (64, 128)]


def test_your_own_model_is_planned_as_itself_and_the_tutorial_says_what_it_plans(tmp_path):
    assert Settings(model=str(tmp_path)).planning_model() == str(tmp_path)
    assert Settings().planning_model() == "llama-3.1-8b"  # the embedded tutorial's named plan
    assert Settings(plan_model="qwen2.5-7b").planning_model() == "qwen2.5-7b"
    assert Settings(model=str(tmp_path), plan_model="same").planning_model() == str(tmp_path)
    # fields left at the CPU tutorial's defaults are planned at the planning defaults; set ones are kept
    plan = Settings(model=str(tmp_path), seq_len=512, lora_rank=8).plan_step()
    assert plan == PLANNING.replace(seq_len=512, lora_rank=8)
    shipped = Path(__file__).parents[1] / "params"
    from lora_kit.settings import load_settings
    for p in shipped.glob("*.yaml"):
        s = load_settings(p)
        if s.model not in ("tiny",):
            assert s.planning_model() == s.model, p.name  # shipped params files plan what they train


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
        "Step": lambda: Step(**bad),
        "estimate": lambda: estimate("tiny", **bad),
        "simulate": lambda: simulate("tiny", **bad),
        "measure_config": lambda: measure_config("tiny", **bad, steps=1),
        "sweep": lambda: sweep("tiny", **bad),
    }
    if match is None:  # strictly parsed booleans: the same value everywhere
        key, value = next(iter(bad.items()))
        assert getattr(Step(**bad), key) is (value.strip() in ("true", "yes")) is getattr(Settings(**bad), key)
        assert estimate("tiny", **bad).settings[key] is getattr(Step(**bad), key)
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


def test_for_method_resets_lora_fields_for_full_fine_tuning():
    s = Settings(lora_rank=8)
    assert s.step.lora_rank == 8
    full = s.step.for_method("full")
    assert full.method == "full" and all(getattr(full, k) == getattr(PLANNING, k) for k in LORA_FIELDS)
    assert estimate("tiny", full).settings["method"] == "full"
    assert as_step(s.to_dict()) == s.step  # a record's dict (extra keys ignored) is the same step


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
    assert max_fit("seq_len", "llama-3.1-8b", gpu="A100-80GB", step=PLANNING) > 0
