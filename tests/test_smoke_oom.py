"""Out of memory and crashes: the smoke run keeps what it measured and says where it stopped."""
from __future__ import annotations

import pytest
import torch

from lora_kit.run import adapter_io
from lora_kit.run.oom import candidate_changes, fit_suggestions, is_oom
from lora_kit.results import read_json
from lora_kit.settings import Settings
from lora_kit.run.smoke import smoke_run

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
    ranked = oom["suggestions"]["ranked"]
    savings = [x["estimated_saving_bytes"] for x in ranked]
    assert savings == sorted(savings, reverse=True) and len(ranked) >= 5
    assert {"gradient_checkpointing", "seq_len", "method", "optimizer", "lora_rank"} <= \
        {k for x in ranked for k in x["settings"]}
    assert all(isinstance(x["fits"], bool) for x in ranked)


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


def test_candidate_changes_only_offer_what_changes_something():
    s = Settings(method="qlora", gradient_checkpointing=True, batch_size=1, optimizer="paged_adamw_8bit",
                 lora_rank=4).to_dict()
    assert [c[1] for c in candidate_changes(s, ["q_proj", "v_proj"])] == [{"seq_len": 32},
                                                                          {"lora_targets": ["q_proj", "v_proj"]}]


def test_fit_suggestions_combine_when_no_single_change_fits(random_llama_dir):
    s = {**Settings(batch_size=16, seq_len=128).to_dict(), "model": str(random_llama_dir)}
    tight = fit_suggestions(s, limit_bytes=1, target_names=["q_proj", "v_proj"])
    assert not any(r["fits"] for r in tight["ranked"])
    assert tight["combined"]["fits"] is False and tight["combined"]["changes"]
    loose = fit_suggestions(s, limit_bytes=10**12)
    assert all(r["fits"] for r in loose["ranked"]) and loose["combined"] is None
