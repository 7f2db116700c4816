"""Out of memory and crashes: the smoke run keeps what it measured and says where it stopped."""
from __future__ import annotations

import json

import pytest
import torch

from lora_kit.memory.estimate import estimate
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import check_plan, fit_verdict, fixes
from lora_kit.results import read_json
from lora_kit.run import adapter_io
from lora_kit.run.oom import fit_suggestions, is_oom
from lora_kit.run.smoke import smoke_run, summary
from lora_kit.settings import Settings, as_step

ROWS = [{"prompt": f"Name {i}", "response": f"n{i}"} for i in range(30)]
FAST = dict(max_steps=2, batch_size=4, seq_len=48, lora_rank=8, lora_alpha=16, max_new_tokens=2, cpu_threads=1)


def _run(model_dir, tmp_path, **kw):
    return smoke_run(model=str(model_dir), run_dir=str(tmp_path), examples=ROWS, control_prompts=["hi"],
                     progress=False, simulate=False, **{**FAST, **kw})


def test_oom_in_training_is_recorded_with_ranked_fixes(random_llama_dir, tmp_path):
    # the random Llama's weights + adapter + optimizer take ~0.6 MB; a training step needs several MB
    r = _run(random_llama_dir, tmp_path, memory_limit_bytes=1_500_000)
    rec = read_json(tmp_path / "smoke" / "smoke.json")
    assert r.status == rec["status"] == "failed at train"
    assert [rec["phases"][p]["status"] for p in ("load", "quantize", "adapter", "train", "save")] == \
        ["done", "not applicable", "done", "failed", "pending"]
    oom = rec["oom"]
    assert oom["phase"] == "train" and oom["step_phase"] in ("forward", "backward", "optimizer")
    assert oom["memory_at_failure"]["tracked_peak_bytes"] > 1_500_000  # the failing allocation is counted
    assert oom["memory_after_free"]["tracked_live_bytes"] < 1_500_000 // 4  # model, optimizer, activations freed
    assert "OutOfMemoryError" in rec["phases"]["train"]["error"]
    # the advice is the planner's one ladder, on the emulated device (no CUDA context: its total is the peak)
    sugg = oom["suggestions"]
    device = {"name": sugg["device"], "capacity_bytes": 1_500_000, "cuda": False}
    step = as_step(rec["settings"])
    assert sugg["ranked"] == json.loads(json.dumps(fixes(device, 0.10, model=str(random_llama_dir), step=step)))
    assert sugg["ranked"] and not sugg["estimate_fits"] and sugg["usable_bytes"] == 0.9 * 1_500_000
    usable = fit_verdict(0, device, 0.10)["usable_bytes"]
    for fix in sugg["ranked"]:  # every rung fits by the one rule: the estimated peak within the usable bytes
        assert estimate(str(random_llama_dir), step, **fix["settings"]).peak_allocated_bytes \
            == fix["device_total_bytes"] <= usable
    assert sugg["ranked"][0]["settings"] == {"batch_size": 1}  # quality first: same effective batch
    assert "micro-batch 4 -> 1" in summary(rec)


def test_oom_while_loading(random_llama_dir, tmp_path):
    r = _run(random_llama_dir, tmp_path, memory_limit_bytes=20_000)
    assert r.status == "failed at load" and r.record["oom"]["phase"] == "load"
    assert read_json(tmp_path / "smoke" / "smoke.json")["phases"]["adapter"]["status"] == "pending"


def test_crash_keeps_measured_steps_and_marks_the_phase(random_llama_dir, tmp_path, monkeypatch):
    def disk_full(*a, **k):
        raise OSError("No space left on device")
    monkeypatch.setattr(adapter_io, "save_adapter", disk_full)  # fault injection: the save phase fails
    with pytest.raises(OSError, match="No space"):
        _run(random_llama_dir, tmp_path, max_steps=2, measure_steps=1)
    rec = read_json(tmp_path / "smoke" / "smoke.json")
    assert rec["status"] == "failed at save" and "No space" in rec["error"]
    assert rec["phases"]["train"]["status"] == "done" and len(rec["steps"]) == 2
    assert rec["peaks"]["design_step_peak_bytes"] is None  # step 1 was not measured (measure_steps=1)
    assert rec["steps"][0]["peak_bytes"] > 0
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "smoke").iterdir())


def test_is_oom_recognises_torch_and_allocator_errors():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate ... out of memory"))
    assert not is_oom(ValueError("bad seq_len"))


def test_oom_advice_on_a_gpu_is_the_planner_ladder_for_that_gpu():
    """After an OOM on a CUDA device of an L4's size the advice is exactly planner.fixes for the L4."""
    s = Settings(model="llama-3.1-8b", method="lora", dtype="bfloat16", seq_len=4096, batch_size=8, margin=0.15)
    advice = fit_suggestions(s, get_gpu("L4")["cuda_capacity_bytes"], cuda=True, name="L4")
    ladder = fixes("L4", 0.15, model="llama-3.1-8b", step=s.step)
    assert advice["ranked"] == ladder and len(ladder) >= 2 and advice["estimate_fits"] is False
    assert advice["estimated_device_total_bytes"] == estimate("llama-3.1-8b", step=s.step).device_total_bytes
    assert check_plan("llama-3.1-8b", "L4", 0.15, step=s.step)["fix"] == ladder[0]
    full = fit_suggestions(s.replace(method="full", lora_rank=16), get_gpu("L4")["cuda_capacity_bytes"],
                           cuda=True, name="L4")
    assert full["ranked"] == fixes("L4", 0.15, model="llama-3.1-8b", step=s.step.for_method("full"))
    unknown = fit_suggestions(s, None)
    assert unknown["ranked"] == [] and "no device size" in unknown["note"]
