"""A TRL SFT config drives a smoke run: TRL's SFTTrainer trains the config's step for a few steps on the embedded
tiny model, the step's peak is measured, and estimate and simulate (loop "sft") stand beside it. What the config
set -- learning rate, max_length, batch, gradient accumulation, checkpointing, LoRA r / alpha / targets -- is read
back from the trainer and the model that ran."""
from __future__ import annotations

import pytest
import yaml

from lora_kit.loading import resolve_model
from lora_kit.plan.config_import import run_settings
from lora_kit.run.smoke import check_runnable, smoke_run

# TRL's documented `trl sft --config` format: SFTConfig, ModelConfig and ScriptArguments fields in one YAML
CONFIG = {"dataset_name": "trl-lib/Capybara", "learning_rate": 3.0e-3, "max_length": 48,
          "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "gradient_checkpointing": True,
          "bf16": False, "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
          "lr_scheduler_type": "constant", "warmup_steps": 0, "output_dir": "sft-out"}


@pytest.fixture(scope="module")
def trl_smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_smoke")
    path = d / "sft.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": resolve_model("tiny"), **CONFIG}))
    s, report = run_settings(path, max_steps=2, max_new_tokens=2, run_dir=str(d / "run"))
    return s, report, smoke_run(s, measure_steps=2, progress=False, cpu_threads=1)


def test_the_config_maps_to_the_run_settings(trl_smoke):
    s, report, _ = trl_smoke
    assert report.format == "trl" and s.loop == "sft" and s.from_config.endswith("sft.yaml")
    assert (s.learning_rate, s.seq_len, s.batch_size, s.grad_accum) == (3e-3, 48, 2, 2)
    assert s.gradient_checkpointing is True and s.method == "lora"
    assert (s.lora_rank, s.lora_alpha, list(s.lora_targets)) == (4, 8, ["q_proj", "v_proj"])
    assert s.padding == "longest"  # TRL's collator pads to the batch's longest row


def test_sft_trainer_ran_the_configs_step(trl_smoke):
    _, _, r = trl_smoke
    rec = r.record
    assert r.ok and rec["verify"]["passed"]
    loop = rec["loop"]
    assert loop["loop"] == "sft" and loop["trainer"] == "SFTTrainer" and loop["from_config"].endswith("sft.yaml")
    args = loop["args"]  # read back from the trainer that ran
    assert args["learning_rate"] == CONFIG["learning_rate"] and args["max_length"] == CONFIG["max_length"]
    assert args["per_device_train_batch_size"] == CONFIG["per_device_train_batch_size"]
    assert args["gradient_accumulation_steps"] == CONFIG["gradient_accumulation_steps"]
    assert args["lr_scheduler_type"] == "constant" and args["max_steps"] == 2  # the config's own; the smoke's steps
    assert loop["gradient_checkpointing"] is True  # on the model that trained
    ad = loop["adapter"]
    assert (ad["r"], ad["lora_alpha"], ad["target_modules"]) == (4, 8, ["q_proj", "v_proj"])
    assert ad["lora_dropout"] == 0.05  # TRL's ModelConfig default, as trl sft runs it
    steps = rec["steps"]
    assert [st["rows"] for st in steps] == [2 * 2] * 2  # batch x grad accum per optimizer step
    assert all(st["seq_len"] <= CONFIG["max_length"] for st in steps)
    assert "loop: sft (SFTTrainer.train(), with" in r.summary()


def test_the_sft_step_is_measured_beside_estimate_and_simulate(trl_smoke):
    _, _, r = trl_smoke
    rec = r.record
    measured = rec["peaks"]["design_step_peak_bytes"]
    assert measured > 0 and rec["steps"][1]["measured"] and sum(rec["peaks"]["breakdown_at_design_step"].values()) \
        == measured
    for name in ("estimate", "simulate"):
        m = rec["memory_model"][name]
        assert "error" not in m, m
        assert m["seq_len"] == rec["steps"][1]["seq_len"]  # padding "longest": the step's own width
        assert m["error_vs_measured"] == (m["peak_allocated_bytes"] - measured) / measured
        assert abs(m["error_vs_measured"]) < 0.02, m  # LoRA dropout and accumulation are the model's to add


def test_a_config_trl_rejects_is_refused_before_loading(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "tiny", **CONFIG, "lr_scheduler_type": "sometimes"}))
    from lora_kit.settings import from_dict
    with pytest.raises(ValueError, match="from_config: .*trl sft rejects this config"):
        check_runnable(from_dict({"loop": "sft", "from_config": str(path)}), world=1)
    with pytest.raises(ValueError, match="not a TRL SFT config"):
        check_runnable(from_dict({"loop": "sft", "from_config": str(
            __import__("pathlib").Path(__file__).parent / "configs" / "axolotl_lora_mistral-7b.yml")}), world=1)


def test_the_smoke_command_runs_a_trl_config(tmp_path, capsys):
    """``python -m lora_kit.run.smoke --from-config sft.yaml``: the config's step under the SFTTrainer, ``-p``
    settings winning (here the micro-batch)."""
    from lora_kit.results import read_json
    from lora_kit.run.smoke import main
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": resolve_model("tiny"), **CONFIG}))
    run = tmp_path / "run"
    assert main(["--from-config", str(path), "-p", "run_dir", str(run), "-p", "max_steps", "1", "-p", "batch_size",
                 "1", "-p", "max_new_tokens", "2", "--no-simulate", "--cpu-threads", "1"]) == 0
    assert "loop: sft (SFTTrainer.train(), with" in capsys.readouterr().out
    rec = read_json(run / "smoke" / "smoke.json")
    assert rec["loop"]["args"]["per_device_train_batch_size"] == 1 and rec["loop"]["args"]["learning_rate"] == 3e-3
    assert main(["--from-config", str(path), "-p", "run_dir", str(tmp_path / "no"), "-p", "num_gpus", "2",
                 "-p", "sharding", "zero2", "-p", "cpu_offload", "true"]) == 2
    assert "cpu_offload=True is not run" in capsys.readouterr().err and not (tmp_path / "no").exists()
