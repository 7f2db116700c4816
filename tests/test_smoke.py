"""smoke_run end to end on CPU on the embedded default: LoRA and QLoRA, save/reload/verify, results on disk."""
from __future__ import annotations

import json
import math

import pytest

from lora_kit.results import read_json
from lora_kit.run.smoke import PHASES, smoke_run

FAST = dict(max_steps=3, batch_size=2, seq_len=48, lora_rank=4, lora_alpha=8, max_new_tokens=4,
            learning_rate=1e-2, cpu_threads=1)  # model="tiny", dataset="tiny:dates", control_dataset="tiny:control" (defaults)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke_lora")
    return smoke_run(method="lora", run_dir=str(run_dir), measure_steps=2, progress=False, **FAST)


def test_lora_run_completes_every_phase(lora_run):
    rec = read_json(lora_run.run_dir / "smoke.json")  # what is on disk, not only in memory
    assert rec["status"] == "complete" and lora_run.ok
    assert [rec["phases"][p]["status"] for p in PHASES] == ["done", "not applicable"] + ["done"] * 6
    assert (lora_run.run_dir / "smoke.log").stat().st_size > 0
    assert rec["stack"]["versions"]["peft"] and rec["settings"]["seq_len"] == 48


def test_lora_run_records_per_step_metrics_and_peaks(lora_run):
    steps = lora_run.record["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(math.isfinite(s["loss"]) and s["tokens_per_s"] > 0 and s["seconds"] > 0 for s in steps)
    assert [s["measured"] for s in steps] == [True, True, False]  # tracker only on measure_steps
    peaks = lora_run.record["peaks"]
    assert peaks["design_step_peak_bytes"] == steps[1]["peak_bytes"] > 0
    assert sum(peaks["breakdown_at_design_step"].values()) == steps[1]["peak_bytes"]
    assert peaks["per_rank"][0]["rank"] == 0
    assert lora_run.steps_frame().shape[0] == 3


def test_lora_run_uses_verified_slice_with_longest_first(lora_run):
    data = lora_run.record["data"]
    from lora_kit.data import load_examples
    assert data["rows"] == len(load_examples("tiny:dates", split="train")) and data["used"] == 3 * 2
    assert data["longest_lengths"] == sorted(data["longest_lengths"], reverse=True)
    assert data["lead_examples_are_longest"] == 2 and data["truncated"] == 0


def test_lora_run_shows_estimate_beside_measured(lora_run):
    mm = lora_run.record["memory_model"]
    measured = lora_run.record["peaks"]["design_step_peak_bytes"]
    est = mm["estimate"]
    assert "error" not in est, est
    assert est["error_vs_measured"] == pytest.approx((est["peak_allocated_bytes"] - measured) / measured)


def test_lora_adapter_saved_reloaded_and_verified(lora_run):
    adapter = lora_run.adapter_dir
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    v = lora_run.record["verify"]
    assert v["passed"] and v["reload_equal"] and v["adapter_changes_outputs"]
    assert v["reload_max_abs_diff"] <= v["tolerance"] < v["adapter_vs_base_max_abs_diff"]
    assert lora_run.record["reload"] == {"missing_keys": [], "unexpected_keys": []}
    assert lora_run.record["checkpoint"]["bytes"] == sum(p.stat().st_size for p in adapter.iterdir())
    gens = lora_run.record["generations"]
    assert gens["source"] == "tiny:control" and len(gens["rows"]) == 4
    assert all(g["prompt"] and "base" in g and "adapter" in g for g in gens["rows"])


def test_qlora_run_on_embedded_default(tmp_path):
    r = smoke_run(method="qlora", run_dir=str(tmp_path), measure_steps=2, progress=False, simulate=False,
                  gradient_checkpointing=True, optimizer="paged_adamw_8bit", grad_accum=2, **FAST)
    assert r.ok, r.record.get("error")
    assert r.record["data"]["used"] == 3 * 2 * 2  # steps x batch x accumulation
    assert r.record["phases"]["quantize"]["status"] == "done"
    assert "Linear4bit" in r.record["phases"]["quantize"]["note"]
    assert r.record["verify"]["passed"] and r.record["verify"]["tolerance"] == 1e-4
    on_disk = json.loads((tmp_path / "smoke" / "smoke.json").read_text())
    assert on_disk["status"] == "complete" and len(on_disk["steps"]) == 3


@pytest.fixture(scope="module")
def no_pad_model_dir(random_llama_dir, tmp_path_factory):
    """The random Llama with a tokenizer that has no pad token (common for real base models)."""
    import shutil

    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("no_pad")
    for f in random_llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    tok = AutoTokenizer.from_pretrained(str(random_llama_dir))
    tok.pad_token = None
    tok.save_pretrained(str(d))
    assert AutoTokenizer.from_pretrained(str(d)).pad_token is None
    return d


def test_tokenizer_without_pad_token_is_handled(no_pad_model_dir, tmp_path):
    rows = [{"prompt": f"Q{i}", "response": f"A{i}"} for i in range(8)]
    r = smoke_run(model=str(no_pad_model_dir), run_dir=str(tmp_path), examples=rows, control_prompts=["Q1", "Q22"],
                  progress=False, simulate=False, measure_steps=1, num_gpus=2, sharding="fsdp",
                  **{**FAST, "max_steps": 1, "max_new_tokens": 2})
    assert r.ok and r.record["verify"]["passed"]  # pad = eos, masked in labels; left padding for generation
    from accelerate.commands.config.config_args import load_config_from_file
    cfg = load_config_from_file(r.record["accelerate_config"])  # written for the planned 2-GPU FSDP run
    assert cfg.distributed_type.value == "FSDP" and cfg.num_processes == 2


def test_full_fine_tuning_trains_every_parameter_and_skips_adapter_phases(random_llama_dir, tmp_path):
    rows = [{"prompt": f"Q{i}", "response": f"A{i}"} for i in range(8)]
    lora_free = {k: v for k, v in FAST.items() if k not in ("lora_rank", "lora_alpha")}  # refused with method='full'
    r = smoke_run(model=str(random_llama_dir), method="full", run_dir=str(tmp_path), examples=rows, progress=False,
                  simulate=False, measure_steps=2, **{**lora_free, "max_steps": 2})
    assert r.ok and r.record["model"]["trainable_parameters"] == r.record["model"]["parameters"]
    assert [r.record["phases"][p]["status"] for p in ("save", "reload", "verify", "generate")] == ["not applicable"] * 4
    n = r.record["model"]["parameters"]
    assert r.record["peaks"]["breakdown_at_design_step"]["optimizer_states"] >= 2 * 4 * n  # AdamW: 2 fp32 moments
