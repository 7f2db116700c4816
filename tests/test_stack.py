"""Stack check: versions, hardware, real probes on this machine, table and JSON."""
from __future__ import annotations

import json

import pytest

from lora_kit.check import stack

from lora_kit.check import probes as stack_probes
@pytest.fixture(scope="module")
def rep():
    return stack.report()


def test_versions_and_hardware(rep):
    v = rep["versions"]
    for k in ("python", "torch", "cuda", "cudnn", "driver", "transformers", "peft", "bitsandbytes", "accelerate"):
        assert k in v
    import peft
    import torch
    assert v["torch"] == torch.__version__ and v["peft"] == peft.__version__
    assert rep["hardware"]["cpu_architecture"] in ("x86-64", "ARM64") and rep["hardware"]["os"]


def test_probes_run_the_real_thing(rep):
    status = {p["name"]: p for p in rep["probes"]}
    assert [p["name"] for p in rep["probes"]] == [n for n, _ in stack_probes.PROBES]
    assert all(p["status"] in ("pass", "fail", "not applicable") for p in rep["probes"])
    for name in ("bf16 matmul", "bnb 4-bit matmul fwd+bwd", "bnb 8-bit optimizer step", "gradient checkpointing",
                 "LoRA training step", "bnb 4-bit grad after eval (kit)"):
        assert status[name]["status"] == "pass", status[name]
    assert "uint8" in status["bnb 8-bit optimizer step"]["detail"]  # really 8-bit states
    if rep["hardware"]["gpus"] == []:
        assert status["SDPA memory-efficient"]["status"] == "not applicable"


def test_table_and_json(rep):
    table = stack.format_table(rep)
    for text in ("Versions", "Probes", "Notes", "bitsandbytes", "bnb 4-bit matmul fwd+bwd"):
        assert text in table
    assert json.loads(json.dumps(rep))["probes"] == rep["probes"]
    assert any("framework supporting a model" in n for n in rep["notes"])


def test_silent_bnb_trap_detected_and_fixed():
    raw = stack_probes.run_probe("raw", lambda: stack_probes.bnb_grad_after_eval(fix=False, force_repack_path=True))
    assert raw["status"] == "fail" and "gradient to the 4-bit layer input is cut" in raw["error"]
    fixed = stack_probes.run_probe("kit", lambda: stack_probes.bnb_grad_after_eval(fix=True, force_repack_path=True))
    assert fixed["status"] == "pass", fixed


def test_failing_probe_reports_error_text():
    def boom():
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    r = stack_probes.run_probe("x", boom)
    assert r["status"] == "fail" and "no kernel image" in r["error"]


def test_notes_for_known_traps():
    info = {"versions": {"bitsandbytes": None}, "hardware": {
        "cpu_architecture": "ARM64", "gpus": [{"name": "NVIDIA GB10", "compute_capability": "12.1", "memory_bytes": 1}],
        "torch_cuda_arch_list": ["sm_80", "sm_90"]}}
    notes = " ".join(stack.notes(info, [{"name": "p", "status": "fail"}]))
    assert "ARM64" in notes and "sm_121" in notes and "bitsandbytes is not installed" in notes and "Failed probes: p" in notes
