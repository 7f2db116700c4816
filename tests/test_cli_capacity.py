"""``lora-kit estimate`` prints the capacity the verdict is judged on: the CUDA-visible total from the catalog, or
the vendor's GB where the catalog names no CUDA reading, labelled as such (never nvidia-smi's total)."""
from __future__ import annotations

import json

import pytest

from lora_kit.plan.gpus import get_gpu
from lora_kit.ui.cli import main

GIB = 2 ** 30


@pytest.mark.parametrize("gpu", ["H100-SXM", "L4"])
def test_estimate_prints_the_capacity_it_judges_on(gpu, capsys):
    args = ["estimate", "--model", "llama-3.1-8b", "--method", "lora", "--gpu", gpu]
    assert main([*args, "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    g = get_gpu(gpu)
    assert fit["cuda_capacity_bytes"] == g["cuda_capacity_bytes"] != fit["capacity_bytes"] == g["capacity_bytes"]
    assert main(args) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith(f"{g['name']}:")]
    label = "from the vendor's GB" if g["cuda_capacity_basis"].startswith("fallback") else "CUDA-visible"
    assert len(line) == 1
    assert line[0].endswith(f"of {fit['cuda_capacity_bytes'] / GIB:.1f} GiB {label})")
    assert f"{fit['headroom_bytes'] / GIB:+.2f} GiB" in line[0]


@pytest.mark.parametrize("gpu, workspace", [("H100-SXM", 32 * 2 ** 20), ("L4", 8 * 2 ** 20 + 128 * 1024)])
def test_estimate_says_what_torch_will_report_on_that_gpu(gpu, workspace, capsys):
    """max_memory_allocated on CUDA = the step's peak + two cuBLAS workspaces, by the GPU's compute capability
    (9.0 for an H100: 32 MiB; 8.9 for an L4: PyTorch's ':4096:2:16:8')."""
    args = ["estimate", "--model", "llama-3.1-8b", "--method", "lora", "--gpu", gpu]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cuda_allocated_bytes"] == out["peak_allocated_bytes"] + 2 * workspace
    assert main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "torch will report" in ln)
    assert f"{out['cuda_allocated_bytes'] / GIB:10.3f} GiB" in line and gpu in line


def test_estimate_warns_when_cuda_would_run_the_attention_in_the_math_kernel(capsys):
    """QLoRA with peft's up-casts gives SDPA fp32 q/k/v with grouped K/V heads: CUDA (torch < 2.14) falls back to
    the math kernel. `lora-kit estimate` says so, as the planner's check does, and its 'torch will report' line
    points to it; a LoRA plan (bf16 q/k/v) gets neither."""
    from lora_kit.plan.planner import check_plan
    args = ["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--qlora-prepare", "peft", "--gpu", "H200"]
    assert main([*args, "--json"]) == 0
    note = json.loads(capsys.readouterr().out)["note"]
    assert "runs in the math kernel" in note and "Fix:" in note
    assert note == check_plan("llama-3.1-8b", "H200", method="qlora", qlora_prepare="peft")["note"]
    assert main(args) == 0
    assert "see the note" in next(ln for ln in capsys.readouterr().out.splitlines() if "torch will report" in ln)
    assert main(["estimate", "--model", "llama-3.1-8b", "--method", "lora", "--gpu", "H200", "--json"]) == 0
    assert "math kernel" not in (json.loads(capsys.readouterr().out)["note"] or "")


def test_a_plan_that_fits_only_with_expandable_segments_says_so(capsys):
    """*Fits* counts PyTorch's default allocator setting; where only expandable segments (what the kit's GPU path
    sets) fit, the planner's verdict and `lora-kit estimate` both say so, with that setting's device total."""
    from lora_kit.plan.planner import check_plan, verdict_text
    kw = dict(method="lora", seq_len=2048)
    base = check_plan("llama-3.1-8b", "RTX-4090", margin=0.0, **kw)
    default, expandable = base["estimate"].device_total_bytes, base["expandable"]["device_total_bytes"]
    assert expandable < default
    margin = 1 - (default + expandable) / 2 / base["cuda_capacity_bytes"]  # between the two settings' totals
    plan = check_plan("llama-3.1-8b", "RTX-4090", margin=margin, **kw)
    assert not plan["fits"] and plan["expandable"]["fits"]
    text = verdict_text(plan)
    assert text.startswith("Does NOT fit") and f"With expandable_segments:True" in text
    assert f"needs {expandable / GIB:.2f} GiB and fits" in text
    assert base["fits"] and "expandable_segments" not in verdict_text(base)  # fits anyway: nothing to say
    args = ["estimate", "--model", "llama-3.1-8b", "--method", "lora", "--seq-len", "2048", "--gpu", "RTX-4090",
            "--margin", str(margin)]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["fit"]["fits"] and out["fit_expandable"]["fits"]
    assert out["fit_expandable"]["device_total_bytes"] == out["device_total_expandable_bytes"] == expandable
    assert main(args) == 0
    assert "With expandable_segments:True, which lora-kit's GPU path sets" in capsys.readouterr().out
