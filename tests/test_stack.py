"""Stack check: versions, hardware, real probes, and the one verdict ``lora-kit check`` and notebook 00 share.

The bitsandbytes CPU trap exists only where bitsandbytes' CPU backend detects AVX512-BF16. Tests force
both paths through the switch bitsandbytes itself reads -- ``Linear4bit.__init__`` sets
``support_avx512bf16_for_cpu = has_avx512bf16()`` from ``bitsandbytes.nn.modules`` -- and run the
probes on the CPU, so CI proves both whatever CPU it lands on, with the real bitsandbytes kernels.
"""
from __future__ import annotations

import json

import bitsandbytes.nn.modules as bnb_modules
import pytest
import torch

from lora_kit import loading
from lora_kit.check import probes as stack_probes
from lora_kit.check import stack
from lora_kit.settings import Settings
from lora_kit.ui.cli import main as cli_main

RAW, KIT = "bnb 4-bit grad after eval (raw)", "bnb 4-bit grad after eval (kit)"


@pytest.fixture(scope="module")
def rep():
    return stack.report()


@pytest.fixture(params=[True, False], ids=["avx512bf16", "no-avx512bf16"])
def cpu_avx512bf16(request, monkeypatch):
    """This process's bitsandbytes believes the CPU has (or lacks) AVX512-BF16; probes run on the CPU."""
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: request.param)
    monkeypatch.setattr(stack_probes, "device", lambda: torch.device("cpu"))
    return request.param


def _probe(name: str) -> dict:
    return stack_probes.run_probe(name, dict(stack_probes.PROBES)[name])


def test_versions_and_hardware(rep):
    v = rep["versions"]
    for k in ("python", "torch", "cuda", "cudnn", "driver", "transformers", "peft", "bitsandbytes", "accelerate"):
        assert k in v
    import peft
    assert v["torch"] == torch.__version__ and v["peft"] == peft.__version__
    assert rep["hardware"]["cpu_architecture"] in ("x86-64", "ARM64") and rep["hardware"]["os"]


def test_probes_run_the_real_thing(rep):
    status = {p["name"]: p for p in rep["probes"]}
    assert [p["name"] for p in rep["probes"]] == [n for n, _ in stack_probes.PROBES]
    assert all(p["status"] in stack_probes.STATUSES for p in rep["probes"])
    for name in ("bf16 matmul", "bnb 4-bit matmul fwd+bwd", "bnb 8-bit optimizer step", "gradient checkpointing",
                 "LoRA training step", KIT):
        assert status[name]["status"] == "pass", status[name]
    # this machine's own CPU decides: present-and-worked-around on AVX512-BF16, pass elsewhere; never a failure
    expected = "worked-around" if stack_probes.bnb_repacks_here(stack_probes._bnb()) else "pass"
    assert status[RAW]["status"] == expected, status[RAW]
    assert "uint8" in status["bnb 8-bit optimizer step"]["detail"]  # really 8-bit states
    if rep["hardware"]["gpus"] == []:
        assert status["SDPA memory-efficient"]["status"] == "not applicable"
    assert rep["verdict"]["ok"] and rep["verdict"]["plan"]["method"] == Settings().method


def test_table_and_json(rep):
    table = stack.format_table(rep)
    for text in ("Versions", "Probes", "Notes", "bitsandbytes", "bnb 4-bit matmul fwd+bwd", "Verdict for method='lora'"):
        assert text in table
    assert json.loads(json.dumps(rep))["verdict"] == rep["verdict"]
    assert any("framework supporting a model" in n for n in rep["notes"])


def test_trap_present_and_worked_around_or_absent(cpu_avx512bf16):
    """AVX512-BF16: bitsandbytes as shipped cuts the gradient (the raw probe sees it) and the kit's fix
    restores it -> "worked-around", a warning, not a failure. Without AVX512-BF16: the trap cannot occur."""
    raw, kit = _probe(RAW), _probe(KIT)
    assert kit["status"] == "pass", kit
    if cpu_avx512bf16:
        assert raw["status"] == "worked-around", raw
        assert "trap present" in raw["detail"] and "fix_bnb_cpu_repack" in raw["detail"]
        assert "gradient to the 4-bit layer input is cut" in raw["detail"]  # the trap really happened here
    else:
        assert raw["status"] == "pass" and "no AVX512-BF16" in raw["detail"], raw
    for method in ("lora", "qlora"):
        v = stack.verdict([raw, kit], Settings(method=method), device="cpu")
        assert v["ok"] and not v["blocking"], v
        assert any("trap present" in w for w in v["warnings"]) == cpu_avx512bf16


def test_raw_trap_without_the_kit_fix_really_cuts_gradients(cpu_avx512bf16):
    r = stack_probes.run_probe("raw", lambda: stack_probes.bnb_grad_after_eval(fix=False))
    if cpu_avx512bf16:
        assert r["status"] == "fail" and "gradient to the 4-bit layer input is cut" in r["error"], r
    else:
        assert r["status"] == "pass", r


def test_broken_workaround_blocks_qlora_not_lora(monkeypatch, capsys, tmp_path):
    """If the kit's fix did nothing, QLoRA is blocked (exit 1) and LoRA still runs (exit 0), in the CLI too."""
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(stack_probes, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(loading, "fix_bnb_cpu_repack", lambda model: 0)
    raw, kit = _probe(RAW), _probe(KIT)
    assert raw["status"] == "fail" and kit["status"] == "fail", (raw, kit)
    v = stack.verdict([raw, kit], Settings(method="qlora"), device="cpu")
    assert not v["ok"] and {b["probe"] for b in v["blocking"]} == {RAW, KIT}
    assert all("method='lora'" in b["change"] for b in v["blocking"])
    v = stack.verdict([raw, kit], Settings(method="lora"), device="cpu")
    assert v["ok"] and len(v["warnings"]) == 2 and "only method='qlora' needs it" in v["warnings"][0]
    (tmp_path / "plan.yaml").write_text("method: qlora\ndtype: float32\n")
    assert cli_main(["check", "--params", str(tmp_path / "plan.yaml"), "--json", str(tmp_path / "stack.json")]) == 1
    assert "BLOCKED by 2 probe(s)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "stack.json").read_text())["verdict"]
    assert saved["plan"]["method"] == "qlora" and not saved["ok"]
    assert cli_main(["check"]) == 0
    assert "Verdict for method='lora'" in capsys.readouterr().out


def _result(name, status, error="boom"):
    return {"name": name, "status": status, "detail": None if status == "fail" else "d",
            "error": error if status == "fail" else None}


@pytest.mark.parametrize("probe, status, blocked, fine", [
    ("bf16 matmul", "fail", dict(dtype="bfloat16"), dict(dtype="float32")),
    ("bf16 matmul", "fail", dict(autocast=True), dict(dtype="float16", autocast=True)),
    ("bnb 4-bit matmul fwd+bwd", "fail", dict(method="qlora"), dict(method="lora")),
    ("bnb 4-bit matmul fwd+bwd", "not applicable", dict(method="qlora"), dict(method="full")),  # no bitsandbytes
    ("bnb 8-bit optimizer step", "fail", dict(optimizer="adamw_8bit"), dict(optimizer="adamw")),
    ("bnb paged optimizer step", "fail", dict(optimizer="paged_adamw_32bit"), dict(optimizer="adamw_8bit")),
    ("gradient checkpointing", "fail", dict(gradient_checkpointing=True), dict(gradient_checkpointing=False)),
    ("LoRA training step", "fail", dict(method="lora"), dict(method="full")),
])
def test_a_failure_blocks_only_the_plans_that_need_it(probe, status, blocked, fine):
    probes = [_result(n, "pass") for n, _ in stack_probes.PROBES if n != probe] + [_result(probe, status)]
    v = stack.verdict(probes, Settings(**blocked), device="cpu")
    assert not v["ok"] and [b["probe"] for b in v["blocking"]] == [probe]
    assert v["blocking"][0]["change"] and v["blocking"][0]["needed_by"]
    v = stack.verdict(probes, Settings(**fine), device="cpu")
    assert v["ok"], v
    assert any(w.startswith(probe) for w in v["warnings"]) == (status == "fail")  # a failure is never silent


def test_sdpa_failure_warns_with_its_cost():
    v = stack.verdict([_result("SDPA flash", "fail")], Settings(), device="cuda")
    assert v["ok"] and "falls back to another attention kernel" in v["warnings"][0]
    assert v["scope"] == "this machine's cuda"


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


def test_check_refuses_bad_settings(capsys):
    assert cli_main(["check", "--method", "qlorra"]) == 2
    assert "method='qlorra' is not valid" in capsys.readouterr().err


def test_a_library_older_than_declared_blocks_every_plan_with_the_fix(monkeypatch):
    """Floors come from lora_kit's own metadata (pyproject): an installed library outside them is named with the pip
    command that fixes it; libraries not installed are the probes' business. An optional library (an extra) that
    is installed is checked too (bitsandbytes 0.49 does not run the 8-bit and paged optimizers on a CPU), and
    blocks only the plans that use it."""
    reqs = ["transformers>=5.12", "peft>=0.21", "bitsandbytes>=0.50; extra == \"quant\"",
            "bitsandbytes>=0.50; extra == \"dev\"", "numpy", "oldlib>=2; python_version < \"3.0\""]
    got = stack.floor_problems({"transformers": "4.48.1", "peft": "0.21.2", "bitsandbytes": "0.49.2",
                                "oldlib": "1.0"}, reqs)
    assert got == [{"package": "transformers", "installed": "4.48.1", "needs": ">=5.12",
                    "change": "pip install -U 'transformers>=5.12'", "optional": False},
                   {"package": "bitsandbytes", "installed": "0.49.2", "needs": ">=0.50",
                    "change": "pip install -U 'bitsandbytes>=0.50'", "optional": True}]  # once, not per extra
    assert stack.floor_problems({"transformers": "5.24.0", "peft": None}, reqs) == []
    probes = [_result(n, "pass") for n, _ in stack_probes.PROBES]
    monkeypatch.setattr(stack, "floor_problems", lambda: got[1:])
    lora, qlora = (stack.verdict(probes, Settings(method=m), device="cpu") for m in ("lora", "qlora"))
    assert lora["ok"] and any("bitsandbytes 0.49.2" in w and "not needed by this plan" in w for w in lora["warnings"])
    assert not qlora["ok"] and qlora["blocking"][0]["needed_by"].startswith("QLoRA")
    monkeypatch.setattr(stack, "floor_problems", lambda: got)
    v = stack.verdict(probes, Settings(method="full"), device="cpu")
    assert not v["ok"] and [b["probe"] for b in v["blocking"]] == ["versions"]
    assert "transformers 4.48.1 is not >=5.12" in v["blocking"][0]["error"]
    assert "pip install -U 'transformers>=5.12'" in "\n".join(stack.format_verdict(v))


def test_this_environment_meets_the_declared_floors():
    assert stack.floor_problems() == []
