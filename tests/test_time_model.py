"""The kernel-level step-time model: dtypes and attention kernels CUDA runs, the fitted constants as committed,
the reference rows it is judged on, the interval."""
import json
from pathlib import Path

import pytest

from lora_kit.memory.cuda_kernels import EFFICIENT_GQA_FROM
from lora_kit.plan import time_constants as C
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.timing import TimeModel, attention_kernel, calibrate, step_time

ROOT = Path(__file__).parents[1]
H200 = get_gpu("H200")


def test_attention_kernel_follows_sdpa_dispatch():
    # QLoRA's recipe hands SDPA fp32 q/k/v: GQA falls back to the math kernel before torch 2.14
    assert attention_kernel("llama-3.1-8b", dict(method="qlora"), H200, torch_version=(2, 13)) == "math"
    assert attention_kernel("llama-3.1-8b", dict(method="qlora"), H200, torch_version=(2, 14)) == "mem_efficient"
    assert attention_kernel("llama-2-7b", dict(method="qlora"), H200, torch_version=(2, 13)) == "mem_efficient"  # MHA
    assert attention_kernel("llama-3.1-8b", dict(method="lora"), H200) == "flash"
    assert attention_kernel("llama-3.1-8b", dict(method="lora"), get_gpu("T4"), torch_version=(2, 13)) == "math"  # sm75
    assert attention_kernel("llama-3.1-8b", dict(method="lora", attn_implementation="eager"), H200) == "eager"
    assert C.MEM_EFFICIENT_GQA_FROM_TORCH == EFFICIENT_GQA_FROM  # the rule cuda_kernels reads


def test_attention_kernel_sees_autocast_and_the_mask():
    """CUDA's autocast casts SDPA's inputs to bf16 (flash, even under QLoRA's fp32 residual stream); with a mask
    transformers repeats K/V itself and the memory-efficient kernel takes fp32 before torch 2.14; before torch 2.5
    (no enable_gqa) transformers always repeats them. Attention time follows the kernel's dtype."""
    kw = dict(method="qlora", seq_len=4096, batch_size=1)
    assert attention_kernel("llama-3.1-8b", dict(kw, autocast=True), H200, torch_version=(2, 13)) == "flash"
    padded = dict(kw, padding="max_length")
    assert attention_kernel("llama-3.1-8b", padded, H200, torch_version=(2, 13)) == "mem_efficient"
    assert attention_kernel("llama-3.1-8b", kw, H200, torch_version=(2, 4)) == "mem_efficient"
    fp32 = step_time("llama-3.1-8b", H200, **kw)["parts_seconds"]["attention"]
    bf16 = step_time("llama-3.1-8b", H200, autocast=True, **kw)["parts_seconds"]["attention"]
    lora = step_time("llama-3.1-8b", H200, **dict(kw, method="lora"))["parts_seconds"]["attention"]
    assert bf16 == pytest.approx(lora) and fp32 > 3 * bf16  # fp32 (math or memory-efficient) on CUDA cores


def test_qlora_recipe_runs_head_and_adapters_in_fp32_and_costs_more_than_dequant():
    kw = dict(seq_len=2048, batch_size=1, gradient_checkpointing=True)
    lo = step_time("llama-3.1-8b", H200, method="lora", **kw)
    q = step_time("llama-3.1-8b", H200, method="qlora", **kw)
    assert q["dtypes"]["head"] == "float32" and q["dtypes"]["activations"] == "float32"
    assert lo["dtypes"]["head"] == "bfloat16"
    extra = q["step_seconds"] - lo["step_seconds"]
    assert extra > q["dequant_seconds"] > 0  # fp32 lm_head, math attention and fp32 traffic add to it
    assert q["parts_seconds"]["lm_head_loss"] > 3 * lo["parts_seconds"]["lm_head_loss"]
    assert q["parts_seconds"]["attention"] > 3 * lo["parts_seconds"]["attention"]


def test_grad_accum_repeats_micro_steps_not_the_optimizer():
    one = step_time("llama-3.2-1b", H200, method="full", seq_len=512, gradient_checkpointing=False)
    four = step_time("llama-3.2-1b", H200, method="full", seq_len=512, gradient_checkpointing=False, grad_accum=4)
    opt = one["optimizer_seconds"]
    assert four["optimizer_seconds"] == pytest.approx(opt) and opt > 0
    assert four["step_seconds"] - opt == pytest.approx(4 * (one["step_seconds"] - opt))
    assert four["tokens_per_step"] == 4 * one["tokens_per_step"]


def test_interval_is_the_measured_error_and_shrinks_with_calibration():
    base = dict(model="llama-3.2-1b", method="lora", seq_len=1024, batch_size=2)
    t = step_time("llama-3.2-1b", H200, **{k: v for k, v in base.items() if k != "model"})
    lo, hi = t["interval_seconds"]
    assert lo == pytest.approx(t["step_seconds"] / C.ERROR_FACTOR_UNCALIBRATED)
    assert hi == pytest.approx(t["step_seconds"] * C.ERROR_FACTOR_UNCALIBRATED)
    tm = calibrate(0.9 * t["step_seconds"], base, H200)
    assert tm.error_factor == min(C.ERROR_FACTOR_CALIBRATED, C.ERROR_FACTOR_UNCALIBRATED)
    with pytest.raises(ValueError, match="error_factor"):
        TimeModel(error_factor=0.5)


def test_shipped_constants_are_the_committed_fit():
    res = json.loads((ROOT / "benchmarks/results/time_published.json").read_text())
    assert res["fit"] and res["constants"] == C.FITTED
    worst = max(res["fitted"]["max_factor"], res["judged"]["max_factor"],
                *(v["max_factor"] for v in res["leave_one_source_out"].values()))
    assert C.ERROR_FACTOR_UNCALIBRATED == pytest.approx(worst, abs=0.01)
    assert C.ERROR_FACTOR_CALIBRATED == pytest.approx(res["calibrated"]["same_model_and_method"]["max_factor"],
                                                      abs=0.01)


def test_reference_rows_name_their_source_and_scope():
    rows = json.loads((ROOT / "benchmarks/reference/time_rows.json").read_text())["rows"]
    assert {r["role"] for r in rows if not r["out_of_scope"]} == {"fit", "judged"}
    for r in rows:
        assert r["url"] and r["field"] and r["source"]
        if r["out_of_scope"]:
            assert len(r["out_of_scope"]) > 10
        else:
            assert r["measured"]["step_seconds"] > 0 and get_gpu(r["gpu"])
    sources = {r["source"] for r in rows if not r["out_of_scope"]}
    assert len(sources) >= 3
    for s in sources:  # every in-scope source has a judged row
        assert any(r["role"] == "judged" for r in rows if r["source"] == s and not r["out_of_scope"])


def test_l2_resident_traffic_is_faster_only_where_it_fits():
    l40s = get_gpu("L40S")
    no_l2 = dict(l40s, l2_mb=0.0001)  # a row's own l2_mb wins over the datasheet table
    short = dict(method="lora", seq_len=256, batch_size=2, gradient_checkpointing=False)
    fast = step_time("llama-3.2-3b", l40s, **short)["parts_seconds"]["elementwise"]
    slow = step_time("llama-3.2-3b", no_l2, **short)["parts_seconds"]["elementwise"]
    assert fast < slow / 1.2
    long = dict(short, seq_len=16384)  # activations far beyond 96 MB: DRAM-bound either way
    a = step_time("llama-3.2-3b", l40s, **long)["parts_seconds"]["elementwise"]
    b = step_time("llama-3.2-3b", no_l2, **long)["parts_seconds"]["elementwise"]
    assert a == pytest.approx(b, rel=0.05)
