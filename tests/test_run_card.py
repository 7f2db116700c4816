"""The run card reads as a request: assumptions stated, every fitting row, currency, one spelling per
method, rounded numbers, failed probes with their message, and only blocking probes as things to fix."""
import json
import re

import pytest

from lora_kit.check import stack
from lora_kit.plan.planner import compare_methods
from lora_kit.memory.estimate import estimate
from lora_kit.plan.records import plan_record, sweeps_record
from lora_kit.settings import Settings
from lora_kit.ui.run_card import build_report

GPUS = ["T4", "L4", "A10G", "RTX-4090", "L40S", "A100-80GB", "H100-SXM"]
STEP = dict(seq_len=2048, lora_rank=16, gradient_checkpointing=True)


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    s = Settings(dtype="bfloat16", optimizer="adamw", run_dir=str(d))
    (d / "settings.json").write_text(json.dumps(s.to_dict()))
    table = compare_methods("llama-3.1-8b", gpus=GPUS, margin=0.1, **STEP)
    (d / "plan.json").write_text(json.dumps(plan_record(table, "llama-3.1-8b", margin=0.1, **STEP)))
    probes = [{"name": "bf16 matmul", "status": "fail", "error": "RuntimeError: no kernel image\nfor this device"},
              {"name": "bnb 8-bit optimizer step", "status": "fail", "error": "ImportError: no 8-bit kernels"},
              {"name": "LoRA training step", "status": "pass", "detail": "loss 4.9, adapter updated"}]
    rep = {"probes": probes, "verdict": stack.verdict(probes, s, device="cpu")}  # stack.json's probes and verdict
    (d / "stack.json").write_text(json.dumps(rep))
    (d / "smoke").mkdir()
    (d / "smoke" / "smoke.json").write_text(json.dumps({
        "status": "complete", "throughput": {"mean_step_seconds": 0.6206221177658959,
                                             "mean_tokens_per_s": 894.4633617276198, "note": "excludes step 0"},
        "verify": {"reload_max_abs_diff": 0.0, "tolerance": 1e-05, "reload_equal": True,
                   "adapter_vs_base_max_abs_diff": 26.389467239379883, "adapter_changes_outputs": True,
                   "files": {"n_tensors": 56}, "passed": True}}))
    (d / "sweeps.json").write_text(json.dumps(sweeps_record(
        "llama-3.1-8b", "A100-80GB", {"lora, checkpointing on": 29952, "qlora, checkpointing off": 4864}, {},
        estimate("tiny", seq_len=64, batch_size=16))))
    build_report(d)
    return {"md": (d / "report.md").read_text(), "json": json.loads((d / "report.json").read_text()), "table": table}


def test_header_and_assumptions_match_the_request(card):
    md = card["md"]
    assert md.splitlines()[0] == "# Run card: fine-tuning llama-3.1-8b (planned) · smoke run and evaluation on tiny · LoRA"
    request = md.split("## The request")[1].split("## Settings")[0]
    for said in ("**llama-3.1-8b**", "2,048 tokens per example", "base weights: bfloat16", "4-bit NF4",
                 "gradient checkpointing on", "optimizer adamw", "rank 16, targets all-linear",
                 "at most 90% of the GPU's memory", "one epoch: 10,000 examples = 20,480,000 tokens",
                 "of their dtype's peak", "measured error"):
        assert said in request, said
    assert "a placeholder until the smoke run has read your dataset" in md.split("### Time and cost per epoch")[1]


def test_every_fitting_row_cheapest_first_with_currency(card):
    request = card["md"].split("## The request")[1].split("## Settings")[0]
    rows = [line for line in request.splitlines() if line.startswith("| ") and "✓" in line]
    fits = card["table"][card["table"]["fits"]]
    # QLoRA on L4 and A10G included; with torch's reserved and the memory outside the allocator in the device total
    # (issue 34), QLoRA on the T4 does not fit at the 10 % margin (LoRA on the RTX-4090 does since the reserved term
    # fitted on long-row replays gives a 2,048-token step less cache: a 3 % share of the peak, not 5 %)
    assert len(rows) == len(fits) == 10
    assert {r.split("|")[1].strip() for r in rows} == {"LoRA", "QLoRA"}
    assert "cost per epoch (USD, example)" in request and "★ cheapest" in rows[0]
    assert not re.search(r"\bL?Q?LORA\b|\blora\b", request.replace("lora_kit", ""))  # one spelling
    assert "QLoRA fits on L4, A10G" in request
    assert ("Longest seq_len (tokens) that fits A100-80GB at micro-batch 1 (llama-3.1-8b, notebook 02): "
            "LoRA, checkpointing on: 29,952; QLoRA, checkpointing off: 4,864.") in request



def test_a_longest_seq_len_at_the_models_context_is_named_as_such():
    """A user trial: "Longest seq_len that fits L4: 4,096" for every setting was the small model's context (where
    the search stops), not a memory limit."""
    from lora_kit.ui.run_card import longest_line
    sw = {"gpu": "L4", "plan_model": "mine", "context": 4096}
    line = longest_line({**sw, "max_seq_len_batch1": {"lora, checkpointing on": 4096, "qlora, checkpointing on": 4096}})
    assert line.endswith("Every value is the model's context (4,096 positions, max_position_embeddings), where the "
                         "search stops: memory allows more.")
    line = longest_line({**sw, "max_seq_len_batch1": {"lora, checkpointing on": 4096, "lora, checkpointing off": 1024}})
    assert "LoRA, checkpointing on: 4,096 (the model's context); LoRA, checkpointing off: 1,024." in line
    assert "context" not in longest_line({**sw, "context": None, "max_seq_len_batch1": 1024})


def test_numbers_are_rounded_and_keys_are_words(card):
    md = card["md"]
    assert not re.findall(r"\d+\.\d{4,}", md), re.findall(r"\d+\.\d{4,}", md)
    assert "adapter_vs_base_max_abs_diff" not in md and "mean_step_seconds" not in md
    assert "mean step 0.621 s, 894 tokens/s" in md and "largest change 26.4" in md


def test_failed_probe_shows_its_message_and_only_blocking_ones_are_to_fix(card):
    md = card["md"]
    assert "| fail | None |" not in md and "| bf16 matmul | fail | RuntimeError: no kernel image for this device |" in md
    assert "| bnb 8-bit optimizer step | fail | ImportError: no 8-bit kernels |" in md
    fix = [c for c in card["json"]["next_checks"] if c.startswith("Fix before renting")]
    assert len(fix) == 1 and "bf16 matmul" in fix[0] and "set dtype='float32'" in fix[0]
    assert "8-bit" not in fix[0]  # failed, but this plan (optimizer adamw) does not need it


def test_one_gpu_card_has_no_multi_gpu_section(card):
    assert "multi_gpu" not in card["json"]["plan"] and "## Several GPUs" not in card["md"]


def test_settings_read_as_a_params_file(card):
    settings = card["md"].split("## Settings")[1].split("## ")[0]
    assert "| autocast | `false` |" in settings and "| interactive | `true` |" in settings
    assert "| gpus | `[T4, L4, A10G, RTX-4090, L40S, A100-80GB, H100-SXM]` |" in settings
    table = settings.split("|---|---|")[1]
    assert "True" not in table and "False" not in table and "'" not in table


def test_card_of_a_smoke_run_folder_of_its_own(tmp_path):
    """torchrun's smoke run goes into a folder of its own (no settings.json, no pipeline.json): the card takes
    the settings from smoke.json (title, settings table, several GPUs), and the pipeline card's next check
    names such a folder in its torchrun command."""
    from lora_kit.ui.run_card import collect, next_checks
    s = Settings(model="/models/my-llama", num_gpus=2, sharding="fsdp", run_dir=str(tmp_path))
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "smoke.json").write_text(json.dumps({
        "status": "complete", "settings": s.to_dict(),
        "launch": {"world_size": 2, "device": "cpu", "sharding": "fsdp (FSDP2, 2 ranks)",
                   "fsdp": {"policy": "accelerate", "layer_class": "LlamaDecoderLayer", "mesh": [2], "reshard_after_forward": True}},  # as the sharded smoke run records it
        "measurement": {"design_step": 1},
        "peaks": {"per_rank": [{"rank": 0, "design_step_peak_bytes": 2 ** 20, "max_peak_bytes": 2 ** 20},
                               {"rank": 1, "design_step_peak_bytes": 2 ** 20, "max_peak_bytes": 2 ** 20}]},
        "memory_model": {"estimate_fsdp_per_gpu": 2 ** 20}}))
    build_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Run card: fine-tuning my-llama · LoRA")  # a local model by its name, not its path
    assert "| sharding | `fsdp` |" in md and "| 1 | 1.0 MiB |" in md.split("## Several GPUs")[1]
    assert "this folder holds a smoke run of its own" in md and "plan.json has no multi-GPU section" not in md
    card = {**collect(tmp_path), "plan": {"multi_gpu": {"num_gpus": 2}},
            "settings": {**s.to_dict(), "run_dir": "runs/x/"}}
    line = next(x for x in next_checks(card) if x.startswith("Several GPUs"))
    assert "--nproc_per_node 2 -m lora_kit.run.smoke --params run.yaml -p run_dir runs/x-2ranks`" in line


def test_epoch_interval_is_the_one_the_plan_used():
    """A plan made with a calibrated time model (a narrower error) keeps that interval on the card; a plan.json
    written before it carried the factor falls back to the model's measured error before calibration."""
    from lora_kit.plan import time_constants
    from lora_kit.plan.timing import TimeModel
    from lora_kit.ui.run_card import epoch_time
    table = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], methods=("lora",), margin=0.1,
                            time_model=TimeModel(error_factor=1.05), **STEP)
    plan = json.loads(json.dumps(plan_record(table, "llama-3.1-8b", margin=0.1, **STEP)))
    card = {"plan": plan, "smoke": {}, "settings": {"method": "lora", "gpu": "A100-80GB"}}
    et = epoch_time(card)
    assert et["error_factor"] == 1.05 and et["hours_high"] == pytest.approx(1.05 * et["hours"])
    del plan["time_error_factor"]
    assert epoch_time(card)["error_factor"] == time_constants.ERROR_FACTOR_UNCALIBRATED


def _card_dir(d, gpu, smoke):
    s = Settings(method="lora", gpu=gpu, dtype="bfloat16", run_dir=str(d))
    (d / "settings.json").write_text(json.dumps(s.to_dict()))
    table = compare_methods("llama-3.1-8b", gpus=[gpu], methods=("lora",), batch_size=2, margin=0.1, **STEP)
    (d / "plan.json").write_text(json.dumps(plan_record(table, "llama-3.1-8b", margin=0.1, **STEP)))
    (d / "smoke").mkdir()
    (d / "smoke" / "smoke.json").write_text(json.dumps(smoke))
    build_report(d)
    return json.loads((d / "report.json").read_text()), (d / "report.md").read_text(), table


def test_card_says_what_nvidia_smi_will_show_and_the_allocator_to_keep(tmp_path):
    """nvidia-smi shows the device total plus the driver's share (its total minus CUDA's): added once, labelled,
    never in the verdict; the smoke run's allocator setting is named with who set it, and the user told to keep it."""
    from lora_kit.plan.gpus import get_gpu
    alloc = {"variable": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True", "expandable_segments": True,
             "set_by": "lora_kit", "cuda_started_before": False}
    rep, md, table = _card_dir(tmp_path, "H200", {"status": "complete", "allocator": alloc})
    v, g = rep["nvidia_smi"], get_gpu("H200")
    assert v["driver_share_bytes"] == g["capacity_bytes"] - g["cuda_capacity_bytes"] > 0
    assert v["device_total_bytes"] == int(table["device_total_gib"].iloc[0] * 2 ** 30)
    assert v["nvidia_smi_used_bytes"] == v["device_total_bytes"] + v["driver_share_bytes"]  # the share once
    assert v["cuda_capacity_bytes"] == g["cuda_capacity_bytes"] and v["nvidia_smi_total_bytes"] == g["capacity_bytes"]
    section = md.split("### What nvidia-smi will show")[1].split("##")[0]
    assert "CUDA's total (the catalog's reading)" in section and "driver's share" in section
    b = int(table["batch_size"].iloc[0])  # the micro-batch the figures are for, named (a user's differs)
    assert f"at micro-batch {b} x seq_len {rep['plan']['seq_len']:,} (the plan's: the largest that fits)" in section
    assert "not counted in *fits*" in section
    smoke = md.split("## Smoke run")[1].split("## ")[0]
    assert "expandable segments **on** (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, set by lora_kit)" in smoke
    assert "Keep this setting on the rented GPU" in smoke
    off = dict(alloc, value="", variable="PYTORCH_CUDA_ALLOC_CONF", expandable_segments=False, set_by="environment")
    (tmp_path / "l4").mkdir()
    rep, md, _ = _card_dir(tmp_path / "l4", "L4", {"status": "complete", "allocator": off})
    assert rep["nvidia_smi"]["driver_share_bytes"] is None and rep["nvidia_smi"]["nvidia_smi_used_bytes"] is None
    assert "a fallback: the catalog has no CUDA reading" in md and "catalog cannot give for this GPU" in md
    assert "expandable segments **off**" in md and "set in your environment" in md and "does not read it" not in md
    (tmp_path / "cpu").mkdir()  # a smoke run on a CPU: the setting had no effect there, and the card says so
    _, md, _ = _card_dir(tmp_path / "cpu", "H200", {"status": "complete", "allocator": alloc,
                                                    "launch": {"world_size": 1, "device": "cpu"}})
    smoke = md.split("## Smoke run")[1].split("## ")[0]
    assert "ran on a CPU, where the setting has no effect" in smoke and "Keep this setting" not in smoke
    (tmp_path / "old").mkdir()  # torch 2.9: only the newer variable set, which its CUDA allocator ignores
    ignored = dict(alloc, variable=None, value="", expandable_segments=False, set_by="environment",
                   ignored=["PYTORCH_ALLOC_CONF"])
    _, md, _ = _card_dir(tmp_path / "old", "H200", {"status": "complete", "allocator": ignored})
    assert "`PYTORCH_ALLOC_CONF` is set, but this torch's CUDA allocator does not read it" in md


def test_request_says_when_cuda_runs_attention_in_the_math_kernel(tmp_path):
    """plan.json's attention_note (the run's method on the run's GPU) is one line of what the request assumes;
    a plan without one (LoRA in bf16: flash) adds no line."""
    import torch
    from lora_kit.memory.cuda_kernels import EFFICIENT_GQA_FROM, torch_version
    table = compare_methods("llama-3.1-8b", gpus=["H100-SXM"], margin=0.1, **STEP)
    mds = {}
    for method in ("qlora", "lora"):
        d = tmp_path / method
        d.mkdir()
        s = Settings(method=method, gpu="H100-SXM", dtype="bfloat16", run_dir=str(d))
        (d / "settings.json").write_text(json.dumps(s.to_dict()))
        plan = plan_record(table, "llama-3.1-8b", margin=0.1, gpu="H100-SXM", method=method, **STEP)
        (d / "plan.json").write_text(json.dumps(plan))
        build_report(d)
        mds[method] = (d / "report.md").read_text().split("## The request")[1].split("## Settings")[0], plan
    request, plan = mds["qlora"]
    if torch_version(torch.__version__) < EFFICIENT_GQA_FROM:
        assert f"- attention on CUDA: {plan['attention_note']}" in request
        assert "math kernel (fp32 q/k/v with grouped K/V)" in request and "torch >= 2.14" in request
    else:
        assert "attention on CUDA" not in request
    assert mds["lora"][1]["attention_note"] is None and "attention on CUDA" not in mds["lora"][0]


def test_card_of_a_local_model_folder_plans_every_section(tmp_path):
    """A model in a local folder: the card names it by its folder, and the sections that read the model (the loop
    you run next, what nvidia-smi will show) are made from its path before the card drops local paths."""
    import shutil
    from pathlib import Path
    import lora_kit
    model = tmp_path / "models" / "my-model"
    model.mkdir(parents=True)
    shutil.copy(Path(lora_kit.__file__).parent / "embedded" / "tiny" / "config.json", model / "config.json")
    d = tmp_path / "run"
    d.mkdir()
    s = Settings(model=str(model), method="lora", gpu="L4", run_dir=str(d))
    (d / "settings.json").write_text(json.dumps(s.to_dict()))
    step = dict(seq_len=128, lora_rank=8, gradient_checkpointing=True)
    table = compare_methods(str(model), gpus=["L4"], methods=("lora",), batch_size=2, margin=0.1, **step)
    (d / "plan.json").write_text(json.dumps(plan_record(table, str(model), margin=0.1, **step)))
    build_report(d)
    md, rep = (d / "report.md").read_text(), json.loads((d / "report.json").read_text())
    assert "my-model" in md and str(tmp_path) not in md and str(tmp_path) not in json.dumps(rep)
    assert "no estimate" not in md and "your Trainer run will peak at" in md
    assert rep["loops"]["model"] == "my-model" and all("error" not in r for r in rep["loops"]["rows"])
    assert "with expandable segments" in md.split("### What nvidia-smi will show")[1].split("##")[0]


def test_a_resumed_runs_time_is_said_to_be_the_last_invocations():
    from lora_kit.ui.run_card import run_lines
    pipe = {"status": "complete", "seconds": 42.0, "notebooks": [], "resumed": [{"at": "t", "kept": ["00"]}]}
    head = run_lines({"pipeline": pipe, "run": {"id": "r1"}})[0]
    assert "**complete** in 42 s (the last invocation alone: it resumed the run, after 1 earlier)" in head
    assert "resumed" not in run_lines({"pipeline": {**pipe, "resumed": []}, "run": {"id": "r1"}})[0]


def test_the_request_says_which_cpu_defaults_the_plan_replaced():
    """A user trial: the Settings table said float32 while the request planned bfloat16, unexplained. Fields left at
    the embedded model's CPU defaults are planned with GPU defaults; the request names each, with both values."""
    from lora_kit.ui.run_card import planned_apart_lines
    run = Settings(run_dir="x").to_dict()  # the embedded defaults: float32, 64 tokens, micro-batch 16
    plan = {"assumptions": Settings(run_dir="x").plan_step().to_dict()}
    (line,) = planned_apart_lines(run, plan)
    assert "dtype 'bfloat16' (this run: 'float32')" in line and "seq_len 2048 (this run: 64)" in line
    mine = Settings(run_dir="x", dtype="bfloat16", seq_len=512).to_dict()  # set by the user: planned as set
    plan = {"assumptions": Settings(run_dir="x", dtype="bfloat16", seq_len=512).plan_step().to_dict()}
    assert "dtype" not in " ".join(planned_apart_lines(mine, plan)) and "seq_len" not in " ".join(
        planned_apart_lines(mine, plan))


def test_smoke_tokens_per_s_says_what_it_counts():
    """The smoke run's tokens/s counts the rows' own tokens, the request's table every row slot (micro-batch x
    seq_len): the card says which is which and gives the padded figure too, so the two are compared like for like."""
    from lora_kit.ui.run_card import smoke_lines
    steps = [{"seconds": 1.0, "tokens": 50, "padded_tokens_per_s": 64.0},  # step 0, warm-up: not counted
             {"seconds": 0.5, "tokens": 40, "padded_tokens_per_s": 128.0},
             {"seconds": 0.5, "tokens": 60, "padded_tokens_per_s": 128.0}]
    line = next(x for x in smoke_lines({"status": "complete", "steps": steps, "throughput": {
        "mean_step_seconds": 0.5, "mean_tokens_per_s": 100.0}}) if x.startswith("- mean step"))
    assert line == ("- mean step 0.500 s, 100 tokens/s (the rows' own tokens, padding excluded; 128 counting "
                    "padding, as the request's tokens/s counts them)"), line
