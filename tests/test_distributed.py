"""More than one process: the smoke run under torchrun (2 CPU processes, gloo, DDP) and accelerate configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from lora_kit.run.accelerate_config import accelerate_config, write_accelerate_config


@pytest.mark.parametrize("sharding,kind", [("ddp", "MULTI_GPU"), ("zero1", "DEEPSPEED"), ("zero2", "DEEPSPEED"),
                                           ("zero3", "DEEPSPEED"), ("fsdp", "FSDP")])
def test_accelerate_parses_the_config(tmp_path, sharding, kind):
    from accelerate.commands.config.config_args import load_config_from_file
    path = write_accelerate_config(tmp_path / "acc.yaml", sharding=sharding, num_gpus=4, cpu_offload=True)
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == kind and cfg.num_processes == 4 and cfg.mixed_precision == "bf16"
    if kind == "DEEPSPEED":
        assert cfg.deepspeed_config["zero_stage"] == int(sharding[-1])
        assert cfg.deepspeed_config["offload_optimizer_device"] == "cpu"
    if kind == "FSDP":
        assert cfg.fsdp_config["fsdp_offload_params"] is True


def test_accelerate_config_bad_input():
    with pytest.raises(ValueError, match="sharding='zero4' is not valid"):
        accelerate_config(sharding="zero4")
    with pytest.raises(ValueError, match="num_gpus must be >= 1"):
        accelerate_config(num_gpus=0)


def test_two_process_smoke_run_under_torchrun(random_llama_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "response": f"A{i}"}) + "\n" for i in range(32)))
    control = tmp_path / "control.jsonl"
    control.write_text(json.dumps({"prompt": "hi", "response": "ho"}) + "\n")
    params = tmp_path / "run.yaml"
    params.write_text(yaml.safe_dump({"model": str(random_llama_dir), "dataset": str(data),
                                      "control_dataset": str(control), "max_steps": 2, "batch_size": 2,
                                      "seq_len": 32, "lora_rank": 4, "lora_alpha": 8, "max_new_tokens": 2,
                                      "run_dir": str(tmp_path / "run"), "num_gpus": 4}))  # planned: 4
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "lora_kit.run.smoke", "--params", str(params), "--no-simulate", "--measure-steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "run" / "smoke" / "smoke.json").read_text())
    assert rec["status"] == "complete" and rec["launch"]["world_size"] == 2
    assert rec["launch"]["sharding"] == "ddp (2 ranks)" and "fsdp" not in rec["launch"]
    per_rank = rec["peaks"]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1] and all(r["design_step_peak_bytes"] > 0 for r in per_rank)
    mm = rec["memory_model"]
    assert mm["estimate_ddp_per_gpu"] > 0 and mm["estimate_fsdp_per_gpu"] > 0
    assert "rank 1: measured peak" in out.stdout and "estimate_ddp_per_gpu" in out.stdout
    assert rec["verify"]["passed"] and len(rec["steps"]) == 2
    from accelerate.commands.config.config_args import load_config_from_file
    assert load_config_from_file(rec["accelerate_config"]).num_processes == 4  # the config is for the planned run
    assert rec["launch"]["note"].startswith("settings plan num_gpus=4; this run has 2 ranks")  # not silent
    assert "note: settings plan num_gpus=4" in out.stdout


def test_smoke_cli_refuses_a_lora_kit_run_folder_once_naming_its_own(tmp_path, monkeypatch, capsys):
    """The README's journey: `lora-kit run` into runs/x, then torchrun's smoke run with the same params file.
    Into runs/x it would replace the smoke/ that run's notebook 04 evaluated and, with its own run id, be left
    off that run's card; the CLI refuses before loading anything, names -p run_dir runs/x-2ranks, and says it
    once (rank 0), not once per process."""
    from lora_kit.results import RUN_ENV
    from lora_kit.run.smoke import check_own_folder, main
    run = tmp_path / "x"
    run.mkdir()
    ident = {"id": "20261203T000000Z-abcdef", "started": "2026-12-03T00:00:00Z", "kind": "lora-kit run",
             "dir": str(run)}
    (run / "pipeline.json").write_text(json.dumps({"run": ident, "status": "complete"}))
    monkeypatch.delenv(RUN_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert main(["-p", "run_dir", str(run), "-p", "num_gpus", "2", "-p", "sharding", "fsdp"]) == 2
        err = capsys.readouterr().err
        assert (f"-p run_dir {run}-2ranks" in err and ident["id"] in err and "build_report" in err) is said
        assert said or err == ""
    assert not (run / "smoke").exists()
    for rank in ("0", "1"):  # what the FSDP2 smoke run refuses: said once too
        monkeypatch.setenv("RANK", rank)
        assert main(["-p", "run_dir", str(tmp_path / "q"), "-p", "method", "qlora", "-p", "num_gpus", "2",
                     "-p", "sharding", "fsdp"]) == 2
        err = capsys.readouterr().err
        assert ("method='qlora' is not run by the smoke run" in err) is (rank == "0") and (rank == "0" or err == "")
    check_own_folder(str(tmp_path / "fresh"), 2)  # a folder of its own (no pipeline.json): fine
    monkeypatch.setenv(RUN_ENV, json.dumps(ident))  # notebook 03 inside that very `lora-kit run`: fine
    check_own_folder(str(run), 2)


def test_fresh_process_keeps_the_known_library_messages_silent(capfd):
    """simulate runs in a spawned process under torchrun: it printed transformers' known
    `is_gradient_checkpointing is deprecated` FutureWarning that lora_kit.noise silences everywhere else."""
    import warnings

    from lora_kit.run.distributed import in_fresh_process
    known = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
    in_fresh_process(warnings.warn, message=known, category=FutureWarning)
    in_fresh_process(warnings.warn, message="an unknown message still shows", category=FutureWarning)
    err = capfd.readouterr().err
    assert "an unknown message still shows" in err and "is_gradient_checkpointing" not in err
