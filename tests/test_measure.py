"""measure_step on a prepared model / optimizer / batch, and the GPU validation script's CPU dry run."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.measure import measure_step
from lora_kit.memory.tracker import round_bytes

ROOT = Path(__file__).resolve().parents[1]


def _prepared(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
    ids = torch.randint(0, 128, (2, 16))
    return model, opt, {"input_ids": ids, "labels": ids}


def test_measure_step_on_a_prepared_model():
    model, opt, batch = _prepared()
    res = measure_step(model, batch, opt)
    assert res.device == "cpu" and res.reserved_bytes is None
    assert set(res.breakdown) == set(BREAKDOWN_KEYS)
    assert sum(res.breakdown.values()) == res.peak_allocated_bytes
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert res.breakdown["adapters"] == sum(round_bytes(p.numel() * 4) for p in lora)
    # AdamW: exp_avg + exp_avg_sq per adapter tensor (+ a 512-byte block per step counter)
    assert res.breakdown["optimizer_states"] == 2 * res.breakdown["adapters"] + 512 * len(lora)
    assert res.phase in ("forward", "backward", "optimizer")
    assert len(res.losses) == 2 and all(l == l for l in res.losses)  # finite, two steps ran
    assert res.to_dict()["peak_allocated_bytes"] == res.peak_allocated_bytes


def test_measure_is_reproducible_and_leaves_no_bytes_behind():
    model, opt, batch = _prepared()
    a = measure_step(model, batch, opt)
    model, opt, batch = _prepared()
    b = measure_step(model, batch, opt)
    assert a.peak_allocated_bytes == b.peak_allocated_bytes and a.breakdown == b.breakdown


def test_measure_step_rejects_zero_steps():
    model, opt, batch = _prepared()
    with pytest.raises(ValueError, match="steps must be >= 1"):
        measure_step(model, batch, opt, steps=0)


def test_measure_step_snapshot_is_cuda_only():
    model, opt, batch = _prepared()
    with pytest.raises(ValueError, match="snapshot records CUDA's caching allocator"):
        measure_step(model, batch, opt, snapshot="x.pickle")


def _gpu_validate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_validate
    finally:
        sys.path.pop(0)
    return gpu_validate


def test_gpu_validate_sums_what_is_live_at_the_recorded_peak():
    """peak_live reads torch.cuda.memory._snapshot()'s trace as the allocated counter moves: an ``alloc`` adds its
    block, a ``free_requested`` takes it away; blocks are grouped by the innermost library frame."""
    gpu_validate = _gpu_validate()
    bnb = [{"filename": "/x/site-packages/bitsandbytes/functional.py", "line": 10, "name": "dequantize_4bit"},
           {"filename": "/x/train.py", "line": 1, "name": "main"}]
    user = [{"filename": "/x/train.py", "line": 5, "name": "main"}]
    trace = [{"action": "alloc", "addr": 1, "size": 300, "frames": bnb},
             {"action": "alloc", "addr": 2, "size": 100, "frames": user},
             {"action": "free_requested", "addr": 1, "size": 300, "frames": bnb},
             {"action": "free_completed", "addr": 1, "size": 300, "frames": bnb},
             {"action": "alloc", "addr": 3, "size": 250, "frames": bnb},  # 350 live: below the 400 before
             {"action": "segment_alloc", "addr": 9, "size": 4096, "frames": []}]
    got = gpu_validate.peak_live({"device_traces": [trace]}, before=1000)
    assert got["peak_allocated"] == 1400 and got["step_live_at_peak"] == 400
    assert got["by_site"][0] == {"where": "bitsandbytes/functional.py:10 dequantize_4bit", "bytes": 300, "blocks": 1}
    assert got["by_site"][1]["where"] == "/x/train.py:5 main" and [b["bytes"] for b in got["largest"]] == [300, 100]


def test_gpu_validate_only_takes_a_comma_list_in_its_order():
    """--only "a,b": the configs matching any part, those matching a first (the order --budget-s spends in)."""
    gpu_validate = _gpu_validate()
    configs = [(label, None, {}) for label in ("x lora", "x qlora", "y full", "z lora 4L")]
    labels = lambda only: [c[0] for c in gpu_validate.select_configs(configs, only)]  # noqa: E731
    assert labels("") == ["x lora", "x qlora", "y full", "z lora 4L"]
    assert labels("qlora") == ["x qlora"]
    assert labels("4L,qlora,lora") == ["z lora 4L", "x qlora", "x lora"]  # each once, at its first match
    assert labels("full, 4L,") == ["y full", "z lora 4L"] and labels("nothing,else") == []


def test_gpu_validate_plan_only_runs_a_gpu_config_but_its_step(tmp_path):
    """--plan-only: a GPU config's simulate (traced as on CUDA), replay, estimate and CUDA extras run on the CPU;
    nothing is measured, nothing fails."""
    gpu_validate = _gpu_validate()
    out = tmp_path / "plan.json"
    assert gpu_validate.main(["--plan-only", "9.0", "--only", "deepseek-v2-lite 2L lora s2048", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["notes"] == [] and row["measured_peak"] is None and row["simulate_peak"] > 0, row
    assert row["replay"]["default"]["max_reserved"] > 0 and row["estimate_cuda_allocated"] > row["estimate_peak"]
    assert {"kernel_extra", "math_kernel_extra"} <= set(row)
    # multi-head latent attention: q/k heads of 192 and v of 128 rule flash out (equal head sizes); the
    # memory-efficient kernel takes them. The GPU session sets beside it the backend torch picks there.
    assert row["sdpa_predicted"] == "efficient" and "sdpa_observed" not in row


def test_gpu_session_runs_every_gpu_config():
    """scripts/gpu_session.sh: its priority order (VALIDATE_ORDER) leaves no GPU config out, and each part of its
    expandable-segments list names one config."""
    gpu_validate = _gpu_validate()
    text = (ROOT / "scripts" / "gpu_session.sh").read_text()
    order = re.search(r'^VALIDATE_ORDER="([^"]+)"', text, flags=re.M).group(1)
    expandable = re.search(r'^EXPANDABLE_ONLY="([^"]+)"', text, flags=re.M).group(1)
    configs = gpu_validate.GPU_CONFIGS + gpu_validate.cut_gpu_configs()
    assert sorted(c[0] for c in gpu_validate.select_configs(configs, order)) == sorted(c[0] for c in configs)
    for part in expandable.split(","):
        assert len(gpu_validate.select_configs(configs, part)) == 1, part


def test_gpu_validate_skips_cleanly_without_cuda_and_dry_runs_on_cpu(tmp_path, capsys, monkeypatch):
    gpu_validate = _gpu_validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gpu_validate.main(["--out", str(out)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out and not out.exists()
    assert gpu_validate.main(["--cpu-dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["measured_peak"] > 0
        assert r["simulate_err_pct"] == 0.0, r  # tiny CPU configs: simulate == real step
        assert r["measured_before"] == r["simulate_before"] > 0, r  # and what both hold as the step starts
    printed = capsys.readouterr().out
    assert "simulate_err_pct" in printed and "tiny-qwen2 qlora ckpt" in printed


def _tiny_pythia(tmp_path) -> str:
    """Issue 32's Pythia case in miniature: GPT-NeoX, partial rotary, parallel residual, 2 layers."""
    from transformers import GPTNeoXConfig
    GPTNeoXConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, vocab_size=256,
                  rotary_pct=0.25, max_position_embeddings=256).save_pretrained(tmp_path)
    return str(tmp_path)


PYTHIA_STEP = dict(method="lora", lora_targets=["query_key_value"], lora_rank=8, seq_len=64, batch_size=1,
                   gradient_checkpointing=False, attn_implementation="sdpa", dtype="bfloat16")


def test_real_step_and_simulate_allocate_the_same_storages_in_the_same_order(tmp_path):
    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.tracker import first_divergence
    model = _tiny_pythia(tmp_path)
    real = measure_config(model, trace=True, **PYTHIA_STEP)
    sim = simulate(model, trace=True, **PYTHIA_STEP)
    assert first_divergence(real.allocations, sim.allocations) is None
    assert real.peak_allocated_bytes == sim.peak_allocated_bytes and real.phase == sim.phase
    assert [t[:2] for t in real.allocations if t[1].startswith("_scaled_dot_product")] == \
        [("forward", "_scaled_dot_product_flash_attention_for_cpu.default")] * 2 * 2 + \
        [("backward", "_scaled_dot_product_flash_attention_for_cpu_backward.default")] * 3 * 2  # out+lse; dq, dk, dv
    assert max(live for _, _, live in real.trace) == real.peak_allocated_bytes  # the peak is one operator's moment


def test_first_divergence_names_the_kernel_two_steps_part_at(tmp_path):
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.tracker import first_divergence
    model = _tiny_pythia(tmp_path)
    sdpa = simulate(model, trace=True, **PYTHIA_STEP).allocations
    eager = simulate(model, trace=True, **{**PYTHIA_STEP, "attn_implementation": "eager"}).allocations
    d = first_divergence(sdpa, eager)
    assert set(d["only_a"]) == {"forward _scaled_dot_product_flash_attention_for_cpu.default",
                                "backward _scaled_dot_product_flash_attention_for_cpu_backward.default"}
    assert "forward _softmax.default" in d["only_b"] and d["only_b"]["forward _softmax.default"] > 0
    assert first_divergence(sdpa, sdpa[:-1]) == {"index": len(sdpa) - 1, "a": sdpa[-1], "b": None,
                                                 "only_a": {f"{sdpa[-1][0]} {sdpa[-1][1]}": sdpa[-1][2]}, "only_b": {}}


def test_gpu_matmul_probe_runs_on_cpu_and_times_each_shape_in_the_model(tmp_path):
    """The probe the next GPU session runs (the time model's matmul against CUDA's), exercised on tiny CPU shapes;
    it finds the catalog row of the GPU torch names."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_matmul_probe as probe
    finally:
        sys.path.pop(0)
    out = tmp_path / "probe.json"
    assert probe.main(["--cpu", "--repeat", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == [s[0] for s in probe.cpu_shapes()]
    assert all(r["measured_seconds"] > 0 and r["model_seconds"] > 0 for r in rows)
    assert probe.catalog_gpu("NVIDIA H100 80GB HBM3")["name"] == "H100-SXM"
    assert probe.catalog_gpu("NVIDIA H200")["name"] == "H200"


def test_gpu_validate_sets_the_time_model_beside_the_timed_step():
    """On a GPU each row gets the time model's step for that card, found by the name torch gives it."""
    gpu_validate = _gpu_validate()
    kw = dict(method="qlora", seq_len=512, lora_rank=64, lora_alpha=16, gradient_checkpointing=True)
    got = gpu_validate.modelled_time("llama-3.2-1b", kw, "NVIDIA H100 80GB HBM3")
    assert got["model_gpu"] == "H100-SXM" and got["model_step_seconds"] > 0 and "matmul" in got["model_step_parts"]
    assert "not in the GPU catalog" in gpu_validate.modelled_time("llama-3.2-1b", kw, "Quadro P400")["model_step_note"]
